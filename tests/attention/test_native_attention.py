"""The C++ CPU kernel (attention backend "native") against the jnp reference.

A randomized grid of ragged batches (decode rows, prefill chunks, both in one batch,
sequences without a query this step, padding tokens; contexts at the block edges; GQA
1..7, head_dim 64/80/128, block sizes 8..64, windows and soft caps; f32 and bf16 caches;
every slot outside the tables is NaN), a long prefill tile over many blocks, and the
errors the kernel reports instead of reading out of bounds.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels.ragged_paged_attention import ragged_paged_attention_cpu
from tests.helpers.kernel_cases import (assert_matches_ragged_reference, balanced_sample, case_id,
                                        grid_context_lens, make_case, ragged_args)

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is the CPU backend")

_CASES = balanced_sample(
    12, seed=31, num_seqs=list(range(1, 9)), group=[1, 2, 4, 7], head_dim=[64, 80, 128], block_size=[8, 16, 32, 64],
    window=[False, True], cap=[False, True], dtype=[np.float32, jnp.bfloat16], kind=["decode", "prefill", "mixed"])


def _case(index, c):
    rng = np.random.default_rng(3000 + index)
    block_size = c["block_size"]
    lens, max_blocks = grid_context_lens(rng, index, block_size, c["num_seqs"])
    if c["kind"] == "decode":
        q_lens = [min(n, 1) for n in lens]
    elif c["kind"] == "prefill":
        q_lens = [int(rng.integers(1, n + 1)) if n else 0 for n in lens]
    else:  # one prefill chunk (the longest context, whole) among decodes
        q_lens = [min(n, 1) for n in lens]
        q_lens[int(np.argmax(lens))] = max(lens)
    if len(lens) > 1:
        q_lens[1] = 0  # a sequence without a query this step
    case = make_case(rng, context_lens=lens, q_lens=q_lens, num_heads=c["group"] * 2, num_kv_heads=2,
                     head_dim=c["head_dim"], block_size=block_size, max_blocks_per_seq=max_blocks,
                     dtype=c["dtype"], num_padding_tokens=index % 4)
    window = [1, block_size - 1 or 1, block_size + 3, 40][index % 4] if c["window"] else None
    return case, dict(sliding_window=window, soft_cap=1.5 if c["cap"] else None)


@pytest.mark.parametrize("index", range(len(_CASES)), ids=[f"{c['kind']}-{case_id(c)}" for c in _CASES])
def test_matches_the_reference(index):
    c = _CASES[index]
    case, kwargs = _case(index, c)
    got = ragged_paged_attention_cpu(*ragged_args(case), **kwargs)
    assert got.dtype == case.q.dtype
    assert_matches_ragged_reference(got, case, c["dtype"], **kwargs)


def test_long_prefill_tiles_and_many_kv_heads():
    """Query tiles that span many blocks and KV heads that do not fit one work item
    (64 query rows per item: 8 KV heads x group 8 -> one head per item), sm_scale given."""
    rng = np.random.default_rng(5)
    case = make_case(rng, context_lens=[300, 37], q_lens=[200, 37], num_heads=64, num_kv_heads=8, head_dim=64,
                     block_size=16, max_blocks_per_seq=20, num_padding_tokens=5)
    got = ragged_paged_attention_cpu(*ragged_args(case), sm_scale=0.1)
    assert_matches_ragged_reference(got, case, np.float32, sm_scale=0.1)


@pytest.mark.parametrize("head_dim,block_size,group,window,cap", [(64, 16, 3, None, None), (64, 8, 1, 37, None),
                                                                   (128, 32, 4, None, 1.5), (64, 64, 7, 300, None)])
def test_bf16_prefill_tiles_over_many_chunks(head_dim, block_size, group, window, cap):
    """bf16 prefill tiles (where the CPU has AMX and head_dim % 64 == 0, on its tiles:
    cpu_kernels/attention_amx.h) over contexts of several 256-key chunks, with query tiles
    of 64 // group tokens (last row tiles partly padding), every slot outside the tables NaN."""
    rng = np.random.default_rng(head_dim + block_size + group)
    lens = [600, 45, 290]
    case = make_case(rng, context_lens=lens, q_lens=[333, 45, 17], num_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, block_size=block_size, max_blocks_per_seq=-(-max(lens) // block_size) + 1,
                     dtype=jnp.bfloat16, num_padding_tokens=3)
    got = ragged_paged_attention_cpu(*ragged_args(case), sliding_window=window, soft_cap=cap)
    assert_matches_ragged_reference(got, case, jnp.bfloat16, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("dtype,head_dim,block_size,window", [(np.float32, 64, 16, None), (np.float32, 128, 32, 41),
                                                               (jnp.bfloat16, 80, 32, None), (jnp.bfloat16, 80, 16, 23)])
def test_prefill_keys_transposed_in_registers(dtype, head_dim, block_size, window):
    """Prefill tiles whose blocks hold a multiple of 16 keys transpose each block's keys 16 x
    16 in registers, the whole block (its rows past the context, NaN here, are scored and
    masked): f32 caches, and bf16 ones where AMX does not take the tile (head_dim 80);
    windows that start inside a block."""
    rng = np.random.default_rng(head_dim + block_size)
    lens = [300, 45, 130]
    case = make_case(rng, context_lens=lens, q_lens=[300, 29, 1], num_heads=6, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, max_blocks_per_seq=-(-max(lens) // block_size) + 1, dtype=dtype,
                     num_padding_tokens=2)
    got = ragged_paged_attention_cpu(*ragged_args(case), sliding_window=window)
    assert_matches_ragged_reference(got, case, dtype, sliding_window=window)


def test_out_of_range_inputs_are_errors_not_reads():
    rng = np.random.default_rng(6)
    case = make_case(rng, context_lens=[20], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                     max_blocks_per_seq=3)
    q, k, v, tables, lens, qsl = ragged_args(case)
    bad_tables = tables.copy()
    bad_tables[0, 1] = k.shape[0]  # one block past the pool
    with pytest.raises(Exception, match="block table entry is out of range"):
        jax.block_until_ready(ragged_paged_attention_cpu(q, k, v, bad_tables, lens, qsl))
    with pytest.raises(Exception, match="out of range"):  # a context longer than the table
        jax.block_until_ready(ragged_paged_attention_cpu(q, k, v, tables, np.array([25], np.int32), qsl))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ragged_paged_attention_cpu(q, k.astype(np.float16), v.astype(np.float16), tables, lens, qsl)


@pytest.mark.slow  # a second g++ build of every kernel (~15 s on 2 cores); the default run builds once, cached
def test_the_library_is_cached_by_source_and_machine(tmp_path, monkeypatch):
    """A fresh cache directory gets its own build, named by the hash; a second call loads it."""
    monkeypatch.setenv("PAGED_JAX_KERNEL_CACHE_DIR", str(tmp_path))
    build.library_path.cache_clear()
    try:
        path = build.library_path()
        assert path.startswith(str(tmp_path)) and path.endswith(".so")
        mtime = os.path.getmtime(path)
        build.library_path.cache_clear()
        assert build.library_path() == path and os.path.getmtime(path) == mtime
    finally:
        build.library_path.cache_clear()


@pytest.mark.slow
def test_the_avx2_build_matches_the_reference(tmp_path):
    """The kernels' portable (no AVX-512) path, built for x86-64-v3 in a subprocess, passes
    this file's reference checks: an AVX-512 machine never runs that path otherwise (a bf16
    value read through an unset pointer there once crashed AVX2-only machines)."""
    env = {**os.environ, "PAGED_JAX_CPU_MARCH": "x86-64-v3", "PAGED_JAX_KERNEL_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "matches_the_reference or long_prefill"],
                            env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    assert any(name.endswith(".so") for name in os.listdir(tmp_path))  # its own build, not the cached one
