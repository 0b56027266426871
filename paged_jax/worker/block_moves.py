"""Whole KV blocks in and out of the device cache: swap to and from host memory, and
reads / writes of arbitrary blocks (a prompt's K/V handed to another engine).

`BlockMover` is held by the ModelRunner, which owns the device cache: every method that
changes the cache takes it and returns the new one (the jitted scatter donates it), so
the data flow stays explicit. The mover owns the host swap space and the two jitted moves.
Every move goes SWAP_CHUNK blocks per call, padded, so one compiled shape serves any
number of blocks: a padding read takes the null block, a padding write targets block id
`num_blocks` (out of range) and is dropped.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from paged_jax.distributed import tensor_parallel as tp

SWAP_CHUNK = 16  # blocks moved per call: a fixed shape, compiled at warm-up


def _swap_in_impl(kv_cache, dst, k_blocks, v_blocks):
    return {"k": kv_cache["k"].at[:, dst].set(k_blocks, mode="drop"),
            "v": kv_cache["v"].at[:, dst].set(v_blocks, mode="drop")}


def _gather_blocks_impl(kv_cache, src):
    return kv_cache["k"][:, src], kv_cache["v"][:, src]


class BlockMover:
    def __init__(self, host_shape: tuple[int, ...], dtype, num_blocks: int, mesh=None):
        """host_shape: [layers, host blocks, block_size, kv_heads, head_dim] of the swap space
        (0 host blocks: no swapping); num_blocks: the device cache's blocks; mesh: the
        tensor-parallel mesh the cache is sharded over, or None."""
        self.host_cache = {name: np.zeros(host_shape, dtype) for name in ("k", "v")}
        self.num_blocks = num_blocks
        self.mesh = mesh
        self.seconds = 0.0  # wall time spent moving blocks (the runner counts it as device time)
        shardings = {} if mesh is None else {"out_shardings": tp.cache_sharding(mesh)}
        self._swap_in = jax.jit(_swap_in_impl, donate_argnums=(0,), **shardings)
        self._gather_blocks = jax.jit(_gather_blocks_impl)

    @property
    def num_host_blocks(self) -> int:
        return self.host_cache["k"].shape[1]

    def swap_out(self, kv_cache, pairs) -> None:
        """(device block, host block) pairs: device -> host, SWAP_CHUNK at a time."""
        start = time.perf_counter()
        for chunk in _chunks(pairs):
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = [d for d, _ in chunk]
            k, v = self._gather_blocks(kv_cache, src)
            host = [h for _, h in chunk]
            self.host_cache["k"][:, host] = np.asarray(k)[:, : len(chunk)]
            self.host_cache["v"][:, host] = np.asarray(v)[:, : len(chunk)]
        self.seconds += time.perf_counter() - start

    def swap_in(self, kv_cache, pairs):
        """(host block, device block) pairs: host -> device; returns the new cache."""
        start = time.perf_counter()
        for chunk in _chunks(pairs):
            dst = np.full(SWAP_CHUNK, self.num_blocks, np.int32)  # out of range: dropped
            dst[: len(chunk)] = [d for _, d in chunk]
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = [h for h, _ in chunk]
            kv_cache = self._write_chunk(kv_cache, dst, self.host_cache["k"][:, src], self.host_cache["v"][:, src])
        self.seconds += time.perf_counter() - start
        return kv_cache

    def _write_chunk(self, kv_cache, dst: np.ndarray, k: np.ndarray, v: np.ndarray):
        if self.mesh is not None:  # each device receives only its heads of the blocks
            k, v = (tp.place(a, tp.cache_sharding(self.mesh)) for a in (k, v))
        return self._swap_in(kv_cache, dst, k, v)

    def read_blocks(self, kv_cache, block_ids) -> tuple[np.ndarray, np.ndarray]:
        """K and V of device blocks `block_ids`, in that order: two host arrays
        [layers, len(block_ids), block_size, kv_heads, head_dim]."""
        start = time.perf_counter()
        ids = [int(b) for b in block_ids]
        ks, vs = [], []
        for i in range(0, len(ids), SWAP_CHUNK):
            chunk = ids[i:i + SWAP_CHUNK]
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = chunk
            k, v = self._gather_blocks(kv_cache, src)
            ks.append(np.asarray(k)[:, : len(chunk)])
            vs.append(np.asarray(v)[:, : len(chunk)])
        self.seconds += time.perf_counter() - start
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

    def write_blocks(self, kv_cache, block_ids, k: np.ndarray, v: np.ndarray):
        """Overwrite device blocks `block_ids` with K and V ([layers, len(block_ids), ...],
        read_blocks' layout and the cache's dtype); returns the new cache."""
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
            kv_cache = self._write_chunk(kv_cache, dst, np.pad(k[:, i:i + len(chunk)], pad),
                                         np.pad(v[:, i:i + len(chunk)], pad))
        self.seconds += time.perf_counter() - start
        return kv_cache

    def warm_up(self, kv_cache):
        """Compile the chunked gather and scatter (swap, or block reads / writes); returns the cache."""
        k, v = self._gather_blocks(kv_cache, np.zeros(SWAP_CHUNK, np.int32))
        jax.block_until_ready(k)
        return self._write_chunk(kv_cache, np.full(SWAP_CHUNK, self.num_blocks, np.int32), np.asarray(k),
                                 np.asarray(v))


def _chunks(pairs):
    pairs = list(pairs)
    return [pairs[i:i + SWAP_CHUNK] for i in range(0, len(pairs), SWAP_CHUNK)]
