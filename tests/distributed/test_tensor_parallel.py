"""Tensor parallelism (paged_jax/distributed/tensor_parallel.py) on 4 forced CPU devices.

The pytest process keeps its one CPU device: forcing 4 for the whole session would key
every cached compilation of the suite anew (test_engine.py measured 6.7 min cold
instead of ~1 min warm). The multi-device checks run instead in one child process per
model (`JAX_NUM_CPU_DEVICES=4`), which returns plain data (outputs, HLO text, bytes);
the assertions are made here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from tests.helpers.greedy_check import assert_greedy_match
from tests.helpers.hlo_collectives import check_collectives

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
            seq_buckets=(4,), token_buckets=(4, 32))
TINY_TIGHT = dict(TINY, num_blocks=16, max_model_len=80, preemption_mode="swap")  # 15 usable blocks: the
# first four prompts (51, 38, 31, 16 tokens + 12 new) need 23
SMOL = dict(block_size=16, num_blocks=32, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
            seq_buckets=(4,), token_buckets=(4, 64))
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three rivers in Europe are"]
TINY_TOKENS, SMOL_TOKENS = 12, 12


# ---- the child process -----------------------------------------------------------------------
def _child(worker: str) -> dict:
    """Run `worker` of this module in a fresh Python with 4 CPU devices; its JSON result."""
    out = os.path.join(tempfile.gettempdir(), f"paged_jax_tp_{worker}_{os.getpid()}.json")
    code = ("import sys, json; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests/distributed']; "
            "import test_tensor_parallel as t; json.dump(getattr(t, sys.argv[2])(), open(sys.argv[3], 'w'))")
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="4")
    proc = subprocess.run([sys.executable, "-c", code, ROOT, worker, out], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


@functools.cache
def tiny_results() -> dict:
    return _child("tiny_worker")


@functools.cache
def smollm2_results() -> dict:
    return _child("smollm2_worker")


def _tiny_model(preset="tiny_llama_tp4"):  # 8 heads, 4 KV heads, untied head (tiny_llama: 4 / 2, tied)
    import jax

    import configs
    from paged_jax.loading import LoadedModel
    from paged_jax.model.llama import init_params
    cfg = configs.get_config(preset)
    return LoadedModel(cfg, init_params(cfg, jax.random.key(0)), None, "memory", "memory", 0.0)


def _tiny_prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(1, 60, size=8)]


def _generate(llm, prompts, max_tokens) -> list[list[int]]:
    from paged_jax import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _step_hlo(runner) -> dict:
    """The step of the mixed (prefill) bucket: lowered (StableHLO) and compiled (HLO) text."""
    from paged_jax.worker.batch_inputs import all_batch_shapes, empty_batch
    num_seqs, num_tokens = all_batch_shapes(runner.config.seq_buckets, runner.config.token_buckets)[-1]
    batch = empty_batch(num_seqs, num_tokens, runner.max_blocks_per_seq, runner.max_copies,
                        runner.num_blocks * runner.config.block_size)
    lowered = runner._step.lower(runner.params, runner.kv_cache, batch, runner.rope_tables, runner.packed_head,
                                 runner._logits_buffer(batch), runner._feed,
                                 kind=runner.step_kinds()[num_seqs, num_tokens][-1])
    return {"lowered": lowered.as_text(), "compiled": lowered.compile().as_text()}


def _footprint(llm) -> dict:
    import jax

    from paged_jax.distributed.tensor_parallel import per_device_bytes
    runner = llm.engine.runner
    return {"params": per_device_bytes(runner.params), "kv": per_device_bytes(runner.kv_cache),
            "specs": {k: _spec(v) for k, v in jax.tree_util.tree_leaves_with_path(
                runner.params) for k in [k[-1].key]},
            "compilations_after_generate": runner.num_compilations,
            # what warm-up compiles: a step per bucket, and the greedy and sampled heads per row bucket
            # per shape a step; per row bucket the greedy and the sampled head; one prompt-logprob head
            "warm_up_programs": len(runner.batch_shapes()) + 2 * len(runner.config.seq_buckets) + 1}


def _config(preset):
    import configs
    return configs.get_config(preset)


def _spec(array):
    """An array's PartitionSpec as a JSON list (None on a single device)."""
    spec = getattr(array.sharding, "spec", None)
    return None if spec is None else list(spec) + [None] * (array.ndim - len(spec))


def tiny_worker() -> dict:
    import jax

    from paged_jax import LLM

    from paged_jax.distributed import tensor_parallel
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.loading import load_model, save_checkpoint
    enable_compilation_cache()
    assert jax.device_count() == 4
    model, prompts = _tiny_model(), _tiny_prompts()
    result = {"outputs": {}, "footprint": {}}
    for tp in (1, 2, 4):
        llm = LLM(model, tensor_parallel_size=tp, **TINY)
        result["outputs"][str(tp)] = _generate(llm, prompts, TINY_TOKENS)
        result["footprint"][str(tp)] = _footprint(llm)
        if tp == 4:
            result["hlo"] = _step_hlo(llm.engine.runner)
            result["cache_spec"] = _spec(llm.engine.runner.kv_cache["k"])
    llm = LLM(model, tensor_parallel_size=4, attention_backend="reference", **TINY)
    result["outputs"]["4-reference"] = _generate(llm, prompts, TINY_TOKENS)
    llm = LLM(model, tensor_parallel_size=2, **TINY_TIGHT)
    result["outputs"]["2-swap"] = _generate(llm, prompts, TINY_TOKENS)
    result["swap_preemptions"] = llm.stats()["num_preemptions"]
    errors = {}
    for name, make in (("kv_heads", lambda: LLM(_tiny_model("tiny_llama"), tensor_parallel_size=4, **TINY)),
                       ("both_heads", lambda: LLM(model, tensor_parallel_size=3, **TINY)),
                       ("gguf_heads", lambda: LLM("smollm2-135m", tensor_parallel_size=2, **SMOL))):
        try:
            make()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    result["errors"] = errors
    with tempfile.TemporaryDirectory() as tmp:  # an orbax checkpoint restored shard by shard
        save_checkpoint(tmp, model.config, model.params)
        mesh = tensor_parallel.make_mesh(4)
        loaded = load_model(tmp, shardings=tensor_parallel.sharding_rule(mesh))
        result["checkpoint"] = {
            "equal": all(bool(np.array_equal(np.asarray(a), np.asarray(b)))
                         for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(model.params))),
            "wq_spec": _spec(loaded.params["layers"]["wq"]),
            "bytes": tensor_parallel.per_device_bytes(loaded.params)}
    return result


@contextlib.contextmanager
def _no_whole_parameter_on_a_device(full_shapes):
    """Fails any device transfer of a host array with a whole (split) parameter's shape."""
    import jax
    import jax.numpy as jnp
    originals = {(jax, "device_put"): jax.device_put, (jnp, "asarray"): jnp.asarray, (jnp, "array"): jnp.array}

    def guarded(fn):
        def call(x, *args, **kwargs):
            if isinstance(x, np.ndarray) and tuple(x.shape) in full_shapes:
                raise AssertionError(f"a whole parameter {x.shape} went to one device")
            return fn(x, *args, **kwargs)
        return call

    for (module, name), fn in originals.items():
        setattr(module, name, guarded(fn))
    try:
        yield
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def smollm2_worker() -> dict:
    import jax

    from paged_jax import LLM
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.loading import load_model
    from paged_jax.model.llama import param_shapes
    enable_compilation_cache()
    loaded = load_model("smollm2-135m")
    prompts = [loaded.tokenizer.encode(p) for p in SMOL_PROMPTS]
    llm = LLM(loaded, **SMOL)
    result = {"prompts": prompts, "outputs": {"1": _generate(llm, prompts, SMOL_TOKENS)},
              "footprint": {"1": _footprint(llm)}}
    del llm, loaded
    shapes = jax.tree.leaves(param_shapes(_config("smollm2_135m")),
                             is_leaf=lambda x: isinstance(x, tuple))
    split = {s for s in shapes if len(s) >= 2 and s != (30, 576)}  # all but the [L, H] norms
    with _no_whole_parameter_on_a_device(split):
        llm = LLM("smollm2-135m", tensor_parallel_size=3, **SMOL)  # GGUF loaded shard by shard
    result["outputs"]["3"] = _generate(llm, prompts, SMOL_TOKENS)
    result["footprint"]["3"] = _footprint(llm)
    result["hlo"] = _step_hlo(llm.engine.runner)
    return result


# ---- the tests: one device, here -------------------------------------------------------------
def test_partition_specs_by_hand():
    from jax.sharding import PartitionSpec as P

    from paged_jax.distributed.tensor_parallel import param_spec
    L, H, Q, K, I, V = 2, 64, 128, 64, 128, 256
    assert param_spec("wq", (L, H, Q), 4) == P(None, None, "tp")  # column-parallel: output axis
    assert param_spec("bk", (L, K), 4) == P(None, "tp")
    assert param_spec("wo", (L, Q, H), 4) == P(None, "tp", None)  # row-parallel: input axis
    assert param_spec("w_down", (L, I, H), 4) == P(None, "tp", None)
    assert param_spec("embed", (V, H), 4) == P("tp", None)  # over the vocabulary
    assert param_spec("lm_head", (H, V), 4) == P(None, "tp")
    assert param_spec("embed", (250, H), 4) == P(None, "tp")  # 250 % 4: over the hidden axis instead
    assert param_spec("w_gate", (L, H, 130), 4) == P()  # 130 % 4: replicated
    assert param_spec("attn_norm", (L, H), 4) == P() and param_spec("bo", (L, H), 4) == P()


@pytest.mark.parametrize("preset, tp, named, not_named", [
    ("tiny_llama", 4, ["num_kv_heads=2"], ["num_heads="]),  # 4 heads divide, 2 KV heads do not
    ("smollm2_135m", 2, ["num_heads=9", "num_kv_heads=3"], []),
])
def test_head_counts_that_do_not_divide_are_named(preset, tp, named, not_named):
    import configs
    from paged_jax.distributed.tensor_parallel import check_divisible
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} must divide") as info:
        check_divisible(configs.get_config(preset), tp)
    assert all(s in str(info.value) for s in named) and not any(s in str(info.value) for s in not_named)
    assert "sizes that work for this model: [1" in str(info.value)


def test_fewer_devices_than_asked_says_how_many_and_how_to_force(tiny_llama):
    import jax

    from paged_jax import LLM
    n = jax.device_count() + 1
    with pytest.raises(ValueError, match=rf"needs {n} devices, but JAX sees only {n - 1} \(cpu\).*jax_num_cpu_dev"):
        LLM(tiny_llama, tensor_parallel_size=n, **TINY)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(tiny_llama, tensor_parallel_size=0, **TINY)


def test_kv_budget_is_per_device():
    """One budget of 64 blocks' worth at one device buys 2x / 4x the blocks at TP 2 / 4."""
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.engine.kv_sizing import resolve_config
    model = _tiny_model()
    # a block: 2 (K, V) x 2 layers x 8 tokens x 4 KV heads x 16 dims x 4 bytes = 8192 bytes
    budget = 64 * 8192
    blocks = [resolve_config(EngineConfig(block_size=8, kv_cache_memory_bytes=budget, tensor_parallel_size=tp),
                             model.config).num_blocks for tp in (1, 2, 4)]
    assert blocks == [64, 128, 256]


# ---- the tests: 4 devices, in the child ------------------------------------------------------
def _assert_tiny_equal(outputs):
    from paged_jax.baselines import reference
    model = _tiny_model()
    logits = lambda ids: reference.prompt_logits(model.params, model.config, [ids])[0][-1]
    for prompt, want, got in zip(_tiny_prompts(), tiny_results()["outputs"]["1"], outputs):
        assert len(got) == TINY_TOKENS
        assert_greedy_match(prompt, want, got, logits)


@pytest.mark.slow  # a 4-device child process compiling TP 1 / 2 / 4 engines (minutes on a cold cache)
@pytest.mark.parametrize("run", ["2", "4", "4-reference", "2-swap"])
def test_tiny_greedy_at_tp_equals_tp1(run):
    _assert_tiny_equal(tiny_results()["outputs"][run])


@pytest.mark.slow  # a 4-device child process compiling TP 1 / 2 / 4 engines (minutes on a cold cache)
def test_tiny_swap_run_really_preempted():
    assert tiny_results()["swap_preemptions"] > 0


@pytest.mark.slow  # a 4-device child process compiling TP 1 / 2 / 4 engines (minutes on a cold cache)
def test_tiny_shardings_and_memory_per_device():
    r = tiny_results()
    fp = r["footprint"]
    assert r["cache_spec"] == [None, None, None, "tp", None]  # [L, blocks, block_size, Hkv, D]
    assert fp["4"]["specs"]["wq"] == [None, None, "tp"] and fp["4"]["specs"]["w_down"] == [None, "tp", None]
    assert fp["4"]["specs"]["lm_head"] == [None, "tp"] and fp["4"]["specs"]["embed"] == ["tp", None]
    assert fp["4"]["specs"]["attn_norm"] == [None, None] and fp["1"]["specs"]["wq"] is None
    assert fp["1"]["kv"] == 2 * 2 * 64 * 8 * 4 * 16 * 4  # K,V x layers x blocks x block x heads x dim x f32
    cfg = _tiny_model().config
    replicated = 4 * (cfg.hidden_size + 2 * cfg.num_layers * cfg.hidden_size)  # final + 2 norms per layer
    assert fp["1"]["params"] == 4 * cfg.num_params()
    for tp in (2, 4):
        assert fp[str(tp)]["kv"] * tp == fp["1"]["kv"]
        assert fp[str(tp)]["params"] == (fp["1"]["params"] - replicated) // tp + replicated
        assert fp[str(tp)]["warm_up_programs"] == 5  # two buckets of one row count: 2 steps + 2 heads + prompt head
        assert fp[str(tp)]["compilations_after_generate"] == fp[str(tp)]["warm_up_programs"]  # none after warm-up


@pytest.mark.slow  # a 4-device child process compiling TP 1 / 2 / 4 engines (minutes on a cold cache)
def test_tiny_compiled_step_has_megatron_collectives_and_no_cache_gather():
    cfg = _tiny_model().config
    check_collectives(tiny_results()["hlo"], layers=cfg.num_layers, num_blocks=64, block_size=8,
                       kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, tp=4, num_seqs=4, num_tokens=32,
                       hidden=cfg.hidden_size, vocab=cfg.vocab_size)


@pytest.mark.slow  # a 4-device child process compiling TP 1 / 2 / 4 engines (minutes on a cold cache)
def test_tiny_errors_in_a_four_device_process():
    errors = tiny_results()["errors"]
    assert "tensor_parallel_size=4 must divide" in errors["kv_heads"] and "num_kv_heads=2" in errors["kv_heads"]
    assert "num_heads=8 and num_kv_heads=4 do not divide by 3" in errors["both_heads"]
    assert "num_heads=9 and num_kv_heads=3 do not divide by 2" in errors["gguf_heads"]


@pytest.mark.slow  # a 4-device child process compiling TP 1 / 2 / 4 engines (minutes on a cold cache)
def test_tiny_checkpoint_restores_shard_by_shard():
    ckpt = tiny_results()["checkpoint"]
    assert ckpt["equal"] and ckpt["wq_spec"] == [None, None, "tp"]
    assert ckpt["bytes"] == tiny_results()["footprint"]["4"]["params"]


@pytest.mark.slow  # SmolLM2 at TP 3 and TP 1 in a 4-device child process
def test_smollm2_tp3_greedy_equals_tp1():
    r = smollm2_results()
    model = {}

    def logits(ids):  # loaded only if the outputs differ (a near-tie to check)
        from paged_jax.baselines import reference
        from paged_jax.loading import load_model
        model.setdefault("m", load_model("smollm2-135m"))
        return reference.prompt_logits(model["m"].params, model["m"].config, [ids])[0][-1]

    for prompt, want, got in zip(r["prompts"], r["outputs"]["1"], r["outputs"]["3"]):
        assert len(got) == SMOL_TOKENS
        assert_greedy_match(prompt, want, got, logits)


@pytest.mark.slow  # SmolLM2 at TP 3, compiled HLO inspected
def test_smollm2_tp3_memory_and_collectives():
    r = smollm2_results()
    cfg = _config("smollm2_135m")
    one, three = r["footprint"]["1"], r["footprint"]["3"]
    assert one["params"] == 4 * cfg.num_params()
    replicated = 4 * (cfg.hidden_size + 2 * cfg.num_layers * cfg.hidden_size)
    assert three["params"] == (one["params"] - replicated) // 3 + replicated  # 1/3, norms aside
    assert three["kv"] * 3 == one["kv"]
    assert three["specs"]["embed"] == ["tp", None]  # tied head: vocab-sharded
    check_collectives(r["hlo"], layers=cfg.num_layers, num_blocks=32, block_size=16, kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, tp=3, num_seqs=4, num_tokens=64, hidden=cfg.hidden_size,
                       vocab=cfg.vocab_size)
