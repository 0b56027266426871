"""experiments/disagg_prefill_decode.py: a prefill process and a decode process joined by
jax.experimental.transfer give one mixed engine's greedy tokens, and the K/V really move
(every request with a full prompt block pulls bytes and writes blocks in the decoder)."""

import pytest

from experiments import disagg_prefill_decode as disagg

OPTIONS = {"block_size": 4, "max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32}


@pytest.mark.slow  # two child processes, each compiling its engine (~30 s on 2 cores)
def test_two_processes_equal_one_mixed_engine():
    trace = disagg.make_trace(6, 0.5, 40, 9, 8, 50.0, 256, seed=1)
    mixed = disagg.serve("mixed", trace, "random:tiny_llama", OPTIONS, timeout_s=300)
    split = disagg.serve("disaggregated", trace, "random:tiny_llama", OPTIONS, timeout_s=300)
    assert sorted(mixed["records"]) == sorted(split["records"]) == [str(i) for i in range(6)]
    for request_id, record in mixed["records"].items():
        assert len(record["tokens"]) == 8
        assert split["records"][request_id]["tokens"] == record["tokens"], request_id
        moved = split["records"][request_id]
        full_blocks = (len(trace[int(request_id)]["prompt"]) - 1) // OPTIONS["block_size"]
        assert moved["blocks_written"] == full_blocks > 0
        assert moved["kv_bytes"] > 0
    stats = split["stats"]["stats"]
    assert stats["num_imported_blocks"] == sum(r["blocks_written"] for r in split["records"].values())
    assert stats["prefix_cache_hit_tokens"] >= stats["num_imported_blocks"] * OPTIONS["block_size"]
    summary = disagg.summarize(split)
    assert summary["kv_transfer"]["kv_bytes_total"] == sum(r["kv_bytes"] for r in split["records"].values())
