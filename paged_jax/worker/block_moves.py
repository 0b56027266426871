"""Whole KV blocks in and out of the device cache: swap to and from host memory, and
reads / writes of arbitrary blocks (a prompt's K/V handed to another engine).

A mixin of ModelRunner (model_runner.py builds the jitted `_gather_blocks` and
`_swap_in` and owns `kv_cache`, `host_cache`, `mesh`, `num_blocks`): split out so the
runner's file keeps to the step. Every move goes SWAP_CHUNK blocks per call, padded, so
one compiled shape serves any number of blocks: a padding read takes the null block,
a padding write targets block id `num_blocks` (out of range) and is dropped.
"""

from __future__ import annotations

import time

import numpy as np

from paged_jax.distributed import tensor_parallel as tp

SWAP_CHUNK = 16  # blocks moved per call: a fixed shape, compiled at warm-up


class BlockMovesMixin:
    def _do_swap_out(self, pairs) -> None:
        """Device blocks -> host blocks, SWAP_CHUNK at a time (one compiled shape)."""
        start = time.perf_counter()
        for chunk in _chunks(pairs):
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = [d for d, _ in chunk]
            k, v = self._gather_blocks(self.kv_cache, src)
            host = [h for _, h in chunk]
            self.host_cache["k"][:, host] = np.asarray(k)[:, : len(chunk)]
            self.host_cache["v"][:, host] = np.asarray(v)[:, : len(chunk)]
        self.device_seconds += time.perf_counter() - start

    def _do_swap_in(self, pairs) -> None:
        """Host blocks -> device blocks, SWAP_CHUNK at a time."""
        start = time.perf_counter()
        for chunk in _chunks(pairs):
            dst = np.full(SWAP_CHUNK, self.num_blocks, np.int32)  # out of range: dropped
            dst[: len(chunk)] = [d for _, d in chunk]
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = [h for h, _ in chunk]
            k, v = self.host_cache["k"][:, src], self.host_cache["v"][:, src]
            self._write_chunk(dst, k, v)
        self.device_seconds += time.perf_counter() - start

    def _write_chunk(self, dst: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        if self.mesh is not None:  # each device receives only its heads of the blocks
            k, v = (tp.place(a, tp.cache_sharding(self.mesh)) for a in (k, v))
        self.kv_cache = self._swap_in(self.kv_cache, dst, k, v)

    def read_blocks(self, block_ids) -> tuple[np.ndarray, np.ndarray]:
        """K and V of device blocks `block_ids`, in that order: two host arrays
        [layers, len(block_ids), block_size, kv_heads, head_dim]."""
        start = time.perf_counter()
        ids = [int(b) for b in block_ids]
        ks, vs = [], []
        for i in range(0, len(ids), SWAP_CHUNK):
            chunk = ids[i:i + SWAP_CHUNK]
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = chunk
            k, v = self._gather_blocks(self.kv_cache, src)
            ks.append(np.asarray(k)[:, : len(chunk)])
            vs.append(np.asarray(v)[:, : len(chunk)])
        self.device_seconds += time.perf_counter() - start
        if not ks:
            empty = np.zeros(self.host_cache["k"].shape[:1] + (0,) + self.host_cache["k"].shape[2:],
                             self.host_cache["k"].dtype)
            return empty, empty.copy()
        return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)

    def check_block_arrays(self, num_blocks: int, k: np.ndarray, v: np.ndarray) -> None:
        """ValueError unless k and v are `num_blocks` blocks in read_blocks' layout and the
        cache's dtype (what write_blocks accepts)."""
        expected = self.host_cache["k"].shape[:1] + (num_blocks,) + self.host_cache["k"].shape[2:]
        for name, a in (("k", k), ("v", v)):
            if a.shape != expected or a.dtype != self.host_cache["k"].dtype:
                raise ValueError(f"{name} must be {self.host_cache['k'].dtype}{list(expected)} for {num_blocks} "
                                 f"blocks, got {a.dtype}{list(a.shape)}")

    def write_blocks(self, block_ids, k: np.ndarray, v: np.ndarray) -> None:
        """Overwrite device blocks `block_ids` with K and V ([layers, len(block_ids), ...],
        read_blocks' layout and the cache's dtype)."""
        ids = [int(b) for b in block_ids]
        self.check_block_arrays(len(ids), k, v)
        if any(not 0 < b < self.num_blocks for b in ids):
            raise ValueError(f"block ids must be in [1, {self.num_blocks}) (0 is the null block), got {ids}")
        start = time.perf_counter()
        for i in range(0, len(ids), SWAP_CHUNK):
            chunk = ids[i:i + SWAP_CHUNK]
            dst = np.full(SWAP_CHUNK, self.num_blocks, np.int32)
            dst[: len(chunk)] = chunk
            pad = [(0, 0), (0, SWAP_CHUNK - len(chunk))] + [(0, 0)] * (k.ndim - 2)
            self._write_chunk(dst, np.pad(k[:, i:i + len(chunk)], pad), np.pad(v[:, i:i + len(chunk)], pad))
        self.device_seconds += time.perf_counter() - start

    def warm_up_block_moves(self) -> None:
        """Compile the chunked gather and scatter (swap, or block reads / writes)."""
        import jax
        null = np.zeros(SWAP_CHUNK, np.int32)
        k, v = self._gather_blocks(self.kv_cache, null)
        jax.block_until_ready(k)
        self._write_chunk(np.full(SWAP_CHUNK, self.num_blocks, np.int32), np.asarray(k), np.asarray(v))


def _chunks(pairs):
    pairs = list(pairs)
    return [pairs[i:i + SWAP_CHUNK] for i in range(0, len(pairs), SWAP_CHUNK)]
