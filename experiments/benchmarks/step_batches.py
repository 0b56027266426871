"""Hand-built engine batches for timing one step shape (experiments/roofline.py,
experiments/helper_threads.py): real block tables and contexts without a scheduler, and
the step's median time."""

from __future__ import annotations

import statistics
import time


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def median_ms(fn, iters: int) -> float:
    """Median of `iters` timed calls of fn, in ms, after one untimed call (the shape is
    compiled already; that call pages in the buffers)."""
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def build_batch(runner, q_lens, starts, rng):
    """A BatchInputs of the engine's bucketed shape: row i has q_lens[i] new tokens from
    position starts[i], its context in distinct shuffled blocks (as a long-running block
    pool hands them out), slots mapped through its table as prepare_batch does."""
    import numpy as np

    from paged_jax.worker.batch_inputs import batch_shape
    config, bs = runner.config, runner.config.block_size
    S, T = batch_shape(config.seq_buckets, config.token_buckets, len(q_lens), sum(q_lens))
    batch = runner.empty_batch(S, T)
    needed = [cdiv(s + q, bs) for q, s in zip(q_lens, starts)]
    if sum(needed) > runner.num_blocks - 1:
        raise ValueError(f"{sum(needed)} blocks needed, the cache has {runner.num_blocks - 1}")
    pool = 1 + rng.permutation(runner.num_blocks - 1)
    cursor, used = 0, 0
    for row, (q_len, start, n_blocks) in enumerate(zip(q_lens, starts, needed)):
        table = np.zeros(runner.max_blocks_per_seq, np.int32)
        table[:n_blocks] = pool[used:used + n_blocks]
        used += n_blocks
        positions = np.arange(start, start + q_len, dtype=np.int32)
        span = slice(cursor, cursor + q_len)
        batch.token_ids[span] = rng.integers(3, runner.model_config.vocab_size, q_len)
        batch.positions[span] = positions
        batch.slot_mapping[span] = table[positions // bs] * bs + positions % bs
        batch.block_tables[row] = table
        batch.context_lens[row] = start + q_len
        cursor += q_len
        batch.query_start_loc[row + 1] = cursor
        batch.logits_indices[row] = cursor - 1
    batch.query_start_loc[len(q_lens) + 1:] = cursor
    return batch
