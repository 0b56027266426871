"""ModelRunner: the one place that crosses the host/device border.

It owns the device KV cache and the host swap space, turns each SchedulerOutput into a
padded BatchInputs (numpy), and runs one jitted step per (seq, token) bucket with the
cache donated: the model over the new tokens (K/V written at their slots, attention
through the block tables), logits for each row's last token, and sampling with per-row
parameters. Copy-on-write block copies run as their own jitted call, only in steps that
have any (the batch's copy list is padded to max_num_seqs entries; copying the padding
inside every step cost 36 ms at max_num_seqs 128, SmolLM2: `experiments/step_shape_costs.py`).
Every bucket compiles at warm-up; a counter incremented at trace time proves nothing
compiles afterwards.

The model is a Flax NNX class (`paged_jax.model.decoder.LlamaDecoder` unless the loaded
model names its own): the runner keeps only its static GraphDef and the parameter
pytree, and the step rebuilds the module from the params it is passed
(`paged_jax/model/functional.py`), so the jitted step is a pure function of
(params, cache, batch).

With a `mesh` (tensor_parallel_size > 1, `paged_jax/distributed/tensor_parallel.py`) the same step
runs SPMD over the mesh: the cache is created sharded by KV head, attention runs per
shard under shard_map, logits are gathered before sampling, and the step's in/out
shardings are pinned so the donated cache never moves. Without one, nothing changes.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.attention.paged_attention import PagedMetadata, paged_attention
from paged_jax.config.engine_config import EngineConfig
from paged_jax.config.model_config import ModelConfig
from paged_jax.core.scheduler_output import SchedulerOutput
from paged_jax.core.sequence import Sequence
from paged_jax.distributed import tensor_parallel as tp
from paged_jax.model.decoder import LlamaDecoder
from paged_jax.model.functional import check_params, restack_layers, split_model, unstack_layers
from paged_jax.model.llama import Params
from paged_jax.worker import kv_cache as kvc
from paged_jax.worker.batch_inputs import BatchInputs, all_batch_shapes, empty_batch, prepare_batch
from paged_jax.worker.block_tables import HostBlockTables
from paged_jax.worker.sampler import sample_tokens

SWAP_CHUNK = 16  # blocks moved per swap call: a fixed shape, compiled at warm-up


class StepResult(NamedTuple):
    """Per scheduled chunk (row): what the step sampled and the next-token distribution's
    head (beam search candidates and the API's top logprobs; raw logits, no temperature),
    computed only in steps where some row asks for it (zeros otherwise: a top-K over the
    whole vocabulary for every row cost 12 ms of a 64-row SmolLM2 step here)."""

    tokens: np.ndarray  # i32[rows]: the sampled token
    logprobs: np.ndarray  # f32[rows]: its log-probability
    top_ids: np.ndarray  # i32[rows, K]: the K most likely next tokens, best first
    top_logprobs: np.ndarray  # f32[rows, K]: their log-probabilities


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params: Params, config: EngineConfig, *, num_blocks: int,
                 num_host_blocks: int, mesh=None, model_class: type[nnx.Module] = LlamaDecoder):
        if config.attention_backend not in ("native", "pallas", "xla", "reference"):
            raise ValueError(f"resolve attention_backend {config.attention_backend!r} before building the runner")
        if config.layer_loop not in ("unroll", "scan"):
            raise ValueError(f"resolve layer_loop {config.layer_loop!r} before building the runner")
        # a Python loop over per-layer weights (LlamaDecoder's unroll_layers) where the class's call takes
        # it; a tensor-parallel step keeps the scan (its shardings follow the stacked parameter layout)
        self.unroll_layers = (config.layer_loop == "unroll" and mesh is None
                              and "unroll_layers" in inspect.signature(model_class.__call__).parameters)
        self.model_config = model_config
        self.config = config
        self.graphdef, param_shapes = split_model(model_class, model_config)
        check_params(param_shapes, params, f"params for {model_class.__name__}")
        self.params = unstack_layers(params) if self.unroll_layers else params
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.block_tables = HostBlockTables(self.max_blocks_per_seq)  # kept between steps (updates only)
        self.max_copies = config.max_num_seqs
        self.num_top_logprobs = min(config.max_logprobs, model_config.vocab_size)
        if config.kv_cache_dtype == "auto":
            raise ValueError("resolve kv_cache_dtype before building the runner")
        dtype = jnp.dtype(config.kv_cache_dtype)
        self.mesh = mesh  # jax.sharding.Mesh for tensor parallelism, or None (one device)
        if mesh is not None and num_host_blocks and jax.process_count() > 1:
            raise ValueError("multi-host engines preempt by recompute only (each process holds only its heads of a "
                             "block, so a swap cannot go through one host's memory): use preemption_mode='recompute'")
        if mesh is None:
            self.kv_cache = kvc.init_kv_cache(model_config, num_blocks, config.block_size, dtype)
        else:
            self.kv_cache = tp.init_kv_cache(model_config, num_blocks, config.block_size, dtype, mesh)
        host_shape = (model_config.num_layers, num_host_blocks, config.block_size, model_config.num_kv_heads,
                      model_config.head_dim)
        self.host_cache = {name: np.zeros(host_shape, dtype) for name in ("k", "v")}
        self.num_compilations = 0  # traces of the step function (one per compiled shape)
        self.device_seconds = 0.0  # wall time inside device calls (step and swaps)
        # multi-host leader: sends each step's inputs to the follower processes first
        self.on_step: Callable[[BatchInputs], None] | None = None
        step_shardings = {} if mesh is None else tp.jit_kwargs(mesh, params)
        swap_shardings = {} if mesh is None else {"out_shardings": tp.cache_sharding(mesh)}
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), **step_shardings)
        self._copy_blocks = jax.jit(kvc.copy_blocks, donate_argnums=(0,), **swap_shardings)
        self._swap_in = jax.jit(self._swap_in_impl, donate_argnums=(0,), **swap_shardings)
        self._gather_blocks = jax.jit(self._gather_blocks_impl)

    # ---- device functions -------------------------------------------------------------
    def _step_impl(self, params, kv_cache, batch: BatchInputs):
        self.num_compilations += 1  # runs only while tracing
        cfg = self.model_config
        meta = PagedMetadata(batch.slot_mapping, batch.block_tables, batch.context_lens, batch.query_start_loc)
        attention = functools.partial(paged_attention, sliding_window=cfg.sliding_window,
                                      backend=self.config.attention_backend)
        if self.mesh is not None:
            attention = tp.sharded_attention(attention, self.mesh)
        if self.unroll_layers:
            model = nnx.merge(self.graphdef, restack_layers(params))
            hidden, kv_cache = model(batch.token_ids, batch.positions, kv_cache, meta, attention, unroll_layers=True)
        else:
            model = nnx.merge(self.graphdef, params)
            hidden, kv_cache = model(batch.token_ids, batch.positions, kv_cache, meta, attention)
        logits = model.compute_logits(hidden[batch.logits_indices])
        if self.mesh is not None:  # vocab-sharded -> whole on every device: sampling runs replicated
            logits = tp.gather_logits(logits, cfg.vocab_size, self.mesh)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(batch.seeds, batch.sample_index)
        tokens = sample_tokens(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, keys)
        logits = logits.astype(jnp.float32)
        log_norm = jax.nn.logsumexp(logits, axis=-1)  # log_softmax without materializing it
        logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_norm
        k = self.num_top_logprobs

        def top():  # top-K over the whole vocabulary: only when a row asked (API logprobs, beams)
            values, ids = jax.lax.top_k(logits, k)
            return values - log_norm[:, None], ids

        def no_top():
            return jnp.zeros((logits.shape[0], k), jnp.float32), jnp.zeros((logits.shape[0], k), jnp.int32)

        top_logprobs, top_ids = jax.lax.cond(batch.want_top[0] > 0, top, no_top)
        return StepResult(tokens, logprobs, top_ids, top_logprobs), kv_cache

    @staticmethod
    def _swap_in_impl(kv_cache, dst, k_blocks, v_blocks):
        return {"k": kv_cache["k"].at[:, dst].set(k_blocks, mode="drop"),
                "v": kv_cache["v"].at[:, dst].set(v_blocks, mode="drop")}

    @staticmethod
    def _gather_blocks_impl(kv_cache, src):
        return kv_cache["k"][:, src], kv_cache["v"][:, src]

    # ---- host API ---------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile every bucket now, so serving never waits on the compiler."""
        for num_seqs, num_tokens in self.batch_shapes():
            batch = self.empty_batch(num_seqs, num_tokens)
            result, self.kv_cache = self._step(self.params, self.kv_cache, batch)
            result.tokens.block_until_ready()
        no_copies = np.zeros(self.max_copies, np.int32)  # the null block onto itself
        self.kv_cache = jax.block_until_ready(self._copy_blocks(self.kv_cache, no_copies, no_copies))
        if self.host_cache["k"].shape[1]:  # swapping moves SWAP_CHUNK blocks per call
            null = np.zeros(SWAP_CHUNK, np.int32)
            jax.block_until_ready(self._gather_blocks(self.kv_cache, null))
            self._swap_in_blocks(np.full(SWAP_CHUNK, self.num_blocks, np.int32), null)

    def batch_shapes(self) -> list[tuple[int, int]]:
        """Every (num_seqs, num_tokens) bucket a step can have: what warm-up compiles."""
        return all_batch_shapes(self.config.seq_buckets, self.config.token_buckets)

    def empty_batch(self, num_seqs: int, num_tokens: int) -> BatchInputs:
        """An all-padding batch of one bucket (warm-up's input; multi-host broadcast templates)."""
        return empty_batch(num_seqs, num_tokens, self.max_blocks_per_seq, self.max_copies,
                           self.num_blocks * self.config.block_size)

    def execute(self, output: SchedulerOutput, seqs: Mapping[int, Sequence]) -> StepResult:
        """Run one scheduled step; returns what it sampled, one row per chunk."""
        if output.swap_out:
            self._do_swap_out(output.swap_out)
        if output.swap_in:
            self._do_swap_in(output.swap_in)
        batch = prepare_batch(output, seqs, self.block_tables, block_size=self.config.block_size,
                              num_blocks=self.num_blocks, seq_buckets=self.config.seq_buckets,
                              token_buckets=self.config.token_buckets, max_copies=self.max_copies)
        n = len(output.chunks)
        return StepResult(*(a[:n] for a in self.run_batch(batch)))

    def run_batch(self, batch: BatchInputs) -> StepResult:
        """Run the jitted step on a prepared batch (multi-host followers call this with the
        leader's batch); returns every padded row, as numpy."""
        if self.on_step is not None:
            self.on_step(batch)
        start = time.perf_counter()
        if batch.copy_dst.any():  # padding is (0, 0): the null block onto itself
            self.kv_cache = self._copy_blocks(self.kv_cache, batch.copy_src, batch.copy_dst)
        result, self.kv_cache = self._step(self.params, self.kv_cache, batch)
        result = StepResult(*(np.asarray(a) for a in result))
        self.device_seconds += time.perf_counter() - start
        return result

    def _do_swap_out(self, pairs) -> None:
        """Device blocks -> host blocks, SWAP_CHUNK at a time (one compiled shape)."""
        start = time.perf_counter()
        for chunk in _chunks(pairs):
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = [d for d, _ in chunk]
            k, v = self._gather_blocks(self.kv_cache, src)
            host = [h for _, h in chunk]
            self.host_cache["k"][:, host] = np.asarray(k)[:, : len(chunk)]
            self.host_cache["v"][:, host] = np.asarray(v)[:, : len(chunk)]
        self.device_seconds += time.perf_counter() - start

    def _do_swap_in(self, pairs) -> None:
        """Host blocks -> device blocks, SWAP_CHUNK at a time."""
        start = time.perf_counter()
        for chunk in _chunks(pairs):
            dst = np.full(SWAP_CHUNK, self.num_blocks, np.int32)  # out of range: dropped
            dst[: len(chunk)] = [d for _, d in chunk]
            src = np.zeros(SWAP_CHUNK, np.int32)
            src[: len(chunk)] = [h for h, _ in chunk]
            self._swap_in_blocks(dst, src)
        self.device_seconds += time.perf_counter() - start

    def _swap_in_blocks(self, dst: np.ndarray, host_src: np.ndarray) -> None:
        k, v = self.host_cache["k"][:, host_src], self.host_cache["v"][:, host_src]
        if self.mesh is not None:  # each device receives only its heads of the blocks
            k, v = (tp.place(a, tp.cache_sharding(self.mesh)) for a in (k, v))
        self.kv_cache = self._swap_in(self.kv_cache, dst, k, v)


def _chunks(pairs):
    pairs = list(pairs)
    return [pairs[i:i + SWAP_CHUNK] for i in range(0, len(pairs), SWAP_CHUNK)]
