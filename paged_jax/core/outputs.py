"""What generation returns, with vLLM's names so users' code carries over."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's entry in a prompt-logprobs position (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token at that position
    decoded_token: str | None = None


# One prompt position: the prompt's own token and the k most likely tokens there (None for
# the first prompt token, which nothing predicts).
PromptLogprobs = list["dict[int, Logprob] | None"]


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" (an internal failure), or None while running
    logprobs: list[float] | None = None  # logprob of each chosen token, when asked for
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    # sum of the chosen tokens' logprobs (None unless logprobs were asked for, as in vLLM)
    cumulative_logprob: float | None = None
    # Per position, the `SamplingParams.logprobs` most likely (token id, logprob), best first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append the same completion's next DELTA output (its new text, tokens and logprobs);
        the status (finish and stop reasons, cumulative logprob, score) is the later one's."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs.extend(later.logprobs)
        if self.top_logprobs is not None and later.top_logprobs is not None:
            self.top_logprobs.extend(later.top_logprobs)
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.cumulative_logprob, self.score = later.cumulative_logprob, later.score


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict | None = None  # arrival / first-token / finish times (seconds, time.monotonic)
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (vLLM's field)
    # One entry per prompt token when SamplingParams.prompt_logprobs was set (else None)
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, later: RequestOutput) -> None:
        """Merge the request's next DELTA output into this one, so that one output holds what
        both carried (vLLM's RequestOutput.add with aggregate=True): a stream whose reader
        fell behind keeps one pending output per request, not one per step. Both must be
        DELTA outputs of the same request; `later` is not used afterwards."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge an output of {later.request_id!r} into one of {self.request_id!r}")
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index in mine:
                mine[c.index].add(c)
            else:
                self.outputs.append(c)
        self.finished, self.metrics, self.num_cached_tokens = later.finished, later.metrics, later.num_cached_tokens
        if self.prompt_logprobs is None:  # a DELTA stream carries them once, in its first output
            self.prompt_logprobs = later.prompt_logprobs


@dataclasses.dataclass
class BeamSearchSequence:
    """One returned beam: generated tokens only (an EOS that ended it included)."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float  # the ranking key: cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (ended with EOS) or "length"


@dataclasses.dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first
