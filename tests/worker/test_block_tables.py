"""The runner's kept block tables: rebuilt from the scheduler's updates alone, every
step's batch must hold each sequence's true table (the block manager's), whatever grew,
forked, copied on write, hit the prefix cache, was swapped or recomputed meanwhile."""

import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler_output import ScheduledChunk, SchedulerOutput
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.allocators import make_allocator
from paged_jax.loading import LoadedModel
from paged_jax.worker.batch_inputs import prepare_batch
from paged_jax.worker.block_tables import HostBlockTables
from paged_jax.worker.kv_cache import bytes_per_block
from tests.helpers.model_free_runner import MODEL_CONFIG, ContentCheckingRunner, StepClock


class BatchCheckingRunner(ContentCheckingRunner):
    """Builds each step's real padded batch and compares its tables with the truth."""

    true_table = None  # seq id -> the block manager's table; set once the engine exists

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.config = args[2]
        self.host_tables = HostBlockTables(-(-self.config.max_model_len // self.config.block_size))
        self.rows_checked = 0
        self.max_rows_kept = 0

    def execute(self, output, seqs):
        cfg, bs = self.config, self.config.block_size
        batch = prepare_batch(output, seqs, self.host_tables, block_size=bs, num_blocks=self.num_blocks,
                              seq_buckets=cfg.seq_buckets, token_buckets=cfg.token_buckets,
                              max_copies=self.max_copies)
        cursor = 0
        for row, chunk in enumerate(output.chunks):
            table = self.true_table(chunk.seq_id)
            want = np.zeros(self.host_tables.width, np.int32)
            want[: len(table)] = table
            np.testing.assert_array_equal(batch.block_tables[row], want, err_msg=f"seq {chunk.seq_id}")
            positions = np.arange(chunk.start_position, chunk.start_position + chunk.num_tokens)
            slots = np.asarray(table)[positions // bs] * bs + positions % bs
            np.testing.assert_array_equal(batch.slot_mapping[cursor:cursor + chunk.num_tokens], slots)
            cursor += chunk.num_tokens
            self.rows_checked += 1
        self.max_rows_kept = max(self.max_rows_kept, len(self.host_tables))
        return super().execute(output, seqs)


def _serve(**config) -> BatchCheckingRunner:
    config.setdefault("attention_backend", "reference")
    config.setdefault("seq_buckets", (4, 8))
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("token_buckets", (8, 16, 32, 64))
    if config.get("preemption_mode") == "swap":
        config["swap_space_bytes"] = 64 * bytes_per_block(MODEL_CONFIG, config["block_size"], "float32")
    config = EngineConfig(**config)
    model = LoadedModel(MODEL_CONFIG, None, None, "model-free", "none", 0.0)
    engine = LLMEngine(model, config, runner_factory=BatchCheckingRunner, clock=StepClock(),
                       allocator_factory=make_allocator)
    engine.runner.true_table = engine.block_manager.block_table
    shared = list(range(3, 3 + 2 * config.block_size))  # two full blocks every prompt starts with
    n = 1 if config.kv_allocator != "paged" else 2  # n=2: a fork, then copy-on-write
    for i in range(6):
        prompt = shared + [20 + i] * (i + 1)
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(n=n, max_tokens=10 + 2 * i, ignore_eos=True, temperature=0.0))
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {str(i) for i in range(6)}
    # finished sequences are named in the next step's output: one more request, and only its table is kept
    engine.add_request("last", {"prompt_token_ids": [7, 8]}, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    last = engine.core._requests_builder.next_seq_id - 1
    assert len(engine.runner.host_tables) == 1 and last in engine.runner.host_tables
    return engine


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_kept_tables_match_the_block_manager_through_forks_hits_and_preemption(mode):
    engine = _serve(block_size=4, num_blocks=24, max_model_len=64, max_num_seqs=8, preemption_mode=mode,
                    enable_prefix_caching=True, watermark=0.0)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and engine.scheduler.prefix_cache_hit_tokens > 0  # the hard paths ran
    assert engine.runner.rows_checked > 100


def test_kept_tables_match_a_contiguous_allocators_tables():
    engine = _serve(block_size=4, num_blocks=40, max_model_len=64, max_num_seqs=8, kv_allocator="contiguous-oracle")
    assert engine.runner.rows_checked > 50


def _chunk(seq_id, kept, new, start=0):
    return ScheduledChunk(seq_id=seq_id, token_ids=(1,), start_position=start, num_kept_blocks=kept,
                          new_block_ids=tuple(new), sample=True)


def test_updates_keep_replace_and_restart_rows():
    tables = HostBlockTables(4)
    assert tables.update(_chunk(7, 0, [5, 6])).tolist() == [5, 6, 0, 0]
    assert tables.update(_chunk(7, 2, [])).tolist() == [5, 6, 0, 0]
    assert tables.update(_chunk(7, 1, [9, 3])).tolist() == [5, 9, 3, 0]  # copy-on-write of entry 1, one more
    assert tables.update(_chunk(7, 0, [2])).tolist() == [2, 0, 0, 0]  # rebuilt: no stale entries stay
    tables.drop_departed(SchedulerOutput(chunks=(), finished_seq_ids=(7,)))
    assert len(tables) == 0
    with pytest.raises(ValueError, match="never saw"):
        tables.update(_chunk(7, 1, []))
    with pytest.raises(ValueError, match="exceed max_blocks_per_seq"):
        tables.update(_chunk(8, 0, [1, 2, 3, 4, 5]))
