"""experiments/peer_hf.py's HF static-batching baseline, on a tiny random-weight Llama.

The throughput ratio it reports is only meaningful if the baseline generates what our
engine generates and counts only the tokens each request asked for: so its greedy outputs
(left-padded batches, EOS off) must equal our engine's on the same weights (up to a
checked near-tie), and its useful / overrun / padding accounting must be exact.
"""

import pytest
import torch
import transformers
from tests.helpers.greedy_check import assert_greedy_match
from tests.helpers.hf_variants import VARIANTS, reinit

from experiments.benchmarks.workloads import Request
from experiments.peer_hf import compare_greedy, hf_static, paged_jax_run
from paged_jax.loading import LoadedModel
from paged_jax.loading.hf_weights import load_hf_directory

# (prompt length, max_tokens); batch_size 3: batches [0, 1, 2] (runs 9 tokens) and [3] (runs 6)
SHAPES = [(5, 3), (17, 9), (1, 1), (12, 6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf_model, LoadedModel) holding the same random weights."""
    model = transformers.AutoModelForCausalLM.from_config(VARIANTS["llama_tied"](), dtype=torch.float32)
    reinit(model, seed=7)
    model.eval()
    path = str(tmp_path_factory.mktemp("peer_hf"))
    model.save_pretrained(path)
    cfg, params = load_hf_directory(path)
    return model, LoadedModel(cfg, params, None, path, "hf", 0.0)


def _requests():
    gen = torch.Generator().manual_seed(0)
    return [Request(tuple(torch.randint(3, 256, (n,), generator=gen).tolist()), m, 0.0) for n, m in SHAPES]


@pytest.mark.slow  # HF generate and the engine on the same trace
def test_static_accounting_and_greedy_parity(tiny):
    model, loaded = tiny
    requests = _requests()
    hf_out, figures = hf_static(model, requests, batch_size=3, progress=False)
    assert [len(o) for o in hf_out] == [m for _, m in SHAPES]
    assert figures["num_batches"] == 2
    assert figures["useful_output_tokens"] == 3 + 9 + 1 + 6
    assert figures["generated_tokens"] == 3 * 9 + 1 * 6
    assert figures["overrun_tokens"] == 3 * 9 + 6 - 19
    assert figures["padding_prompt_tokens"] == (17 - 5) + 0 + (17 - 1) + 0

    ours, _ = paged_jax_run(loaded, requests, max_model_len=128, max_num_seqs=4, progress=False,
                            max_num_batched_tokens=32)  # few step shapes to compile

    def next_logits(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].numpy()
    for r, want, got in zip(requests, hf_out, ours):
        assert_greedy_match(r.prompt_token_ids, want, got, next_logits)
    assert len({t for o in hf_out for t in o}) > 6, f"degenerate test model: {hf_out}"


def test_compare_greedy_counts_and_locates_a_changed_token(tiny):
    """A token the HF model ranks last, put in place of its greedy choice, is a mismatch at
    that request and position; the untouched outputs are equal."""
    model, _ = tiny
    requests = _requests()
    hf_out, _ = hf_static(model, requests, batch_size=3, progress=False)
    prefix = list(requests[1].prompt_token_ids) + hf_out[1][:2]
    with torch.no_grad():
        worst = int(model(torch.tensor([prefix])).logits[0, -1].argmin())
    candidate = [list(o) for o in hf_out]
    candidate[1][2] = worst
    counts = compare_greedy(model, requests, hf_out, candidate)
    assert (counts["equal"], counts["near_tie"], counts["mismatch"]) == (3, 0, 1)
    assert counts["mismatched_requests"] == [1] and counts["first_differences"] == {"1": 2}
    assert compare_greedy(model, requests, hf_out, hf_out)["equal"] == len(requests)
