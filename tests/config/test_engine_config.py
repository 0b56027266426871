"""EngineConfig's default buckets: powers of two, 1.5x midpoints for the big sizes, the
limit itself last; big batches pad by less than half instead of up to double."""

from __future__ import annotations

from paged_jax.config.engine_config import EngineConfig, default_buckets
from paged_jax.worker.batch_inputs import pick_bucket


def test_default_buckets_by_hand():
    assert default_buckets(1, 128) == (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
    assert default_buckets(8, 256) == (8, 16, 32, 48, 64, 96, 128, 192, 256)
    assert default_buckets(1, 32) == (1, 2, 4, 8, 16, 32)
    assert default_buckets(8, 100) == (8, 16, 32, 48, 64, 96, 100)


def test_big_batches_pad_by_less_than_half():
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=512)
    assert config.seq_buckets == default_buckets(1, 256) and config.token_buckets == default_buckets(8, 512)
    for n in range(33, 257):
        assert pick_bucket(config.seq_buckets, n) < 1.5 * n, n
    for n in range(1, 33):  # small sizes: powers of two
        assert pick_bucket(config.seq_buckets, n) < 2 * n
