"""TritonTuning changes the Triton tilings' speed, never their results.

Each tuning below runs both kernels' Triton programs (natively where a GPU is JAX's
default backend, in interpret mode otherwise) on randomized cases of the kernel suites
and must match the reference there: chunks of one block read as views and chunks of
several blocks gathered through the table (with the null block past the used ones),
query tiles of 16 to 128 rows, a decode sequence's blocks split over 1, 3 or 8 programs
(more splits than chunks: empty ones merge as nothing), other warp counts and pipelining
depths, chunks too large for shared memory (cut down). The decode kernel's gathered and
split paths also run unpadded on the "cpu" backend.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from tests.helpers.kernel_cases import assert_matches_ragged_reference, case_id, ragged_args
from tests.helpers.kernel_cases import mode as _mode
from test_paged_attention_kernel import _CASES as _DECODE_CASES
from test_paged_attention_kernel import _case_inputs, _check
from test_ragged_paged_attention_kernel import _CASES as _RAGGED_CASES
from test_ragged_paged_attention_kernel import _ragged_case

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.triton_tuning import (DEFAULT_DECODE_TUNING, DEFAULT_RAGGED_TUNING, MAX_AUTO_SPLITS,
                                          TARGET_PROGRAMS, TritonTuning, default_decode_tuning, max_chunk_tokens)

_TUNINGS = [TritonTuning(chunk_tokens=16, kv_splits=1), TritonTuning(chunk_tokens=128, num_warps=8, num_stages=3),
            TritonTuning(chunk_tokens=256, query_rows=64, kv_splits=3),
            TritonTuning(chunk_tokens=32, query_rows=128, num_stages=1, kv_splits=8)]
_DECODE_INDICES = [0, 5, 10, 15, 20]
_RAGGED_INDICES = [1, 6, 11, 16]


def _case_tunings(indices, cases, tunings):
    """(index, tuning) params for every case under every tuning: the default run checks the
    diagonal (each case once, each tuning at least once), CI's `-m slow` run all the rest
    (each pair compiles its own Triton program in interpret mode: seconds on 2 cores)."""
    return [pytest.param(i, t, id=f"{case_id(cases[i])}-{t.label()}",
                         marks=() if b == a % len(tunings) else pytest.mark.slow)
            for a, i in enumerate(indices) for b, t in enumerate(tunings)]


@pytest.mark.parametrize("interpret", [_mode("gpu")])
@pytest.mark.parametrize("index,tuning", _case_tunings(_DECODE_INDICES, _DECODE_CASES, _TUNINGS))
def test_decode_kernel_matches_reference_under_tuning(index, tuning, interpret):
    c = _DECODE_CASES[index]
    inputs, kwargs = _case_inputs(index, c, num_kv_heads=2)
    got = paged_attention(*inputs, backend="gpu", interpret=interpret, tuning=tuning, **kwargs)
    _check(got, inputs, c["dtype"], **kwargs)


@pytest.mark.parametrize("index,tuning", _case_tunings(_DECODE_INDICES[:3], _DECODE_CASES, _TUNINGS[1:]))
def test_decode_kernel_gathered_chunks_and_splits_unpadded_on_cpu(index, tuning):
    c = _DECODE_CASES[index]
    inputs, kwargs = _case_inputs(index, c)
    _check(paged_attention(*inputs, backend="cpu", interpret=True, tuning=tuning, **kwargs), inputs, c["dtype"],
           **kwargs)


@pytest.mark.parametrize("interpret", [_mode("gpu")])
@pytest.mark.parametrize("index,tuning", _case_tunings(_RAGGED_INDICES, _RAGGED_CASES, _TUNINGS))
def test_ragged_kernel_matches_reference_under_tuning(index, tuning, interpret):
    c = _RAGGED_CASES[index]
    case, kwargs = _ragged_case(index, c)
    got = ragged_paged_attention(*ragged_args(case), backend="gpu", interpret=interpret, tuning=tuning, **kwargs)
    assert_matches_ragged_reference(got, case, c["dtype"], **kwargs)


def test_label_round_trips_and_pages_per_chunk_rounds_down():
    for tuning in _TUNINGS + [DEFAULT_DECODE_TUNING, DEFAULT_RAGGED_TUNING]:
        assert TritonTuning.parse(tuning.label()) == tuning
    assert TritonTuning.parse("w8") == TritonTuning(num_warps=8)
    assert TritonTuning.parse("k4-c32") == TritonTuning(chunk_tokens=32, kv_splits=4)
    # 100 keys of 16-token blocks: 6 whole blocks; never fewer than one
    assert TritonTuning(chunk_tokens=100).pages_per_chunk(16) == 6
    assert TritonTuning(chunk_tokens=16).pages_per_chunk(64) == 1


def test_chunks_are_cut_to_fit_shared_memory():
    # bf16 x 128 dims at 2 stages: 256 keys stage 128 KB of K and V; f32 counts double
    assert max_chunk_tokens(128, 2, 2) == 256 and max_chunk_tokens(128, 4, 2) == 64
    assert max_chunk_tokens(128, 4, 3) == 32 and max_chunk_tokens(1024, 4, 4) == 16  # never under 16
    big = TritonTuning(chunk_tokens=1024)
    assert big.pages_per_chunk(16) == 64
    assert big.pages_per_chunk(16, 128, 2) == 16 and big.pages_per_chunk(16, 128, 4) == 4


def test_auto_splits_aim_at_the_target_in_powers_of_two_and_never_past_the_chunks():
    auto = TritonTuning()
    assert TARGET_PROGRAMS == 256 and MAX_AUTO_SPLITS == 16  # the numbers below follow from these
    assert auto.num_splits(num_seqs=64, num_kv_heads=8, max_chunks=32) == 1  # 512 programs already
    assert auto.num_splits(num_seqs=16, num_kv_heads=8, max_chunks=32) == 2  # 128 programs
    assert auto.num_splits(num_seqs=64, num_kv_heads=3, max_chunks=32) == 2  # 192: 256 / 192 rounds up to 2
    # 48 programs: 256 / 48 = 5.3, and not 6 (the H200 sweep: 8 splits were faster) but 8
    assert auto.num_splits(num_seqs=16, num_kv_heads=3, max_chunks=32) == 8
    assert auto.num_splits(num_seqs=5, num_kv_heads=1, max_chunks=1000) == MAX_AUTO_SPLITS  # 52 -> 64, capped
    assert auto.num_splits(num_seqs=1, num_kv_heads=1, max_chunks=3) == 3
    assert TritonTuning(kv_splits=5).num_splits(num_seqs=64, num_kv_heads=8, max_chunks=2) == 5


def test_default_decode_tuning_takes_three_stages_where_they_fit_the_chunk():
    assert DEFAULT_DECODE_TUNING == TritonTuning(chunk_tokens=128, num_stages=3)
    for head_dim in (64, 128):  # bf16: 128 keys fit at 3 stages
        assert default_decode_tuning(head_dim, 2) == DEFAULT_DECODE_TUNING
    two_stages = TritonTuning(chunk_tokens=128, num_stages=2)
    # f32 at 3 stages would cut 128 keys to 32 (64 dims) or 32 (128 dims); bf16 x 256 dims to 64
    assert default_decode_tuning(64, 4) == two_stages and default_decode_tuning(128, 4) == two_stages
    assert default_decode_tuning(256, 2) == two_stages
    assert default_decode_tuning(128, 4).pages_per_chunk(16, 128, 4) == 4  # and 2 stages cut it to 64, as before


def _triton_launch(dtype, num_seqs, num_kv_heads, head_dim, max_blocks, **kwargs):
    """num_stages and grid_z (splits) of the Triton call paged_attention lowers to for a CUDA GPU."""
    spec = jax.ShapeDtypeStruct
    cache = spec((num_seqs * max_blocks + 1, 16, num_kv_heads, head_dim), dtype)
    args = (spec((num_seqs, 3 * num_kv_heads, head_dim), dtype), cache, cache, spec((num_seqs, max_blocks), jnp.int32),
            spec((num_seqs,), jnp.int32))
    fn = functools.partial(paged_attention, backend="gpu", interpret=False, **kwargs)
    text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    return [int(re.search(rf"{key} = (\d+) : i32", text).group(1)) for key in ("num_stages", "grid_z")]


def test_the_gpu_kernel_launches_with_the_default_rule_unless_given_a_tuning():
    # 16 x 3 kv heads over 64 blocks: 8 chunks of 128 keys, 8 splits; 3 stages in bf16, 2 in f32
    assert _triton_launch(jnp.bfloat16, 16, 3, 64, 64) == [3, 8]
    assert _triton_launch(jnp.float32, 16, 3, 64, 64) == [2, 8]
    assert _triton_launch(jnp.bfloat16, 64, 8, 128, 64) == [3, 1]
    assert _triton_launch(jnp.bfloat16, 16, 3, 64, 64, tuning=TritonTuning(num_stages=4, kv_splits=3)) == [4, 3]


@pytest.mark.parametrize("fields,message", [
    (dict(chunk_tokens=0), "chunk_tokens"), (dict(num_warps=6), "power of two"), (dict(query_rows=8), ">= 16"),
    (dict(num_stages=1.5), "num_stages"), (dict(query_rows=48), "power of two"), (dict(kv_splits=-1), "kv_splits"),
])
def test_bad_tunings_raise_value_error(fields, message):
    with pytest.raises(ValueError, match=message):
        TritonTuning(**fields)


@pytest.mark.parametrize("text", ["", "x4", "w", "c64-", "w-4"])
def test_bad_labels_raise_value_error(text):
    with pytest.raises(ValueError, match="bad TritonTuning label"):
        TritonTuning.parse(text)


def test_tuning_is_refused_where_it_does_not_apply():
    inputs, _ = _case_inputs(0, _DECODE_CASES[0])
    with pytest.raises(ValueError, match="not to 'tpu'"):
        paged_attention(*inputs, backend="tpu", tuning=DEFAULT_DECODE_TUNING)
    with pytest.raises(ValueError, match="TritonTuning"):
        paged_attention(*inputs, tuning="c64")
    case, _ = _ragged_case(0, _RAGGED_CASES[0])
    with pytest.raises(ValueError, match="takes none"):
        ragged_paged_attention(*ragged_args(case), backend="cpu", tuning=DEFAULT_DECODE_TUNING)
    with pytest.raises(ValueError, match="takes none"):
        ragged_paged_attention(*ragged_args(case), backend="tpu", tuning=DEFAULT_DECODE_TUNING)
