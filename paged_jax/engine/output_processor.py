"""OutputProcessor: the engine core's token-level outputs -> RequestOutputs with text.

Per completion it accumulates the core's new tokens and logprobs, detokenizes only the
new tokens (detokenizer.py) and looks for stop strings in the new text (stop_strings.py).
Each RequestOutput's text is what may be shown so far: while a completion runs, a tail
that could still turn into a stop string is held back, so successive outputs' texts are
prefixes of one another and of the final text, and a stream can send the difference.
A stop string found in a running completion ends it: `process` names it among `stopped`
for the caller to finish in the core (freeing its blocks) before the next step.
"""

from __future__ import annotations

import dataclasses

from paged_jax.core.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.core.sampling_params import SamplingParams
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

    @property
    def finished(self) -> bool:
        return bool(self.completions) and all(c.finish_reason is not None for c in self.completions)


@dataclasses.dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stopped: list[tuple[str, int, str]]  # (request id, completion index, stop string): finish these in the core


class OutputProcessor:
    def __init__(self, tokenizer, *, final_outputs_only: bool = False):
        """`final_outputs_only`: return finished requests only (running ones are still
        detokenized and checked for stop strings, but no output is built for them)."""
        self._detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self._final_outputs_only = final_outputs_only
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> None:
        sampling = isinstance(params, SamplingParams)
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params.logprobs if sampling else None,
                              params.stop if sampling else None, [])
        if sampling:
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
            for delta in out.completions:
                completion = state.completions[delta.index]
                if completion.finish_reason is not None:  # ended by a stop string already
                    continue
                stop = self._update(state, completion, delta, out.timestamp)
                if stop is not None and delta.finish_reason is None:
                    stopped.append((out.request_id, delta.index, stop))
            finished = state.finished
            if finished or not self._final_outputs_only:
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
        completions = [CompletionOutput(
            index=c.index, text=c.text.shown, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
            logprobs=list(c.logprobs) if asked else None, stop_reason=c.stop_reason,
            cumulative_logprob=c.cumulative_logprob if asked or c.score is not None else None,
            top_logprobs=list(c.top_logprobs) if asked and state.logprobs else None, score=c.score)
            for c in state.completions]
        finished = state.finished
        metrics = {"arrival_time": state.arrival_time, "first_token_time": state.first_token_time,
                   "finish_time": max(c.finish_time for c in state.completions) if finished else None}
        # prompt logprobs are complete with the request's first output (they arrive before its first token)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished, metrics,
                             num_cached_tokens=state.num_cached_tokens, prompt_logprobs=state.prompt_logprobs)
