"""The runner's warm-up: every program a step can run, compiled (or read whole from the
executable cache) before the first request, so serving never waits on the compiler.

Per bucket (`ModelRunner.batch_shapes`) and step kind (`ModelRunner.step_kinds`): the fused
step in its greedy and sampling variants where the platform fuses the head, else the split
step and, once per row bucket, its heads; then the prompt-logprob head, the block copy and
the block moves. Each is lowered and compiled, not run (`executable_cache.prepare`; a call
then finds it in the jit's caches, or runs the Compiled program the cache gave). A bar on
stderr shows what is compiling and how much is left. A file of its own so model_runner.py
holds the runner's state and how a step runs; this reads the runner's programs and state.
"""

from __future__ import annotations

import sys

import numpy as np
import tqdm

from paged_jax.worker.batch_inputs import step_inputs
from paged_jax.worker.executable_cache import prepare
from paged_jax.worker.prompt_scoring import PROMPT_LOGPROB_ROWS


def compile_buckets(runner, progress: bool) -> None:
    """Make every program of `runner` ready (`runner.executables`: the cache to read, or None).
    `progress`: show the bar."""
    shapes = runner.batch_shapes()
    bar = tqdm.tqdm(total=len(shapes) + 1, desc="compiling buckets", unit="bucket",
                    disable=not progress, leave=False, file=sys.stderr)
    ready = lambda program, *args: prepare(program, args, runner.executables)  # noqa: E731
    heads_compiled = set()
    kinds = runner.step_kinds()
    for num_seqs, num_tokens in shapes:
        bar.set_postfix_str(f"{num_seqs} seqs x {num_tokens} tokens")
        batch = runner.empty_batch(num_seqs, num_tokens)
        if runner.fused_head:  # a program per kind and head variant (greedy, sampling)
            for kind in kinds[num_seqs, num_tokens]:
                for sample in (False, True):
                    ready(runner._fused_step.variant(kind=kind, sample=sample), runner.params, runner.kv_cache,
                          runner._fused_inputs(batch), runner.rope_tables, runner.packed_head, runner._feed)
            bar.update()
            continue
        logits = runner._logits_buffer(batch)  # the buffer the first real step of this bucket donates
        for kind in kinds[num_seqs, num_tokens]:
            ready(runner._step.variant(kind=kind), runner.params, runner.kv_cache, step_inputs(batch),
                  runner.rope_tables, runner.packed_head, logits, runner._feed)
        if num_seqs not in heads_compiled:  # the heads read only the logits: once per row bucket
            heads_compiled.add(num_seqs)
            runner._heads.warm_up(logits, runner._feed, batch, runner.structured_outputs, ready)
        runner._logits_buffers[num_seqs] = logits
        bar.update()
    bar.set_postfix_str("prompt logprobs, block copies and moves")
    hidden = np.zeros((PROMPT_LOGPROB_ROWS, runner.model_config.hidden_size), np.float32)
    ready(runner._prompt_head, runner.params, runner.packed_head, hidden, np.zeros(PROMPT_LOGPROB_ROWS, np.int32))
    no_copies = np.zeros(runner.max_copies, np.int32)  # the null block onto itself
    ready(runner._copy_blocks, runner.kv_cache, no_copies, no_copies)
    if runner.block_mover.num_host_blocks or runner.config.kv_transfer:  # swaps / prompt K/V moves
        runner.kv_cache = runner.block_mover.warm_up(runner.kv_cache)
    bar.update()
    bar.close()
