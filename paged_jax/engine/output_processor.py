"""OutputProcessor: the engine core's token-level outputs -> RequestOutputs with text.

Per completion it accumulates the core's new tokens and logprobs, detokenizes only the
new tokens (detokenizer.py) and looks for stop strings in the new text (stop_strings.py).
Each RequestOutput's text is what may be shown so far: while a completion runs, a tail
that could still turn into a stop string is held back, so successive outputs' texts are
prefixes of one another and of the final text, and a stream can send the difference.
A stop string found in a running completion ends it: `process` names it among `stopped`
for the caller to finish in the core (freeing its blocks) before the next step.

What an output carries is the request's `SamplingParams.output_kind`: CUMULATIVE (the
whole completion so far, vLLM's default), DELTA (only what is new since the request's
previous output: the newly shown text, the new token ids and their logprobs; a stream
concatenates them) or FINAL_ONLY (one output, when the request finished). Every step's
work is O(new tokens) but for what a CUMULATIVE output is by definition (copies of the
completion's lists and text, made only when an output is built): the text is taken from
the stop-string checker piecewise, never re-joined, and a DELTA output copies only the
new items.
"""

from __future__ import annotations

import dataclasses

from paged_jax.core.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from paged_jax.engine.detokenizer import Detokenizer, IncrementalDetokenizer
from paged_jax.engine.stop_strings import StopStringChecker


@dataclasses.dataclass
class _Completion:
    index: int
    text: StopStringChecker
    detok: IncrementalDetokenizer | None  # None: no tokenizer, no text
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float | None = None
    finish_time: float | None = None
    shown_text: str = ""  # CUMULATIVE: the text its outputs have shown so far (extended by each output)
    num_sent: int = 0  # DELTA: tokens (and their logprobs) that earlier outputs carried


@dataclasses.dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    logprobs: int | None  # SamplingParams.logprobs (beam search: None)
    stops: tuple[str, ...] | None
    completions: list[_Completion]  # sampling: all n from the start; beam search: filled once done
    arrival_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs_k: int | None = None  # SamplingParams.prompt_logprobs
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs so far ([None] + one dict per position)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # beam search: its final beams, whole
    prompt_logprobs_sent: bool = False  # DELTA: an output carried the prompt logprobs already

    @property
    def finished(self) -> bool:
        return bool(self.completions) and all(c.finish_reason is not None for c in self.completions)


@dataclasses.dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stopped: list[tuple[str, int, str]]  # (request id, completion index, stop string): finish these in the core


class OutputProcessor:
    def __init__(self, tokenizer, *, final_outputs_only: bool = False):
        """`final_outputs_only`: return finished requests only, whatever their output kind
        (running ones are still detokenized and checked for stop strings, but no output is
        built for them): what `LLM.generate` and the benchmarks want."""
        self._detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self._final_outputs_only = final_outputs_only
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> None:
        sampling = isinstance(params, SamplingParams)
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params.logprobs if sampling else None,
                              params.stop if sampling else None, [])
        if sampling:
            state.output_kind = RequestOutputKind.FINAL_ONLY if self._final_outputs_only else params.output_kind
            state.completions = [self._new_completion(i, state.stops) for i in range(params.n)]
            if params.prompt_logprobs is not None:
                state.prompt_logprobs_k, state.prompt_logprobs = params.prompt_logprobs, [None]
        self._requests[request_id] = state

    def abort_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _new_completion(self, index: int, stops) -> _Completion:
        detok = self._detokenizer.stream() if self._detokenizer is not None else None
        return _Completion(index, StopStringChecker(stops), detok)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        outputs, stopped = [], []
        for out in core_outputs:
            state = self._requests.get(out.request_id)
            if state is None:  # aborted meanwhile
                continue
            state.arrival_time, state.first_token_time = out.arrival_time, out.first_token_time
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._prompt_position(*p) for p in out.new_prompt_logprobs)
            if not state.completions:  # beam search: its final beams, whole
                state.completions = [self._new_completion(d.index, None) for d in out.completions]
            moved = False
            for delta in out.completions:
                completion = state.completions[delta.index]
                if completion.finish_reason is not None:  # ended by a stop string already
                    continue
                moved = True
                stop = self._update(state, completion, delta, out.timestamp)
                if stop is not None and delta.finish_reason is None:
                    stopped.append((out.request_id, delta.index, stop))
            finished = state.finished
            kind = state.output_kind
            if finished or (kind is RequestOutputKind.CUMULATIVE and not self._final_outputs_only) or (
                    kind is RequestOutputKind.DELTA and moved):
                outputs.append(self._output(state))
            if finished:
                del self._requests[out.request_id]
        return ProcessedOutputs(outputs, stopped)

    def _prompt_position(self, token: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        """vLLM's shape of one prompt position: the prompt's token first, then the top-k."""
        position = {token: Logprob(logprob, rank, self._decode_token(token))}
        for j, (top_id, top_logprob) in enumerate(top):
            if top_id not in position:
                position[top_id] = Logprob(top_logprob, j + 1, self._decode_token(top_id))
        return position

    def _decode_token(self, token: int) -> str | None:
        """A token's own text, special tokens included (they are part of the prompt)."""
        return self._detokenizer.tokenizer.decode([token]) if self._detokenizer is not None else None

    @staticmethod
    def _update(state: _RequestState, c: _Completion, delta: CompletionDelta, now: float) -> str | None:
        c.token_ids += delta.new_token_ids
        if state.logprobs is not None:
            c.logprobs += delta.new_logprobs
            if delta.new_top_logprobs:
                c.top_logprobs += delta.new_top_logprobs
        c.cumulative_logprob, c.score = delta.cumulative_logprob, delta.score
        final = delta.finish_reason is not None
        new_text = ""
        if c.detok is not None:
            new_text = c.detok.push(delta.new_token_ids) + (c.detok.flush() if final else "")
        stop = c.text.append(new_text, final)
        if stop is not None:  # a stop string wins over a stop token or length in the same step
            c.finish_reason, c.stop_reason, c.finish_time = "stop", stop, now
        elif final:
            c.finish_reason, c.stop_reason, c.finish_time = delta.finish_reason, delta.stop_reason, now
        return stop

    @staticmethod
    def _output(state: _RequestState) -> RequestOutput:
        asked = state.logprobs is not None
        delta = state.output_kind is RequestOutputKind.DELTA
        completions = [OutputProcessor._completion_output(c, asked, state.logprobs, delta) for c in state.completions]
        finished = state.finished
        metrics = {"arrival_time": state.arrival_time, "first_token_time": state.first_token_time,
                   "finish_time": max(c.finish_time for c in state.completions) if finished else None}
        # prompt logprobs are complete with the request's first output (they arrive before its first
        # token); a DELTA stream carries them in that output only, as vLLM does
        prompt_logprobs = state.prompt_logprobs
        if delta:
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished, metrics,
                             num_cached_tokens=state.num_cached_tokens, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _completion_output(c: _Completion, asked: bool, top_k: int | None, delta: bool) -> CompletionOutput:
        """DELTA: the text shown and the tokens sampled since the previous output (slices of
        what is new only); otherwise everything so far (copies: the caller may keep them
        while the completion grows)."""
        new_text = c.text.take()
        if delta:
            start, c.num_sent = c.num_sent, len(c.token_ids)
            text, token_ids = new_text, c.token_ids[start:]
            logprobs = c.logprobs[start:] if asked else None
            top_logprobs = c.top_logprobs[start:] if asked and top_k else None
        else:
            c.shown_text += new_text
            text, token_ids = c.shown_text, list(c.token_ids)
            logprobs = list(c.logprobs) if asked else None
            top_logprobs = list(c.top_logprobs) if asked and top_k else None
        return CompletionOutput(index=c.index, text=text, token_ids=token_ids, finish_reason=c.finish_reason,
                                logprobs=logprobs, stop_reason=c.stop_reason,
                                cumulative_logprob=c.cumulative_logprob if asked or c.score is not None else None,
                                top_logprobs=top_logprobs, score=c.score)
