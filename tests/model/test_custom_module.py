"""A researcher's own Flax module runs through LLM without editing the package.

The variant, defined here: a GPT-style GELU MLP (no gate, so no w_gate parameter) and a
bias-free LayerNorm (mean-centred) instead of RMSNorm, built by subclassing the
package's modules and handed to the engine as `LoadedModel.model_class`. Its greedy
output through the paged engine must equal its own dense reference, and the engine must
not quietly serve its params with the built-in decoder.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from paged_jax.baselines import reference
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import LoadedModel
from paged_jax.model.decoder import DecoderLayer, LlamaDecoder, new_param
from paged_jax.model.functional import params_of, split_model
from tests.helpers.greedy_check import assert_greedy_match

SETTINGS = dict(block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                seq_buckets=(4,), token_buckets=(4, 32))
MAX_TOKENS = 12


def layer_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 - x32.mean(axis=-1, keepdims=True)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


class GeluLayerNormLayer(DecoderLayer):
    def init_mlp(self, rngs, dtype):
        H, I = self.cfg.hidden_size, self.cfg.intermediate_size
        self.w_up = new_param("w_up", (H, I), rngs, dtype)
        self.w_down = new_param("w_down", (I, H), rngs, dtype)

    def mlp(self, x, linear):
        return linear.dense(jax.nn.gelu(linear.dense(x, self.w_up[...])), self.w_down[...])

    def norm(self, x, weight):
        return layer_norm(x, weight[...], self.cfg.rms_norm_eps)


class GeluLayerNormLlama(LlamaDecoder):
    layer_class = GeluLayerNormLayer

    def norm(self, x, weight):
        return layer_norm(x, weight[...], self.cfg.rms_norm_eps)


@pytest.fixture(scope="module")
def variant():
    cfg = configs.get_config("tiny_llama")
    params = params_of(GeluLayerNormLlama(cfg, rngs=nnx.Rngs(5)))
    return cfg, params


def _prompts():
    rng = np.random.default_rng(2)
    return [rng.integers(3, 256, size=int(n)).tolist() for n in (1, 9, 40, 23, 57, 5)]


def test_variant_through_llm_matches_its_dense_reference(variant):
    cfg, params = variant
    assert "w_gate" not in params["layers"]
    prompts = _prompts()
    want = reference.generate(params, cfg, prompts, max_new_tokens=MAX_TOKENS, ignore_eos=True,
                              model_class=GeluLayerNormLlama)
    llm = LLM(LoadedModel(cfg, params, None, "memory", "memory", 0.0, model_class=GeluLayerNormLlama), **SETTINGS)
    compiled = llm.stats()["num_compilations"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["num_compilations"] == compiled, "nothing compiles after warm-up"
    logits = lambda ids: reference.prompt_logits(params, cfg, [ids], model_class=GeluLayerNormLlama)[0][-1]
    for prompt, expected, out in zip(prompts, want, outs):
        assert_greedy_match(prompt, expected, out.outputs[0].token_ids, logits)
    assert len({tuple(w) for w in want}) > 1, "degenerate model: every row generated the same"


def test_variant_differs_from_the_builtin(variant):
    """The variant's modules really run: its layer class is stacked, and with a gate added the
    built-in decoder gives other logits."""
    cfg, params = variant
    graphdef, _ = split_model(GeluLayerNormLlama, cfg)
    assert type(nnx.merge(graphdef, params).layers) is GeluLayerNormLayer
    with_gate = {**params, "layers": {**params["layers"], "w_gate": params["layers"]["w_up"]}}
    prompt = _prompts()[2]
    ours = reference.prompt_logits(params, cfg, [prompt], model_class=GeluLayerNormLlama)[0]
    builtin = reference.prompt_logits(with_gate, cfg, [prompt])[0]
    assert np.abs(ours - builtin).max() > 0.1


def test_params_that_do_not_fit_the_module_are_refused(variant):
    """The variant's params (no w_gate) offered to the built-in decoder: refused before any compile."""
    cfg, params = variant
    with pytest.raises(ValueError, match=r"params for LlamaDecoder do not fit the model: missing \['layers/w_gate'\]"):
        LLM(LoadedModel(cfg, params, None, "memory", "memory", 0.0), **SETTINGS)
    with pytest.raises(ValueError, match=r"missing \['layers/w_gate'\]"):
        reference.generate(params, cfg, [[1, 2]], max_new_tokens=2)
