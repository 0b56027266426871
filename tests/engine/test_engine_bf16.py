"""dtype="bfloat16": bf16 weights, float32 accumulation and residual stream.

The paged engine in bf16 against the dense reference on the same bf16 weights: greedy
outputs equal token for token up to a near-tie, with the KV cache in f32 (kv_cache_dtype
"auto" on CPU) and in bf16. The tie tolerance is bf16's, not float32's: the two paths
round their bf16 products differently (the dense reference keeps a bf16 cache; the kernel
rounds the softmax weights to bf16 before p @ V), which moves logits by up to a few
hundredths; a wrong cache write, position or table would move them by far more.
"""

import dataclasses
import random

import jax
import jax.numpy as jnp
import pytest

from paged_jax.baselines import reference
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from tests.helpers.greedy_check import assert_greedy_match

BF16_TIE_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def bf16_model(tiny_llama):
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_llama.params)
    return dataclasses.replace(tiny_llama, params=params)


@pytest.mark.parametrize("backend,kv_cache_dtype", [("pallas", "auto"), ("xla", "auto"), ("pallas", "bfloat16"),
                                                    ("native", "auto"), ("native", "bfloat16")])
def test_bf16_engine_matches_the_bf16_dense_reference(tiny_llama, bf16_model, backend, kv_cache_dtype):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 120))] for _ in range(10)]
    max_tokens = 40
    # the f32 model is cast to the engine's dtype; a bf16 cache is kept small (its writes are slow on CPU)
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, seq_buckets=(4,), token_buckets=(64,), attention_backend=backend,
              num_blocks=80)
    assert {a.dtype for a in jax.tree.leaves(llm.engine.runner.params)} == {jnp.dtype(jnp.bfloat16)}
    # "auto" on CPU: f32 unless the native kernels write the cache (XLA's CPU scatter has no bf16 path)
    cpu_f32 = jax.default_backend() == "cpu" and backend != "native"
    want_cache = jnp.float32 if kv_cache_dtype == "auto" and cpu_f32 else jnp.bfloat16
    assert llm.engine.runner.kv_cache["k"].dtype == want_cache
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    expected = reference.generate(bf16_model.params, bf16_model.config, prompts, max_new_tokens=max_tokens,
                                  ignore_eos=True)
    logits = lambda ids: reference.prompt_logits(bf16_model.params, bf16_model.config, [ids])[0][-1]
    for prompt, want, out in zip(prompts, expected, outputs):
        assert_greedy_match(prompt, want, out.outputs[0].token_ids, logits, tol=BF16_TIE_TOLERANCE)
