"""Reference generation: a dense contiguous-KV generate loop, the oracle for the engine.

One batch, prompts right-padded, one prefill then a `lax.while_loop` of single-token
decode steps over `paged_jax.attention.dense_attention`. No scheduler, no blocks, no buckets
beyond rounding shapes up to a multiple of 16 (fewer compilations). The paged engine's
greedy output must equal this token for token.

It runs the same Flax model class as the engine (`model_class`, default the built-in
`LlamaDecoder`), rebuilt from the params inside each jitted function, so a custom
module is checked against its own dense oracle.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.attention.dense_attention import DenseMetadata, dense_attention, init_dense_cache
from paged_jax.config.model_config import ModelConfig
from paged_jax.model.decoder import LlamaDecoder
from paged_jax.model.functional import check_params, split_model
from paged_jax.model.llama import Params
from paged_jax.worker.sampler import row_keys, sample_tokens

_ROUND = 16


def _round_up(n: int, multiple: int = _ROUND) -> int:
    return -(-n // multiple) * multiple


def _pad_prompts(cfg: ModelConfig, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    if not prompts:
        raise ValueError("need at least one prompt")
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    tokens = np.zeros((len(prompts), _round_up(int(lens.max()))), np.int32)
    for row, prompt in enumerate(prompts):
        ids = np.asarray(prompt, np.int64)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"prompt {row} has token ids outside [0, {cfg.vocab_size})")
        tokens[row, : len(ids)] = ids
    return tokens, lens


def _attention(cfg: ModelConfig):
    return functools.partial(dense_attention, sliding_window=cfg.sliding_window)


def _model(params, cfg, model_class):
    """The module, rebuilt from (traced) params; runs while tracing only."""
    graphdef, param_shapes = split_model(model_class, cfg)
    check_params(param_shapes, params, f"params for {model_class.__name__}")
    return nnx.merge(graphdef, params)


def _prefill(model, cfg, tokens, lens, max_len, dtype):
    """Run the padded prompts; returns (hidden [B, T, H], cache). Padding writes nothing."""
    batch, num_tokens = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))
    write_positions = jnp.where(positions < lens[:, None], positions, max_len)
    cache = init_dense_cache(cfg, batch, max_len, dtype)
    return model(tokens, positions, cache, DenseMetadata(positions, write_positions), _attention(cfg))


def _cache_dtype(params):
    """The KV cache holds K/V in the params' dtype (their first leaf: `embed` for the built-in)."""
    return jax.tree.leaves(params)[0].dtype


@functools.partial(jax.jit, static_argnames=("cfg", "model_class"))
def _all_logits(params, cfg, model_class, tokens, lens):
    model = _model(params, cfg, model_class)
    hidden, _ = _prefill(model, cfg, tokens, lens, tokens.shape[1], _cache_dtype(params))
    return model.compute_logits(hidden)


def prompt_logits(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
                  model_class: type[nnx.Module] = LlamaDecoder) -> list[np.ndarray]:
    """Logits at every position of each prompt (no cache reuse): f32[len_i, vocab] each."""
    tokens, lens = _pad_prompts(cfg, prompts)
    logits = np.asarray(_all_logits(params, cfg, model_class, jnp.asarray(tokens), jnp.asarray(lens)))
    return [logits[row, :n] for row, n in enumerate(lens)]


@functools.partial(jax.jit, static_argnames=("cfg", "model_class", "max_new_tokens", "max_len"))
def _generate(params, cfg, model_class, max_new_tokens, max_len, tokens, lens, temperature, top_k, top_p,
              min_p, seeds, stop_ids):
    batch = tokens.shape[0]
    rows = jnp.arange(batch)
    model = _model(params, cfg, model_class)
    hidden, cache = _prefill(model, cfg, tokens, lens, max_len, _cache_dtype(params))

    def pick(hidden_rows, step):
        logits = model.compute_logits(hidden_rows)
        return sample_tokens(logits, temperature, top_k, top_p, min_p, row_keys(seeds, step))

    first = pick(hidden[rows, lens - 1], 0)
    out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stop_ids)

    def cond(state):
        step, _, _, _, done = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, cache, last, out, done = state
        positions = (lens + step - 1)[:, None]
        hidden, cache = model(last[:, None], positions, cache, DenseMetadata(positions, positions), _attention(cfg))
        nxt = pick(hidden[:, 0], step)
        return step + 1, cache, nxt, out.at[:, step].set(nxt), done | jnp.isin(nxt, stop_ids)

    _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, first, out, done))
    return out


def _per_row(value, batch: int, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype)
    return np.broadcast_to(arr, (batch,)).copy() if arr.ndim == 0 else arr


def generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=0,
             stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
             model_class: type[nnx.Module] = LlamaDecoder) -> list[list[int]]:
    """Generate up to `max_new_tokens` tokens for each prompt (lists of token ids).

    Sampling knobs are scalars or one value per prompt (see `sampling.sample_tokens`);
    `seeds` likewise, so row b's draws depend only on its own seed. A row stops after
    its first stop token (included in its output); `stop_token_ids` defaults to the
    config's EOS ids, and `ignore_eos=True` never stops early. `model_class`: the Flax
    decoder class the params belong to.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tokens, lens = _pad_prompts(cfg, prompts)
    batch = len(prompts)
    max_len = _round_up(int(lens.max()) + max_new_tokens)
    stops = [] if ignore_eos else list(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
    out = _generate(
        params, cfg, model_class, max_new_tokens, max_len, jnp.asarray(tokens), jnp.asarray(lens),
        jnp.asarray(_per_row(temperature, batch, np.float32)), jnp.asarray(_per_row(top_k, batch, np.int32)),
        jnp.asarray(_per_row(top_p, batch, np.float32)), jnp.asarray(_per_row(min_p, batch, np.float32)),
        jnp.asarray(_per_row(seeds, batch, np.uint32)), jnp.asarray(np.array(stops or [-1], np.int32)))
    results = []
    for row in np.asarray(out).tolist():
        hit = [i for i, t in enumerate(row) if t in stops]
        results.append(row[: hit[0] + 1] if hit else row)
    return results
