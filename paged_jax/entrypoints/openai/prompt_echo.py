"""The prompt's part of a response: completions' `echo` and vLLM's `prompt_logprobs`.

With `echo`, a completion choice starts with the prompt: its text first, and with
`logprobs: k` its tokens first in `logprobs`, the first one with a null logprob (nothing
predicts it) and the others with the engine's prompt logprobs. Each position's
`top_logprobs` holds the prompt token and the k most likely tokens there, as vLLM sends
them (the token first): lm-evaluation-harness decides whether a continuation is greedy by
comparing the token's logprob with the best one in that dict. `prompt_logprobs` (vLLM's
extension) returns the engine's positions as they are, keyed by token id.
"""

from __future__ import annotations

from paged_jax.core.outputs import RequestOutput
from paged_jax.entrypoints.openai import protocol as p


def prompt_logprobs_body(out: RequestOutput) -> list[dict[str, p.PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of one request: None first, then {token id: Logprob}."""
    if out.prompt_logprobs is None:
        return None
    return [None if position is None else
            {str(t): p.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for t, lp in position.items()} for position in out.prompt_logprobs]


def echo_logprobs(token_text, out: RequestOutput, k: int) -> p.CompletionLogprobs:
    """The prompt's tokens as completions' logprobs (offsets from 0)."""
    ids = out.prompt_token_ids
    positions = out.prompt_logprobs or [None] * len(ids)
    tokens, offsets, offset = [], [], 0
    for t in ids:
        tokens.append(token_text(t))
        offsets.append(offset)
        offset += len(tokens[-1])
    token_logprobs = [None if pos is None else pos[t].logprob for t, pos in zip(ids, positions)]
    tops = None
    if k >= 1:  # the prompt token and the k best: the first k + 1 entries (the token is first)
        tops = [None if pos is None else {token_text(t): lp.logprob for t, lp in list(pos.items())[:k + 1]}
                for pos in positions]
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets)


def join_logprobs(first: p.CompletionLogprobs, then: p.CompletionLogprobs | None) -> p.CompletionLogprobs:
    """The prompt's logprobs followed by the completion's (whose offsets start after it)."""
    if then is None:
        return first
    tops = None if first.top_logprobs is None or then.top_logprobs is None else first.top_logprobs + then.top_logprobs
    return p.CompletionLogprobs(tokens=first.tokens + then.tokens,
                                token_logprobs=first.token_logprobs + then.token_logprobs,
                                top_logprobs=tops, text_offset=first.text_offset + then.text_offset)


def text_length(token_text, token_ids) -> int:
    return sum(len(token_text(t)) for t in token_ids)
