"""The native kernels' helper threads (cpu_kernels/helper_threads.{h,cc,py}): the spin
window's setting, results identical with the spinning helpers and with XLA's pool, calls
from several threads at once sharing the helpers, and $PAGED_JAX_CPU_SPIN_US."""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import amx_matmul, build, f32_matmul, helper_threads
from cpu_kernels.ragged_paged_attention import ragged_paged_attention_cpu
from tests.helpers.kernel_cases import make_case, ragged_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not build.available(), reason="needs the native CPU kernels (a C++ compiler)")


@pytest.fixture
def restore_window():
    before = helper_threads.spin_us()
    yield
    helper_threads.set_spin_us(before)


def _consumed(kernel):
    """The kernel jitted with a cumulative sum of each output right after it, in the same
    program: a call that returned before its helpers finished would hand it rows still
    being written."""
    def call(*args):
        return [jnp.cumsum(out.astype(jnp.float32), axis=-1) for out in jax.tree.leaves(kernel(*args))]
    return jax.jit(call)


def _calls():
    """name -> (jitted call, its arguments) for every kernel that shares its items with
    helpers; decode-sized rows (the spinning helpers take them), long items."""
    rng = np.random.default_rng(0)
    calls = {}
    case = make_case(rng, context_lens=[700, 37, 520, 640], q_lens=[1, 37, 1, 1], num_heads=6, num_kv_heads=2,
                     head_dim=64, block_size=16, max_blocks_per_seq=45, dtype=np.float32)
    calls["attention"] = (_consumed(ragged_paged_attention_cpu), ragged_args(case))
    x = jnp.asarray(rng.standard_normal((64, 2048)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2048, 512)) * 0.02, jnp.float32)
    if f32_matmul.supported():
        calls["f32_matmul"] = (_consumed(f32_matmul.f32_matmul), (x, f32_matmul.pack_columns(w)))
        calls["f32_logits_argmax"] = (_consumed(f32_matmul.f32_logits_argmax), (x, f32_matmul.pack_columns(w)))
    if amx_matmul.supported():
        calls["amx_matmul"] = (_consumed(amx_matmul.amx_matmul),
                               (x.astype(jnp.bfloat16), amx_matmul.pack_weights(w.astype(jnp.bfloat16))))
    return calls


def _run(fn, args):
    return [np.asarray(a) for a in jax.tree.leaves(jax.block_until_ready(fn(*args)))]


def test_the_window_is_set_and_read_back(restore_window):
    helper_threads.set_spin_us(123)
    assert helper_threads.spin_us() == 123
    assert helper_threads.set_spin_us(0) == 123 and helper_threads.spin_us() == 0
    with pytest.raises(ValueError, match=">= 0"):
        helper_threads.set_spin_us(-1)


def test_spinning_helpers_and_xlas_pool_give_identical_results(restore_window):
    calls = _calls()
    helper_threads.set_spin_us(0)
    with_pool = {name: _run(fn, args) for name, (fn, args) in calls.items()}
    helper_threads.set_spin_us(300)
    for _ in range(3):
        for name, (fn, args) in calls.items():
            for got, want in zip(_run(fn, args), with_pool[name]):
                np.testing.assert_array_equal(got, want, err_msg=name)


def test_calls_from_several_threads_share_the_helpers(restore_window):
    """Four threads call the kernels at once, 20 times each: whichever call posted last
    gets the helpers, and every call still returns its whole result."""
    helper_threads.set_spin_us(300)
    calls = _calls()
    want = {name: _run(fn, args) for name, (fn, args) in calls.items()}
    errors = []

    def worker(seed):
        order = list(calls)
        np.random.default_rng(seed).shuffle(order)
        try:
            for _ in range(20):
                for name in order:
                    for got, w in zip(_run(*calls[name]), want[name]):
                        np.testing.assert_array_equal(got, w, err_msg=name)
        except AssertionError as e:  # (re-raised below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_the_environment_sets_the_window_at_load():
    code = "from cpu_kernels import helper_threads; print(helper_threads.spin_us())"
    for value, want in (("0", "0"), ("1500", "1500")):
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                             env=dict(os.environ, PAGED_JAX_CPU_SPIN_US=value), check=False)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split()[-1] == want
