"""A sequence: the token ids of one completion and how far its KV cache has caught up.

The scheduler's unit of work. `num_computed_tokens` counts tokens whose K/V are in the
cache; each step the scheduler lets it catch up towards `num_tokens` (a prefill chunk,
or the one token sampled last step), so prefill and decode are the same operation.
"""

from __future__ import annotations

import dataclasses
import enum

from paged_jax.core.sampling_params import SamplingParams

# The id a token sampled on the device but not yet read back stands under (`num_pending`):
# the runner takes the real id from the device, where the step that sampled it left it.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted by recompute
    RUNNING = "running"  # holds device blocks
    SWAPPED = "swapped"  # preempted by swap: its blocks are in host memory
    FINISHED_STOPPED = "stop"  # hit a stop token or string
    FINISHED_LENGTH = "length"  # hit max_tokens or max_model_len
    FINISHED_ABORTED = "abort"  # aborted by the caller
    FINISHED_ERROR = "error"  # an internal failure ended it (a grammar matcher's error), as vLLM's "error"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # a str lookup: cheaper than enum comparisons per step


_FINISHED_VALUES = frozenset({SequenceStatus.FINISHED_STOPPED.value, SequenceStatus.FINISHED_LENGTH.value,
                              SequenceStatus.FINISHED_ABORTED.value, SequenceStatus.FINISHED_ERROR.value})


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int  # unique for the engine's lifetime; the block manager's key
    request_id: str
    index: int  # completion index within its request (0..n-1)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    seed: int  # the request's seed, or one the engine drew for it
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    # Parallel sampling: the request's other completions, forked from this sequence (sharing
    # its blocks) once all prompt tokens but the last are computed; each then computes the
    # last prompt token itself and samples its own first token.
    pending_forks: list[Sequence] = dataclasses.field(default_factory=list)
    # Top-k (token id, logprob) alternatives of each sampled position, when asked for.
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # Beam search: this beam's next-token candidates from its last step, awaiting the
    # request's other beams (the host picks the next beams once every beam has them).
    beam_candidates: list[tuple[int, float]] | None = None
    cumulative_logprob: float = 0.0
    # Prefix caching: the keys of its leading full blocks as far as the last lookup went
    # (BlockManager.find_cached_prefix's memo: a sequence's keys never change).
    prefix_keys: list = dataclasses.field(default_factory=list, repr=False)
    # Prefix caching: requests with different salts never share cached blocks (vLLM's
    # cache_salt; part of every block key of this sequence's prompt).
    cache_salt: str | None = None
    # Priority scheduling (EngineConfig.scheduling_policy="priority"): lower runs earlier and
    # is preempted later (vLLM's rule); a request's forks and beams inherit it.
    priority: int = 0
    # Prompt tokens whose K/V came from the prefix cache at this sequence's first admission
    # (vLLM's RequestOutput.num_cached_tokens).
    num_cached_tokens: int = 0
    # Prompt logprobs: how many prompt positions (from position 1) the engine has reported, so
    # a prefill recomputed after a preemption does not report them twice.
    num_prompt_logprobs: int = 0
    # Async scheduling: tokens sampled by dispatched steps whose ids the host has not read yet.
    # They count as tokens of the sequence (the scheduler schedules their K/V like any sampled
    # token) and read as PENDING_TOKEN; the engine appends the real id once it reads it.
    num_pending: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host holds (all but the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def final_num_tokens(self) -> int:
        """Prompt + max_tokens: the length it reaches unless a stop ends it first (never more
        than max_model_len: the engine refuses such requests); contiguous allocators reserve
        for it at admission."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A request for prompt logprobs computes its whole prompt: cached blocks have K/V,
        not the logits of their positions (vLLM's rule)."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output; pending ones read as PENDING_TOKEN."""
        if self.num_pending and end > self.num_known_tokens:
            known = self.num_known_tokens
            return self.token_ids(min(start, known), known) + [PENDING_TOKEN] * (end - max(start, known))
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:  # decode steps: no copy of the whole sequence per step
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose K/V this sequence should reach now: all, or, while completions wait
        to be forked from it, all but the last (each fork computes that one itself)."""
        return self.num_tokens - 1 if self.pending_forks else self.num_tokens

