"""Engine outputs -> OpenAI response bodies and streaming chunks.

An HTTP request with P prompts and n completions each is P engine requests; OpenAI's
choice index is `prompt_index * n + completion.index`. Streams take the engine's DELTA
outputs (SamplingParams.output_kind): each carries the text newly shown (the engine holds
back what may still change, so nothing sent is ever taken back), the new token ids and
their logprobs, which a chunk sends as they are: a step's work is what it added, however
long the completion already is. A token's `text_offset` is
where its text starts among the completion's tokens (the sum of the earlier tokens' text
lengths), the same in a stream as in a whole response: it does not depend on how much
text has been shown yet, which lags while a possible stop string is held back. Top
alternatives come from the engine's `top_logprobs` where its outputs have them; an engine
without them gives the sampled token's logprob only, and then `top_logprobs` (asked for
with 1) lists just the sampled token.
"""

from __future__ import annotations

import time

from paged_jax.core.outputs import CompletionOutput, RequestOutput
from paged_jax.entrypoints.openai import protocol as p
from paged_jax.entrypoints.openai.prompt_echo import echo_logprobs, join_logprobs, prompt_logprobs_body, text_length


# Line breaks to Python's str.splitlines (so to httpx's and requests' iter_lines) but not
# to SSE, which ends a line at \r or \n only. JSON leaves them raw inside strings (a
# generated token can be one), and a line-reading client would cut the event there; JSON
# may spell them as escapes. Control characters (\x0b, \x1c, ...) JSON escapes already.
_SPLITLINES_ONLY = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(json_text: str) -> str:
    """One server-sent event of a JSON body, readable line by line by any client."""
    return f"data: {json_text.translate(_SPLITLINES_ONLY)}\n\n"


def usage(outputs: list[RequestOutput], *, generated: bool = True) -> p.UsageInfo:
    """Token counts; `generated=False` (echo with max_tokens 0): the engine's one token is not returned."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _TokenText:
    """Token id -> its text, cached (the vocabulary is small; decoding is per token)."""

    def __init__(self, tokenizer):
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) if self._tokenizer is not None else f"<{token_id}>"
            self._cache[token_id] = text
        return text


def _alternatives(token_text, token_ids, logprobs, tops, k: int) -> list[list[tuple[str, float]]]:
    """Per position, the k best (text, logprob): from the engine's top_logprobs where it
    gives them, else (k <= 1, checked on input) just the sampled token."""
    if k < 1:
        return [[] for _ in token_ids]
    if tops is not None:
        return [[(token_text(t), lp) for t, lp in top[:k]] for top in tops]
    return [[(token_text(t), lp)] for t, lp in zip(token_ids, logprobs)]


def completion_logprobs(token_text, token_ids, logprobs, tops, k: int, offset: int = 0) -> p.CompletionLogprobs:
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    alternatives = _alternatives(token_text, token_ids, logprobs, tops, k)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs),
                                top_logprobs=[dict(a) for a in alternatives] if k >= 1 else None,
                                text_offset=offsets)


def chat_logprobs(token_text, token_ids, logprobs, tops, k: int) -> p.ChatLogprobs:
    def entry(text, lp):
        return p.TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

    alternatives = _alternatives(token_text, token_ids, logprobs, tops, k)
    return p.ChatLogprobs(content=[
        p.ChatTokenLogprob(**entry(token_text(t), lp).model_dump(), top_logprobs=[entry(*a) for a in alts])
        for t, lp, alts in zip(token_ids, logprobs, alternatives)])


class ResponseBuilder:
    """Builds one HTTP request's response, whole or as chunks."""

    def __init__(self, *, chat: bool, request_id: str, model: str, engine_ids: list[str], n: int, tokenizer,
                 logprobs: int | None, return_token_ids: bool = False, echo: bool = False, echo_only: bool = False,
                 prompt_texts: list[str | None] | None = None, prompt_logprobs: bool = False):
        """Streams: `chunks` takes DELTA outputs (what is new since the request's previous
        output); `response` takes whole (FINAL_ONLY or CUMULATIVE) final outputs. `echo`: each choice starts with its prompt's text
        (`prompt_texts[prompt index]`, or its ids decoded where None; chat: the text to put
        before the reply, the same for every choice), and completions' logprobs with the
        prompt's; `echo_only` (max_tokens 0): the prompt alone, the engine's one token left
        out. `prompt_logprobs`: add vLLM's `prompt_logprobs` field."""
        self.chat, self.request_id, self.model, self.n = chat, request_id, model, n
        self.created = int(time.time())
        self._prompt_index = {rid: i for i, rid in enumerate(engine_ids)}
        self._token_text = _TokenText(tokenizer)
        self.logprobs = logprobs  # None: off; k >= 0: the sampled token's logprob and k alternatives
        self.return_token_ids = return_token_ids
        self._num_sent_tokens: dict[int, int] = {}  # per choice: tokens its chunks carried
        self._token_text_len: dict[int, int] = {}  # per choice: text length of its tokens sent so far
        self._finished: set[int] = set()
        self.echo, self.echo_only, self.prompt_logprobs = echo, echo_only, prompt_logprobs
        self._prompt_texts = prompt_texts or [None] * len(engine_ids)
        self._tokenizer = tokenizer
        self._echo_sent: set[int] = set()  # streams: choices whose prompt part (or chat echo) went out

    def index(self, request_id: str, completion: CompletionOutput) -> int:
        return self._prompt_index[request_id] * self.n + completion.index

    def _logprobs(self, completion: CompletionOutput, start: int, offset: int = 0):
        if self.logprobs is None or completion.logprobs is None:
            return None
        ids, lps = completion.token_ids[start:], completion.logprobs[start:]
        tops = getattr(completion, "top_logprobs", None)
        tops = tops[start:] if tops is not None and len(tops) == len(completion.token_ids) else None
        if self.chat:
            return chat_logprobs(self._token_text, ids, lps, tops, self.logprobs)
        return completion_logprobs(self._token_text, ids, lps, tops, self.logprobs, offset)

    def _ids(self, completion: CompletionOutput, start: int) -> list[int] | None:
        if not self.return_token_ids:
            return None
        return [] if self.echo_only else list(completion.token_ids[start:])

    def _prompt_text(self, out: RequestOutput) -> str:
        text = self._prompt_texts[self._prompt_index[out.request_id]]
        if text is None:
            text = self._tokenizer.decode(out.prompt_token_ids) if self._tokenizer is not None else ""
        return text

    def _completion_choice(self, out: RequestOutput, c: CompletionOutput, i: int, *, start: int, text: str,
                           offset: int, first: bool) -> p.CompletionChoice:
        """Completion tokens from `start` (their text `text`, logprob offsets from `offset`);
        a choice's `first` part (a whole response, or a stream's first chunk) also carries
        the prompt: with echo its text and logprobs before the completion's, with
        prompt_logprobs vLLM's field."""
        skip = self.echo_only or 0 < start >= len(c.token_ids)  # echo_only, or a stream's prompt-only chunk
        lps = None if skip else self._logprobs(c, start, offset)
        extra = {}
        if first and self.echo:
            if self.logprobs is not None:
                lps = join_logprobs(echo_logprobs(self._token_text, out, self.logprobs), lps)
            text = self._prompt_text(out) + text
            if self.return_token_ids:
                extra["prompt_token_ids"] = list(out.prompt_token_ids)
        if first and self.prompt_logprobs:
            extra["prompt_logprobs"] = prompt_logprobs_body(out)
        return p.CompletionChoice(index=i, text=text, logprobs=lps,
                                  finish_reason="length" if self.echo_only else c.finish_reason,
                                  token_ids=self._ids(c, start), **extra)

    def _echo_offset(self, out: RequestOutput) -> int:
        """Where the completion's token offsets start: after the prompt's, with echo."""
        return text_length(self._token_text, out.prompt_token_ids) if self.echo else 0

    # ---- whole responses ---------------------------------------------------------------
    def response(self, outputs: list[RequestOutput]):
        triples = sorted(((self.index(o.request_id, c), o, c) for o in outputs for c in o.outputs),
                         key=lambda x: x[0])
        if self.chat:
            prefix = (self._prompt_texts[0] or "") if self.echo else ""
            choices = [p.ChatChoice(index=i, message=p.AssistantMessage(content=prefix + c.text),
                                    logprobs=self._logprobs(c, 0), finish_reason=c.finish_reason,
                                    token_ids=self._ids(c, 0)) for i, _, c in triples]
            extra = {"prompt_logprobs": prompt_logprobs_body(outputs[0])} if self.prompt_logprobs else {}
            return p.ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                            choices=choices, usage=usage(outputs), **extra)
        choices = [self._completion_choice(o, c, i, start=0, text="" if self.echo_only else c.text,
                                           offset=self._echo_offset(o), first=True) for i, o, c in triples]
        return p.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                    usage=usage(outputs, generated=not self.echo_only))

    # ---- streaming -------------------------------------------------------------------
    def _chunk(self, choices, usage_info=None) -> str:
        if self.chat:
            body = p.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                         choices=choices, usage=usage_info)
        else:
            body = p.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=choices, usage=usage_info)
        return sse_event(body.model_dump_json())

    def first_chunks(self, num_choices: int) -> list[str]:
        """Chat streams open every choice with the assistant role, as OpenAI does."""
        if not self.chat:
            return []
        return [self._chunk([p.ChatChunkChoice(index=i, delta=p.ChatDelta(role="assistant", content=""))])
                for i in range(num_choices)]

    def chunks(self, out: RequestOutput) -> list[str]:
        """Chunks for what a DELTA output adds to each completion (none where a step added
        only held-back text and nothing else)."""
        result = []
        for c in out.outputs:
            i = self.index(out.request_id, c)
            if i in self._finished:
                continue
            if not self.chat and (self.echo or self.prompt_logprobs) and i not in self._echo_sent:
                self._echo_sent.add(i)
                result.append(self._chunk([self._first_completion_chunk(out, c, i)]))
                if self.echo_only:
                    continue
            text = c.text
            new_tokens = len(c.token_ids) > 0
            offset = self._token_text_len[i] if i in self._token_text_len else self._echo_offset(out)
            lps = self._logprobs(c, 0, offset) if new_tokens else None
            ids = self._ids(c, 0) if new_tokens else None
            self._num_sent_tokens[i] = self._num_sent_tokens.get(i, 0) + len(c.token_ids)
            if lps is not None and not self.chat:
                self._token_text_len[i] = offset + sum(len(self._token_text(t)) for t in c.token_ids)
            if self.chat and self.echo and i not in self._echo_sent:  # the reply starts with the echoed text
                self._echo_sent.add(i)
                text = (self._prompt_texts[0] or "") + text
            if not (text or c.finished or lps is not None or ids is not None):
                continue
            if c.finished:
                self._finished.add(i)
            if self.chat:
                choice = p.ChatChunkChoice(index=i, delta=p.ChatDelta(content=text or None), logprobs=lps,
                                           finish_reason=c.finish_reason, token_ids=ids)
            else:
                choice = p.CompletionChoice(index=i, text=text, logprobs=lps, finish_reason=c.finish_reason,
                                            token_ids=ids)
            result.append(self._chunk([choice]))
        return result

    def _first_completion_chunk(self, out: RequestOutput, c: CompletionOutput, i: int) -> p.CompletionChoice:
        """A completion stream's first chunk of a choice with echo or prompt_logprobs: the
        prompt part alone (echo_only: the whole choice, finished)."""
        choice = self._completion_choice(out, c, i, start=len(c.token_ids), text="", offset=0, first=True)
        if self.echo_only:
            self._finished.add(i)
            return choice
        return choice.model_copy(update={"finish_reason": None, "token_ids": [] if self.return_token_ids else None})

    def usage_chunk(self, outputs: list[RequestOutput]) -> str:
        """The stream's usage: prompt tokens from `outputs` (the requests' final DELTA
        outputs), completion tokens as the chunks carried them."""
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(self._num_sent_tokens.values()) if not self.echo_only else 0
        return self._chunk([], p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                                           total_tokens=prompt + completion))
