"""What EngineCore hands the front end each step: token ids, logprobs and finish status.

Only what changed this step travels (the new tokens of each completion that sampled),
so a step's output costs the same at output token 10 and at token 10,000; the front end
(output_processor.py) accumulates them and adds the text. No text here: the core has no
tokenizer, and stop strings are the front end's to find.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionDelta:
    """One completion's progress in one step (a beam search's final beams: all their tokens at once)."""

    index: int  # which of the request's completions (sampling: 0..n-1; beams: rank, best first)
    new_token_ids: list[int]
    # the sampled tokens' logprobs, one per new token (beams: empty); None when the request asked for no
    # logprobs (the runner then computes none: what it returns would depend on the batch's other rows)
    new_logprobs: list[float] | None
    new_top_logprobs: list[list[tuple[int, float]]] | None  # per new token, when the request asked for them
    cumulative_logprob: float | None  # over all the completion's tokens so far; None as new_logprobs
    finish_reason: str | None  # "stop" (a stop token), "length", "error" (a matcher failed), None: running
    stop_reason: int | None = None  # the stop token that ended it
    score: float | None = None  # beam search: the hypothesis' ranking score


@dataclasses.dataclass
class EngineCoreOutput:
    """One request's step: the completions that moved (beam search: its beams, once done)."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool  # the core's view: every completion ended (by token or length) or the search is done
    timestamp: float  # the engine clock when the step's tokens were sampled
    arrival_time: float
    first_token_time: float | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache (the first sequence's)
    # prompt positions scored since the last output, in order from prompt token 1:
    # (prompt token, its logprob, its rank, the top-k (token, logprob)); None when none
    new_prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None
