"""Random paged-attention inputs for kernel tests, shared by the decode and ragged suites.

Block tables are random permutations over a pool much larger than the batch needs, and
every block no table uses is filled with NaN: a kernel that reads outside a sequence's
table (or past its context) produces NaN and fails.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@dataclasses.dataclass
class PagedCase:
    q: np.ndarray  # [num_tokens, num_heads, head_dim] (decode: num_tokens == num_seqs)
    k_cache: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: np.ndarray
    block_tables: np.ndarray  # i32[num_seqs, max_blocks_per_seq]
    context_lens: np.ndarray  # i32[num_seqs]
    query_start_loc: np.ndarray  # i32[num_seqs + 1]


def edge_lengths(block_size: int, max_len: int) -> list[int]:
    """Context lengths at the edges: 0, 1, B-1, B, B+1 and the maximum."""
    return sorted({min(n, max_len) for n in (0, 1, max(block_size - 1, 1), block_size, block_size + 1, max_len)})


def make_case(rng: np.random.Generator, *, context_lens, q_lens=None, num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, max_blocks_per_seq: int, dtype=np.float32,
              pool_factor: int = 3, num_padding_tokens: int = 0) -> PagedCase:
    """A batch with the given context lengths; q_lens None means decode (one query per
    sequence, zero for empty sequences). Unused blocks and table padding hold NaN."""
    context_lens = np.asarray(context_lens, np.int32)
    num_seqs = len(context_lens)
    if q_lens is None:
        q_lens = np.minimum(context_lens, 1)
    q_lens = np.asarray(q_lens, np.int32)
    assert np.all(q_lens <= context_lens)
    num_blocks = 1 + pool_factor * num_seqs * max_blocks_per_seq
    k = np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    ids = rng.permutation(np.arange(1, num_blocks))[: num_seqs * max_blocks_per_seq]
    tables = ids.reshape(num_seqs, max_blocks_per_seq).astype(np.int32)
    for i, n in enumerate(context_lens):
        used = -(-int(n) // block_size)
        for j in range(used):
            rows = min(block_size, int(n) - j * block_size)  # the last block is partly filled
            k[tables[i, j], :rows] = rng.normal(size=(rows, num_kv_heads, head_dim))
            v[tables[i, j], :rows] = rng.normal(size=(rows, num_kv_heads, head_dim))
        tables[i, used:] = rng.integers(1, num_blocks, max_blocks_per_seq - used)  # junk past the end
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.normal(size=(int(qsl[-1]) + num_padding_tokens, num_heads, head_dim))
    return PagedCase(q.astype(dtype), k.astype(dtype), v.astype(dtype), tables, context_lens, qsl)


def grid_context_lens(rng: np.random.Generator, index: int, block_size: int, num_seqs: int,
                      max_tokens: int = 130) -> tuple[list[int], int]:
    """(context lengths, max_blocks_per_seq) of grid case `index`: the block edges (0, 1,
    B-1, B, B+1, the maximum) in turn, then random lengths; never an empty batch."""
    max_blocks = -(-max_tokens // block_size)
    max_len = max_blocks * block_size
    edges = edge_lengths(block_size, max_len)
    lens = [edges[(index + i) % len(edges)] if i < len(edges) else int(rng.integers(1, max_len + 1))
            for i in range(num_seqs)]
    lens[0] = lens[0] or max_len
    return lens, max_blocks


def balanced_sample(num_cases: int, seed: int, *, balanced_first: int = 0, **factors) -> list[dict]:
    """num_cases combinations in which every value of every factor appears about equally
    often (each factor's values repeated, then shuffled independently). With
    balanced_first, the first that many cases are also balanced on their own: the ones the
    default test run checks (`case_params`)."""
    if balanced_first:
        return (balanced_sample(balanced_first, seed, **factors)
                + balanced_sample(num_cases - balanced_first, seed + 1, **factors))
    rng = np.random.default_rng(seed)
    columns = {}
    for name, values in factors.items():
        repeated = list(itertools.islice(itertools.cycle(values), num_cases))
        columns[name] = [repeated[i] for i in rng.permutation(num_cases)]
    return [{name: columns[name][i] for name in factors} for i in range(num_cases)]


def case_params(indices, ids, default_count: int) -> list:
    """pytest params for the case indices: the first `default_count` in the default run,
    the rest marked slow. Each randomized case compiles its own kernel in interpret mode
    (seconds each on 2 cores), so the default run checks a balanced few and CI's
    `-m slow` run checks them all."""
    return [pytest.param(i, id=name, marks=() if n < default_count else pytest.mark.slow)
            for n, (i, name) in enumerate(zip(indices, ids))]


def case_id(c: dict) -> str:
    """A readable pytest id for a balanced_sample combination."""
    return (f"s{c['num_seqs']}-g{c['group']}-d{c['head_dim']}-b{c['block_size']}"
            f"{'-win' if c['window'] else ''}{'-cap' if c['cap'] else ''}-{np.dtype(c['dtype']).name}")


DEFAULT_BACKEND = jax.default_backend()


def mode(backend: str, *values, label: str = ""):
    """pytest.param(*values, interpret) for a kernel of `backend`: native (marked gpu/tpu)
    where that device is JAX's default backend, interpret mode otherwise."""
    if backend in ("gpu", "tpu") and backend == DEFAULT_BACKEND:
        return pytest.param(*values, False, id=label + "native", marks=getattr(pytest.mark, backend))
    return pytest.param(*values, True, id=label + "interpret")


# the default kernel (backend=None): interpret mode on CPU, Triton on a GPU, Mosaic on a TPU
DEFAULT_MODE = mode(DEFAULT_BACKEND)

TOLERANCE = {np.float32: dict(atol=2e-5, rtol=1e-5),
              # bf16 inputs: the kernel rounds p to bf16 before p @ V and the output to bf16
              jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def ragged_args(case: PagedCase) -> tuple:
    """The positional arguments of the ragged kernel, its reference and the xla loop."""
    return (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.query_start_loc)


def assert_matches_ragged_reference(got, case: PagedCase, dtype, **kwargs) -> None:
    """got vs the ragged reference on the same inputs upcast to f32 (the exact answer for
    them; full f32 matmuls, which a GPU would otherwise run in TF32); padding tokens give 0."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got)), "output has NaN/inf"
    q, k, v, *meta = ragged_args(case)
    with jax.default_matmul_precision("highest"):
        want = ragged_paged_attention_reference(*(np.asarray(x, np.float32) for x in (q, k, v)), *meta, **kwargs)
    np.testing.assert_allclose(got, np.asarray(want), **TOLERANCE[dtype])
    assert not got[case.query_start_loc[-1]:].any(), "padding tokens must give zeros"
