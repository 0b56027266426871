"""StepModel: the model as the runner's jitted programs run it.

What the platform decided for this model (paged_jax/platform/): the attention kernels of the
resolved backend, the `Linear` the layers multiply with and the layout the weights (and the
LM head, where the Linear has one) are packed into, and whether the layers run as a Python
loop over per-layer weights or a scan; and the functions the runner jits from them: the
split step (the model, then the head as a call of its own), the fused step (the model and
`step_head.fused_head` in one program) and the prompt-logprob head. The model is a Flax
NNX class (`LlamaDecoder` unless the loaded model names its own): only its static GraphDef
is kept, and each function rebuilds the module from the params it is passed
(`paged_jax/model/functional.py`), so every program is a pure function of its arguments.
A file of its own so model_runner.py holds the runner's state and its host API.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from paged_jax.attention.paged_attention import PagedMetadata, paged_attention
from paged_jax.config.engine_config import EngineConfig
from paged_jax.config.model_config import ModelConfig
from paged_jax.distributed import tensor_parallel as tp
from paged_jax.model.decoder import LlamaDecoder
from paged_jax.model.functional import check_params, layer_matrices_as, restack_layers, split_model, unstack_layers
from paged_jax.model.llama import Params
from paged_jax.model.rope import inverse_frequencies, rope_tables
from paged_jax.platform import Platform
from paged_jax.worker.batch_inputs import BatchInputs
from paged_jax.worker.step_head import fused_head, prompt_logprob_head


class StepModel:
    def __init__(self, model_config: ModelConfig, params: Params, config: EngineConfig, *, mesh,
                 model_class: type[nnx.Module], platform: Platform, structured_outputs: bool, num_top_logprobs: int,
                 on_trace: Callable[[], None]):
        """`params`: the loaded weights (kept here in the platform's layout as `.params`);
        `mesh`: tensor parallelism's, or None; `structured_outputs`: the fused step reads the
        batch's token bitmask; `num_top_logprobs`: the heads' top-K width; `on_trace`: called
        whenever a function here is traced (the runner counts compilations)."""
        self.platform = platform
        self.mesh = mesh
        self.structured_outputs = structured_outputs
        self.num_top_logprobs = num_top_logprobs
        self._on_trace = on_trace
        if config.attention_backend == "auto":
            raise ValueError("resolve attention_backend 'auto' before building the runner (engine/kv_sizing.py)")
        self.attention_kernels = self.platform.attention_kernels(config.attention_backend)
        if config.layer_loop not in ("unroll", "scan"):
            raise ValueError(f"resolve layer_loop {config.layer_loop!r} before building the runner")
        # a Python loop over per-layer weights (LlamaDecoder's unroll_layers) where the class's call takes
        # it; a tensor-parallel step keeps the scan (its shardings follow the stacked parameter layout)
        call_parameters = inspect.signature(model_class.__call__).parameters
        self.unroll_layers = config.layer_loop == "unroll" and mesh is None and "unroll_layers" in call_parameters
        # cos/sin of every position, gathered by the step (rope.rope_tables says why), where the class takes them
        self.rope_tables = None
        if "rope_tables" in call_parameters:
            inv_freq = inverse_frequencies(model_config.head_dim, model_config.rope_theta, model_config.rope_scaling)
            self.rope_tables = rope_tables(inv_freq, config.max_model_len)
        self.model_config = model_config
        self.graphdef, param_shapes = split_model(model_class, model_config)
        check_params(param_shapes, params, f"params for {model_class.__name__}")
        self.params = unstack_layers(params) if self.unroll_layers else params
        # how the layers multiply by their matrices, and so the layout they are held in
        self.linear = self.platform.serving_linear(params, model_class, mesh)
        self.weight_layout = self.linear.name
        self.params = layer_matrices_as(self.params, self.linear.pack)
        self.takes_linear = "linear" in call_parameters  # a researcher's own class may not
        if not self.takes_linear and self.weight_layout != "in_out":
            raise ValueError(f"{model_class.__name__}.__call__ takes no `linear`, but the platform packed its "
                             f"weights as {self.weight_layout!r}")
        # the LM head in the Linear's own layout where it has one (its own copy: the embedding also serves
        # the token lookup); XLA's dot repacked the 49k x 576 embedding on every CPU step
        self.packed_head = None
        if model_class.compute_logits is LlamaDecoder.compute_logits:
            head = params.get("lm_head")
            self.packed_head = self.linear.pack_head(params["embed"].T if head is None else head)

    def step(self, params, kv_cache, batch: BatchInputs, rope_tables, packed_head, logits_buffer, feed, *,
             kind=None):
        """The split step (no `fused_head`): the model, returning the logits for the head's own
        call, and the token feed with the head kernel's argmax in it where there is one (the
        tokens when `native_greedy` skips the head; a head that runs overwrites them)."""
        del logits_buffer  # only donated: XLA writes the logits into it (the runner's `_logits_buffer`)
        self._on_trace()
        logits, kv_cache, hidden, greedy = self.model(params, kv_cache, batch, rope_tables, packed_head, feed,
                                                      argmax=True, kind=kind)
        if greedy is not None:
            feed = feed.at[: greedy[0].shape[0]].set(greedy[0])
        return logits, kv_cache, hidden, greedy, feed

    def fused_step(self, params, kv_cache, batch: BatchInputs, rope_tables, packed_head, feed, *, kind=None,
                   sample=False):
        """The fused step (`fused_head`): the model, then `step_head.fused_head` on its logits,
        which never leave the program; returns what the host reads (and `hidden`, for prompt
        logprobs) and the token feed with the sampled tokens in it."""
        self._on_trace()
        logits, kv_cache, hidden, _ = self.model(params, kv_cache, batch, rope_tables, packed_head, feed,
                                                 argmax=False, kind=kind)
        result = fused_head(logits, batch.token_bitmask if self.structured_outputs else None, batch.use_mask,
                            batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds, batch.sample_index,
                            k=self.num_top_logprobs, sample=sample)
        return tuple(result[:4]), kv_cache, hidden, feed.at[: result.tokens.shape[0]].set(result.tokens)

    def model(self, params, kv_cache, batch: BatchInputs, rope_tables, packed_head, feed, *, argmax: bool,
              kind=None):
        """The model over the batch's tokens: (logits of each row's last token, the cache, every
        token's hidden state, and (argmax, its logit) per row where `argmax` and a packed head's
        kernel computes them, else None)."""
        cfg = self.model_config
        meta = PagedMetadata(batch.slot_mapping, batch.block_tables, batch.context_lens, batch.query_start_loc)
        attention = functools.partial(paged_attention, sliding_window=cfg.sliding_window,
                                      kernels=self.attention_kernels, kind=kind)
        if self.mesh is not None:
            attention = tp.sharded_attention(attention, self.mesh)
        extra = {} if rope_tables is None else {"rope_tables": rope_tables}
        if self.takes_linear:
            extra["linear"] = self.linear
        # tokens still on the device (async scheduling) come from the feed the step before wrote
        token_ids = jnp.where(batch.feed_rows >= 0, feed[jnp.maximum(batch.feed_rows, 0)], batch.token_ids)
        if self.unroll_layers:
            model = nnx.merge(self.graphdef, restack_layers(params))
            hidden, kv_cache = model(token_ids, batch.positions, kv_cache, meta, attention, unroll_layers=True,
                                     **extra)
        else:
            model = nnx.merge(self.graphdef, params)
            hidden, kv_cache = model(token_ids, batch.positions, kv_cache, meta, attention, **extra)
        greedy = None  # (argmax, its logit) per row, where the head kernel computes them (`native_greedy`)
        if packed_head is not None and argmax:
            logits, *greedy = self.linear.head_logits(hidden[batch.logits_indices], packed_head, argmax=True)
        elif packed_head is not None:
            logits = self.linear.head_logits(hidden[batch.logits_indices], packed_head, argmax=False)
        else:
            logits = model.compute_logits(hidden[batch.logits_indices])
        if self.mesh is not None:  # vocab-sharded -> whole on every device: sampling runs replicated
            logits = tp.gather_logits(logits, cfg.vocab_size, self.mesh)
        return logits, kv_cache, hidden, greedy  # hidden: every token's, for prompt logprobs (prompt_scoring.py)

    def prompt_head(self, params, packed_head, hidden, targets):
        """Prompt logprobs of PROMPT_LOGPROB_ROWS rows of final hidden states: the step's
        logits computation (`step`), then `prompt_logprob_head`. A call of its own,
        run only in steps with such rows, so no other step holds [tokens, vocab] logits."""
        self._on_trace()
        model = nnx.merge(self.graphdef, restack_layers(params) if self.unroll_layers else params)
        if packed_head is not None:
            logits = self.linear.head_logits(hidden, packed_head, argmax=False)
        else:
            logits = model.compute_logits(hidden)
        if self.mesh is not None:
            logits = tp.gather_logits(logits, self.model_config.vocab_size, self.mesh)
        return prompt_logprob_head(logits, targets, k=self.num_top_logprobs)
