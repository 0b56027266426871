"""ModelRunner: the one place that crosses the host/device border.

It owns the device KV cache and the host swap space, turns each SchedulerOutput into a
padded BatchInputs (numpy), and runs one jitted step per (seq, token) bucket with the
cache donated: the model over the new tokens (K/V written at their slots, attention
through the block tables) and logits for each row's last token; then the step's head.
Where the platform splits it (`Platform.fused_head` False: the CPU, `step_head.py` says
why), the head is a jitted call of its own (head_dispatch.py): greedy rows take the argmax,
only a batch with a sampled row runs the sampler, and where the LM head runs on a native
kernel that also returns each row's argmax, an all-greedy batch asking no logprobs skips the
head. Where the platform fuses it (GPU, TPU), one program per bucket runs the model and
`step_head.fused_head` and returns only what the host reads: one dispatch per step. Which
variant of a step runs (decode or mixed attention where the kernels differ; a fused head
that samples or not) is picked on the host and compiled as a program of its own: no step
runs a `lax.cond`, which a GPU executes by waiting on the host for the predicate.
Copy-on-write block copies run as their own jitted call, only in steps that have any (the
batch's copy list is padded to max_num_seqs; copying the padding inside every step cost
36 ms at max_num_seqs 128, SmolLM2: `experiments/step_shape_costs.py`).

What differs by device comes from the platform layer (paged_jax/platform/), asked once, by
the StepModel (step_model.py): the attention kernels, the `Linear` and the weights' layout,
and the functions the programs here are jitted from. Every bucket compiles at warm-up (or
comes whole from the executable cache, executable_cache.py); a counter incremented at trace
time proves nothing compiles afterwards.

With a `mesh` (tensor_parallel_size > 1, `paged_jax/distributed/tensor_parallel.py`) the same step
runs SPMD over the mesh: the cache is created sharded by KV head, attention runs per
shard under shard_map, logits are gathered before sampling, and the step's in/out
shardings are pinned so the donated cache never moves. Without one, nothing changes.
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.config.engine_config import EngineConfig
from paged_jax.config.model_config import ModelConfig
from paged_jax.core.scheduler_output import SchedulerOutput
from paged_jax.core.sequence import Sequence
from paged_jax.distributed import tensor_parallel as tp
from paged_jax.model.decoder import LlamaDecoder
from paged_jax.model.llama import Params
from paged_jax.platform import Platform, current_platform
from paged_jax.worker import kv_cache as kvc
from paged_jax.worker.batch_inputs import (BatchInputs, all_batch_shapes, batch_shape_kinds, empty_batch,
                                           prepare_batch, step_inputs)
from paged_jax.worker.block_moves import BlockMover
from paged_jax.worker.block_tables import HostBlockTables
from paged_jax.worker.executable_cache import BucketPrograms, ExecutableCache, Variants, one_bucket
from paged_jax.worker.head_dispatch import SplitHeads
from paged_jax.worker.prompt_scoring import score_prompt_positions
from paged_jax.worker.step_head import StepResult
from paged_jax.worker.step_model import StepModel
from paged_jax.worker.warm_up import compile_buckets


class DispatchedStep(NamedTuple):
    """A step on its way (`ModelRunner.dispatch`): its result as device arrays, until `fetch`."""

    result: StepResult  # padded rows; device arrays (numpy where a head computed nothing)
    hidden: jax.Array  # every token's final hidden state (prompt logprobs are scored from it)
    batch: BatchInputs
    num_rows: int  # the chunks scheduled (rows past them are padding)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params: Params, config: EngineConfig, *, num_blocks: int,
                 num_host_blocks: int, mesh=None, model_class: type[nnx.Module] = LlamaDecoder,
                 structured_outputs: bool = False, platform: Platform | None = None):
        """`structured_outputs`: also compile the heads that sample under a token bitmask
        (what the engine asks for when it can compile grammars: it has a tokenizer).
        `platform`: what differs by device (None: `current_platform()`; tests pass one to run
        another platform's choices, e.g. the fused head, on this machine)."""
        self.platform = current_platform() if platform is None else platform
        self.model_config = model_config
        self.config = config
        self.model_class = model_class
        self.num_top_logprobs = min(config.max_logprobs, model_config.vocab_size)
        self.structured_outputs = structured_outputs
        self.mesh = mesh  # jax.sharding.Mesh for tensor parallelism, or None (one device)
        # the model as the step programs run it (step_model.py): its layout, kernels and functions
        model = self.step_model = StepModel(model_config, params, config, mesh=mesh, model_class=model_class,
                                            platform=self.platform, structured_outputs=structured_outputs,
                                            num_top_logprobs=self.num_top_logprobs, on_trace=self._count_trace)
        self.attention_kernels, self.unroll_layers, self.rope_tables = (model.attention_kernels, model.unroll_layers,
                                                                        model.rope_tables)
        self.graphdef, self.linear, self.weight_layout = model.graphdef, model.linear, model.weight_layout
        self.params, self.packed_head = model.params, model.packed_head
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.block_tables = HostBlockTables(self.max_blocks_per_seq)  # kept between steps (updates only)
        self.max_copies = config.max_num_seqs
        # Host work (the structured-output bitmask) overlaps the dispatched model step only off
        # CPU: on a CPU the step's XLA threads already use every core, and overlapping made
        # the step slower (`python -m experiments.structured_outputs_overhead`, one-off: +19%
        # overlapped against +11% before the step, 32 rows of SmolLM2 on 2 cores)
        self.overlap_host_work = self.platform.overlap_host_work
        # i32 words of a row's token bitmask; 1 (an unread placeholder) without structured outputs
        self.mask_words = -(-model_config.vocab_size // 32) if structured_outputs else 1
        if config.kv_cache_dtype == "auto":
            raise ValueError("resolve kv_cache_dtype before building the runner")
        dtype = jnp.dtype(config.kv_cache_dtype)
        # the sampling head inside the model step where the platform fuses it (one dispatch per step, no
        # logits round trip); a tensor-parallel step keeps the split: its step pins (logits, cache)
        # shardings and its heads run replicated on the gathered logits, and no fused program's
        # shardings have been worked out (or measured) yet
        self.fused_head = self.platform.fused_head and mesh is None
        if mesh is not None and num_host_blocks and jax.process_count() > 1:
            raise ValueError("multi-host engines preempt by recompute only (each process holds only its heads of a "
                             "block, so a swap cannot go through one host's memory): use preemption_mode='recompute'")
        if mesh is None:
            self.kv_cache = kvc.init_kv_cache(model_config, num_blocks, config.block_size, dtype)
        else:
            self.kv_cache = tp.init_kv_cache(model_config, num_blocks, config.block_size, dtype, mesh)
        host_shape = (model_config.num_layers, num_host_blocks, config.block_size, model_config.num_kv_heads,
                      model_config.head_dim)
        self.block_mover = BlockMover(host_shape, dtype, num_blocks, mesh)  # swap space, whole-block moves
        self.num_compilations = 0  # traces of the step function (one per compiled shape)
        self.executables: ExecutableCache | None = None  # where warm-up found its programs (`warm_up`)
        self._step_seconds = 0.0  # wall time inside step calls (`device_seconds` adds the block moves)
        # multi-host leader: sends each step's inputs to the follower processes first
        self.on_step: Callable[[BatchInputs], None] | None = None
        step_shardings = {} if mesh is None else tp.jit_kwargs(mesh, params)
        cache_shardings = {} if mesh is None else {"out_shardings": tp.cache_sharding(mesh)}
        if self.rope_tables is not None:
            self.rope_tables = jax.device_put(self.rope_tables, tp.replicated(mesh) if mesh is not None else None)
        # The token feed: each step's sampled tokens, in its rows, left on the device for the next
        # step, which reads the tokens the host has not read yet from it (async scheduling,
        # BatchInputs.feed_rows); every program that samples writes it (donated)
        self._feed = jax.device_put(np.zeros(max(config.seq_buckets), np.int32),
                                    tp.replicated(mesh) if mesh is not None else None)
        # per variant and (num_seqs, num_tokens) bucket, the Compiled program warm-up loaded or compiled
        # (`Variants`, `BucketPrograms`): the step's kind where the attention kernels split decode steps
        # (`_kind`), and whether the fused head samples, chosen on the host, a program each, so no step
        # runs a `lax.cond`
        kinds = ("decode", "mixed") if self.attention_kernels.splits_decode else (None,)
        self._step = Variants("step", lambda kind: jax.jit(functools.partial(model.step, kind=kind),
                                                           donate_argnums=(1, 5, 6), **step_shardings),
                              _batch_bucket, [{"kind": kind} for kind in kinds])
        self._fused_step = Variants("fused_step", lambda kind, sample: jax.jit(  # no mesh (`fused_head`)
            functools.partial(model.fused_step, kind=kind, sample=sample), donate_argnums=(1, 5)),
            _batch_bucket, [{"kind": kind, "sample": sample} for kind in kinds for sample in (False, True)])
        self._logits_buffers: dict[int, jax.Array] = {}  # row bucket -> last step's logits, donated to the next
        self._heads = SplitHeads(self.num_top_logprobs, mesh, self._count_trace)
        prompt_shardings = {} if mesh is None else {
            "in_shardings": (step_shardings["in_shardings"][0], tp.replicated(mesh), tp.replicated(mesh),
                             tp.replicated(mesh)), "out_shardings": tp.replicated(mesh)}
        self._prompt_head = BucketPrograms("prompt_head", jax.jit(model.prompt_head, **prompt_shardings),
                                           one_bucket)
        # jitted as this runner's own function: a jit of the module-level one is shared by every runner in
        # the process, whose later warm-ups then get its executable from memory, unstorable (executable_cache)
        self._copy_blocks = BucketPrograms("copy_blocks", jax.jit(functools.partial(kvc.copy_blocks),
                                                                  donate_argnums=(0,), **cache_shardings), one_bucket)

    # ---- device functions -------------------------------------------------------------
    def _count_trace(self) -> None:
        self.num_compilations += 1  # called only while tracing

    def _logits_buffer(self, batch: BatchInputs) -> jax.Array:
        """A [rows, vocab] f32 buffer for the step to write its logits into: the previous
        step's logits of this row bucket, donated (the head has read them by then). Why:
        the logits are the step's one big output, and a fresh 12.6 MiB output per 64-row
        SmolLM2 step came back from the allocator as new pages, ~2,700 page faults a step
        (a one-off run of `trace_step_breakdown`, which counts them per step kind); a donated
        buffer is reused in place."""
        rows = batch.block_tables.shape[0]
        buffer = self._logits_buffers.pop(rows, None)
        if buffer is None:
            shape = (rows, self.model_config.vocab_size)
            sharding = tp.replicated(self.mesh) if self.mesh is not None else None
            buffer = jax.device_put(np.zeros(shape, np.float32), sharding)
        return buffer

    # ---- host API ---------------------------------------------------------------------
    def warm_up(self, progress: bool = False) -> None:
        """Compile every bucket now, so serving never waits on the compiler. `progress`: a
        bar on stderr over the buckets (what is compiling, how many are left, the time to go):
        a cold start compiles for a minute or more on a small CPU, and a silent console then
        looks hung.

        The steps and heads are lowered and compiled, not run (`jit(...).lower(...).compile()`
        fills the same caches a call does, so the first real step neither traces nor
        compiles, `tests/worker/test_warm_up.py`): running every padded bucket once was a
        second or more of a warm SmolLM2 start on 2 cores, more with 1024-token buckets
        (one-off runs of `python -m experiments.startup_time`).

        With the persistent compilation cache on, each program is read whole from the
        executable cache (executable_cache.py) and its bucket's calls run it: a warm start
        traces and lowers nothing."""
        # Tracing makes many objects, and each full collection then walks every object the
        # process holds (the loaded model's, the tokenizer's, the imported libraries'): frozen
        # for the warm-up's length, the collector looks only at what warm-up creates (about a
        # second less warm-up for SmolLM2 on 2 cores in one-off runs of `experiments.startup_time`);
        # unfrozen after, so nothing stays pinned
        gc.freeze()
        try:
            self.executables = ExecutableCache.for_runner(self)
            compile_buckets(self, progress)
        finally:
            gc.unfreeze()

    @property
    def device_seconds(self) -> float:
        """Wall time inside device calls: steps and whole-block moves."""
        return self._step_seconds + self.block_mover.seconds

    def read_blocks(self, block_ids) -> tuple[np.ndarray, np.ndarray]:
        """K and V of device blocks `block_ids` as host arrays (BlockMover.read_blocks)."""
        return self.block_mover.read_blocks(self.kv_cache, block_ids)

    def check_block_arrays(self, num_blocks: int, k: np.ndarray, v: np.ndarray) -> None:
        """ValueError unless k, v are what write_blocks accepts (BlockMover.check_block_arrays)."""
        self.block_mover.check_block_arrays(num_blocks, k, v)

    def write_blocks(self, block_ids, k: np.ndarray, v: np.ndarray) -> None:
        """Overwrite device blocks `block_ids` with K and V (BlockMover.write_blocks)."""
        self.kv_cache = self.block_mover.write_blocks(self.kv_cache, block_ids, k, v)

    def batch_shapes(self) -> list[tuple[int, int]]:
        """Every (num_seqs, num_tokens) bucket a step can have: what warm-up compiles."""
        return all_batch_shapes(self.config.seq_buckets, self.config.token_buckets)

    def step_kinds(self) -> dict[tuple[int, int], tuple]:
        """Per bucket, the step kinds (`_kind`) its steps can have: warm-up compiles each."""
        if not self.attention_kernels.splits_decode:
            return {shape: (None,) for shape in self.batch_shapes()}
        return batch_shape_kinds(self.config.seq_buckets, self.config.token_buckets)

    def empty_batch(self, num_seqs: int, num_tokens: int) -> BatchInputs:
        """An all-padding batch of one bucket (warm-up's input; multi-host broadcast templates)."""
        return empty_batch(num_seqs, num_tokens, self.max_blocks_per_seq, self.max_copies,
                           self.num_blocks * self.config.block_size, mask_words=self.mask_words)

    def execute(self, output: SchedulerOutput, seqs: Mapping[int, Sequence],
                token_bitmask: np.ndarray | Callable[[], np.ndarray] | None = None) -> StepResult:
        """Run one scheduled step; returns what it sampled, one row per chunk. `token_bitmask`
        (i32[chunks, ceil(vocab / 32)]): the tokens each row may sample (structured outputs),
        or a function that computes it: where the platform overlaps host work and splits the
        head, called while the model step runs (it is dispatched asynchronously; only the
        head needs the mask), so the matchers' host work overlaps the device's, as vLLM
        overlaps them (`overlap_host_work`); a fused head needs it at dispatch."""
        batch, late = self._prepare(output, seqs, token_bitmask, None)
        n = len(output.chunks)
        result = self.run_batch(batch) if late is None else self.run_batch(batch, late_bitmask=late)
        return StepResult(*(a[:n] for a in result[:4]), prompt=result.prompt)

    def dispatch(self, output: SchedulerOutput, seqs: Mapping[int, Sequence],
                 token_bitmask: np.ndarray | Callable[[], np.ndarray] | None = None,
                 feed_rows: Mapping[int, int] | None = None) -> DispatchedStep:
        """Start one scheduled step on the device and return without waiting for it (async
        scheduling); `fetch` reads its result. `feed_rows`: sequence id -> its row in the step
        dispatched before this one, for each sequence whose last token that step sampled and
        the host has not read (its chunk holds PENDING_TOKEN there: the step takes the token
        from the device). `token_bitmask` as in `execute`."""
        batch, late = self._prepare(output, seqs, token_bitmask, feed_rows)
        start = time.perf_counter()
        step = DispatchedStep(*self._launch(batch, late), batch, len(output.chunks))
        self._step_seconds += time.perf_counter() - start
        return step

    def fetch(self, step: DispatchedStep) -> StepResult:
        """Wait for a dispatched step and read what it sampled, one row per chunk, as numpy."""
        start = time.perf_counter()
        result = self._collect(step.result, step.hidden, step.batch)
        self._step_seconds += time.perf_counter() - start
        n = step.num_rows
        return StepResult(*(a[:n] for a in result[:4]), prompt=result.prompt)

    def _prepare(self, output: SchedulerOutput, seqs, token_bitmask, feed_rows):
        """(the step's BatchInputs, the bitmask function to call once the model step runs, or
        None); runs the step's swaps first."""
        if token_bitmask is not None and not self.structured_outputs:
            raise ValueError("this runner was built without structured_outputs=True: its masked heads are not compiled")
        # a fused head reads the mask inside the step, so it must be in the batch at dispatch
        late = (token_bitmask if callable(token_bitmask) and self.on_step is None and self.overlap_host_work
                and not self.fused_head else None)
        if callable(token_bitmask) and late is None:  # now: multi-host followers need it in the broadcast batch
            token_bitmask = token_bitmask()
        if output.swap_out:
            self.block_mover.swap_out(self.kv_cache, output.swap_out)
        if output.swap_in:
            self.kv_cache = self.block_mover.swap_in(self.kv_cache, output.swap_in)
        batch = prepare_batch(output, seqs, self.block_tables, block_size=self.config.block_size,
                              num_blocks=self.num_blocks, seq_buckets=self.config.seq_buckets,
                              token_buckets=self.config.token_buckets, max_copies=self.max_copies,
                              token_bitmask=None if late else token_bitmask, mask_words=self.mask_words,
                              feed_rows=feed_rows)
        return batch, late

    def run_batch(self, batch: BatchInputs, late_bitmask: Callable[[], np.ndarray] | None = None) -> StepResult:
        """Run the jitted step on a prepared batch (multi-host followers call this with the
        leader's batch); returns every padded row, as numpy. `late_bitmask`: the rows' token
        bitmask, computed once the model step is dispatched (`execute`)."""
        start = time.perf_counter()
        result = self._collect(*self._launch(batch, late_bitmask), batch)
        self._step_seconds += time.perf_counter() - start
        return result

    def _launch(self, batch: BatchInputs, late_bitmask) -> tuple[StepResult, jax.Array]:
        """Dispatch the step's programs (block copies, the model, its head); (the result as
        device arrays, every token's hidden state). Nothing here waits for the device."""
        if self.on_step is not None:
            self.on_step(batch)
        if batch.copy_dst.any():  # padding is (0, 0): the null block onto itself
            self.kv_cache = self._copy_blocks(self.kv_cache, batch.copy_src, batch.copy_dst)
        kind = self._kind(batch)
        if self.fused_head:
            outs, self.kv_cache, hidden, self._feed = self._fused_step(
                self.params, self.kv_cache, self._fused_inputs(batch), self.rope_tables, self.packed_head, self._feed,
                kind=kind, sample=bool(batch.temperature.any()))
            return StepResult(*outs), hidden
        return self._split_step(batch, late_bitmask, kind)

    def _kind(self, batch: BatchInputs) -> str | None:
        """The step's kind for kernels that split decode steps (`AttentionKernels.splits_decode`):
        "decode" when no row has more than one query token, else "mixed"; None otherwise."""
        if not self.attention_kernels.splits_decode:
            return None
        return "decode" if (np.diff(batch.query_start_loc) <= 1).all() else "mixed"

    def _collect(self, result: StepResult, hidden, batch: BatchInputs) -> StepResult:
        """A launched step's result on the host (waits for the device), with its prompt logprobs.
        Only what some row asked for comes back (`want_top`): the tokens; their logprobs where a
        row asked for logprobs; the top-K where one asked for alternatives (zeros otherwise, as
        the heads leave them when nobody asks)."""
        want = int(batch.want_top[0])
        wanted = (result.tokens,) + ((result.logprobs,) if want else ()) + (tuple(result[2:4]) if want > 1 else ())
        got = jax.device_get(wanted)
        rows, k = got[0].shape[0], self.num_top_logprobs
        result = StepResult(got[0], got[1] if want else np.zeros(rows, np.float32),
                            *(got[2:4] if want > 1 else (np.zeros((rows, k), np.int32), np.zeros((rows, k), np.float32))))
        if (batch.prompt_targets >= 0).any():
            head = functools.partial(self._prompt_head, self.params, self.packed_head)
            result = result._replace(prompt=score_prompt_positions(head, hidden, batch))
        return result

    def _split_step(self, batch: BatchInputs, late_bitmask, kind) -> tuple[StepResult, jax.Array]:
        """The model step, then its head as a call of its own (`SplitHeads`); (result, hidden)."""
        logits, self.kv_cache, hidden, greedy, self._feed = self._step(
            self.params, self.kv_cache, step_inputs(batch), self.rope_tables, self.packed_head,
            self._logits_buffer(batch), self._feed, kind=kind)
        if late_bitmask is not None:  # host work while the model step runs
            rows = late_bitmask()
            mask = np.full_like(batch.token_bitmask, -1)
            mask[: len(rows)] = rows
            batch = batch._replace(token_bitmask=mask, use_mask=np.ones(1, np.int32))
        result = self._heads.native_greedy(greedy, batch)
        if result is None:
            result, self._feed = self._heads.run(logits, self._feed, batch)
        self._logits_buffers[logits.shape[0]] = logits
        return result, hidden

    def _fused_inputs(self, batch: BatchInputs) -> BatchInputs:
        """The batch as the fused step reads it: the token bitmask too, where the runner serves
        structured outputs (else its one-word placeholder stays on the host), not the prompt targets."""
        if self.structured_outputs:
            return batch._replace(prompt_targets=None)
        return step_inputs(batch)


def _batch_bucket(params, kv_cache, batch: BatchInputs, *rest) -> tuple[int, int]:
    """A step call's bucket: (num_seqs, num_tokens) of its padded batch."""
    return batch.block_tables.shape[0], batch.token_ids.shape[0]
