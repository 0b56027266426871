"""How a step's logits become its tokens: the split heads' jitted calls, chosen on the host.

Where the platform splits the head from the model step (`Platform.fused_head` False: the
CPU, where step_head.py's docstring says why it is faster), the runner's step returns the
logits and one of four jitted heads runs after it: greedy or sampled, each with or without
the structured-output bitmask, picked from what the host already holds (the batch's
temperatures, `use_mask`). Where the LM head runs on a native kernel that also returns each
row's argmax, an all-greedy batch asking nothing else skips the head (`native_greedy`).
Where the platform fuses the head, none of this runs: the step itself ends in
`step_head.any_head`. A file of its own so model_runner.py holds the step and its
bookkeeping, and this the head's dispatch.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from paged_jax.distributed import tensor_parallel as tp
from paged_jax.worker.batch_inputs import BatchInputs
from paged_jax.worker.executable_cache import BucketPrograms
from paged_jax.worker.step_head import StepResult, greedy_head, greedy_head_masked, sampled_head, sampled_head_masked


class SplitHeads:
    """The split heads, jitted once per runner. `k`: the top-K width; `mesh`: logits are
    replicated over it (sampling runs replicated); `on_trace`: called whenever one of the
    heads is traced (the runner counts compilations)."""

    def __init__(self, k: int, mesh, on_trace: Callable[[], None]):
        self.k = k
        self._on_trace = on_trace
        shardings = {} if mesh is None else {"in_shardings": tp.replicated(mesh), "out_shardings": tp.replicated(mesh)}
        # per row bucket, the Compiled program the runner's warm-up loaded or compiled (`BucketPrograms`);
        # the token feed (argument 1) is donated: each head writes its tokens into it (`_fed`)
        self._greedy = BucketPrograms("head_greedy", jax.jit(self._greedy_impl, donate_argnums=(1,), **shardings),
                                      _rows)
        self._sampled = BucketPrograms("head_sampled", jax.jit(self._sampled_impl, donate_argnums=(1,), **shardings),
                                       _rows)
        self._greedy_masked = BucketPrograms(
            "head_greedy_masked", jax.jit(self._greedy_masked_impl, donate_argnums=(1,), **shardings), _rows)
        self._sampled_masked = BucketPrograms(
            "head_sampled_masked", jax.jit(self._sampled_masked_impl, donate_argnums=(1,), **shardings), _rows)

    def _greedy_impl(self, logits, feed, want_top):
        self._on_trace()
        return _fed(greedy_head(logits, want_top, k=self.k), feed)

    def _sampled_impl(self, logits, feed, *sampling):
        self._on_trace()
        return _fed(sampled_head(logits, *sampling, k=self.k), feed)

    def _greedy_masked_impl(self, logits, feed, bitmask, want_top):
        self._on_trace()
        return _fed(greedy_head_masked(logits, bitmask, want_top, k=self.k), feed)

    def _sampled_masked_impl(self, logits, feed, bitmask, *sampling):
        self._on_trace()
        return _fed(sampled_head_masked(logits, bitmask, *sampling, k=self.k), feed)

    def _pick(self, logits, feed, batch: BatchInputs):
        """(the jitted head, its arguments) for a batch: the sampler only when a row samples."""
        sampling = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds, batch.sample_index,
                    batch.want_top)
        if batch.use_mask[0]:  # a row is under a structured-output constraint
            if batch.temperature.any():
                return self._sampled_masked, (logits, feed, batch.token_bitmask, *sampling)
            return self._greedy_masked, (logits, feed, batch.token_bitmask, batch.want_top)
        if batch.temperature.any():
            return self._sampled, (logits, feed, *sampling)
        return self._greedy, (logits, feed, batch.want_top)

    def run(self, logits, feed, batch: BatchInputs) -> tuple[StepResult, jax.Array]:
        """Tokens, logprobs and top-K from the step's logits (device arrays, not waited for),
        and the token feed (donated) with the tokens written into its first rows."""
        head, args = self._pick(logits, feed, batch)
        return head(*args)

    def native_greedy(self, greedy, batch: BatchInputs) -> StepResult | None:
        """The step's result straight from the head kernel's argmax (`Linear.head_logits`), for
        a batch that `greedy_head` would serve with nothing else to compute: every row greedy,
        no token bitmask, no logprobs asked (`want_top` 0, so its logprobs are the tokens' raw
        logits and its top-K zeros, as here). The tokens are the first maximum of the very
        logits the head would read, so they are the same; what is saved is its pass over the
        [rows, vocab] logits (~3.5 ms of a 64-row SmolLM2 decode step, measured in-process).
        None where the batch needs the head."""
        if greedy is None or batch.use_mask[0] or batch.temperature.any() or batch.want_top[0]:
            return None
        tokens, best = greedy  # device arrays: the host reads them when it needs them
        rows, k = tokens.shape[0], self.k
        return StepResult(tokens, best, np.zeros((rows, k), np.int32), np.zeros((rows, k), np.float32))

    def warm_up(self, logits, feed, batch: BatchInputs, structured_outputs: bool,
                compile_program: Callable[..., None] | None = None) -> None:
        """Compile, without running, every head for the row bucket of `batch` (all padding;
        `logits` and `feed` may be ShapeDtypeStructs): greedy and sampled, and both under a mask
        where the runner serves structured outputs. `compile_program(program, *args)`: how (the
        runner's, which reads the executable cache; None: lowered and compiled here)."""
        sampled = batch._replace(temperature=np.ones_like(batch.temperature))
        batches = [batch, sampled]
        if structured_outputs:
            batches += [b._replace(use_mask=np.ones(1, np.int32)) for b in (batch, sampled)]
        for b in batches:
            head, args = self._pick(logits, feed, b)
            if compile_program is None:
                head.lower(*args).compile()
            else:
                compile_program(head, *args)


def _rows(logits, *rest) -> int:
    """A head call's bucket: its rows."""
    return logits.shape[0]


def _fed(result: StepResult, feed: jax.Array) -> tuple[StepResult, jax.Array]:
    """The head's result, and `feed` with its tokens in the first rows: where the next step
    reads the tokens of sequences the host has not read yet (async scheduling)."""
    return result, feed.at[: result.tokens.shape[0]].set(result.tokens)
