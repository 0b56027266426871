"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

For servers and research loops: `add_request`, `step`, `abort_request`,
`has_unfinished_requests`, `stats`, `reset_prefix_cache`. It sizes the KV cache, owns
the scheduler, block manager and runner, and turns sampled tokens into text and finish
reasons. A request with `SamplingParams(n > 1)` starts as one sequence whose other
completions are forked from it after the prompt (sharing its blocks); a request with
`BeamSearchParams` keeps its beams as sequences that fork and finish as the host-side
beam search (`beam_search.py`) picks the next beams each step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence as Seq

import jax
import numpy as np

from paged_jax.attention.backend import auto_attention_backend
from paged_jax.baselines.contiguous_allocator import ContiguousAllocator
from paged_jax.config.engine_config import DEFAULT_KV_CACHE_MEMORY_BYTES, DEFAULT_MAX_MODEL_LEN, EngineConfig
from paged_jax.core.beam_search import BeamSearchParams, BeamSearchState, num_candidates
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.outputs import CompletionOutput, RequestOutput
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Sequence, SequenceStatus
from paged_jax.engine.stats import EngineStats
from paged_jax.loading import LoadedModel, load_model
from paged_jax.worker.kv_cache import bytes_per_block
from paged_jax.worker.model_runner import ModelRunner

_GOLDEN = 0x9E3779B1  # spreads (seed, index) pairs over 32-bit seeds


def completion_seed(request_seed: int, index: int) -> int:
    """The seed of completion `index` of a request: its stream depends on nothing else."""
    return (request_seed + index * _GOLDEN) % 2**32


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    seqs: list[Sequence]  # sampling: the n completions; beam search: the live beams, in beam order
    stop_ids: frozenset[int]
    arrival_time: float
    beam: BeamSearchState | None = None
    first_token_time: float | None = None  # beam search: kept here, as beams come and go
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done or all(s.status.finished for s in self.seqs)
        return all(s.status.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model: str | LoadedModel = "smollm2-135m", config: EngineConfig | None = None, *,
                 runner_factory=ModelRunner, clock=time.monotonic, final_outputs_only: bool = False):
        """`runner_factory` (ModelRunner's signature) and `clock` (seconds) are injection
        points: experiments/simulate.py passes a model-free runner and a virtual clock, so
        a simulation runs this engine's own scheduling and bookkeeping, not a copy.
        `final_outputs_only`: `step` returns finished requests only (no per-step output of
        running ones, whose token lists it would copy every step)."""
        config = config or EngineConfig()
        mesh = None
        if config.tensor_parallel_size > 1:  # shard over a device mesh (paged_jax/distributed/tensor_parallel.py)
            from paged_jax.distributed import tensor_parallel
            mesh = tensor_parallel.make_mesh(config.tensor_parallel_size)
            loaded = tensor_parallel.load_sharded(model, config.dtype, mesh)
        else:
            loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=config.dtype)
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        self.config = _resolve(config, loaded)
        block_bytes = bytes_per_block(self.model_config, self.config.block_size, self.config.dtype)
        num_host_blocks = self.config.swap_space_bytes // block_bytes if self.config.preemption_mode == "swap" else 0
        if self.config.kv_allocator == "paged":
            self.block_manager = BlockManager(self.config.num_blocks, self.config.block_size,
                                              num_host_blocks=num_host_blocks, watermark=self.config.watermark,
                                              enable_prefix_caching=self.config.enable_prefix_caching)
        else:  # a contiguous baseline behind the same interface (validated: recompute, no prefix caching)
            self.block_manager = ContiguousAllocator(self.config.num_blocks, self.config.block_size,
                                                     policy=self.config.kv_allocator,
                                                     max_model_len=self.config.max_model_len)
        _check_capacity(self.config, self.block_manager)
        self.scheduler = Scheduler(self.config, self.block_manager)
        params = loaded.params
        self.runner = runner_factory(self.model_config, params, self.config, num_blocks=self.config.num_blocks,
                                     num_host_blocks=num_host_blocks, **({"mesh": mesh} if mesh else {}))
        self._clock = clock
        self._final_outputs_only = final_outputs_only
        self.runner.warm_up()
        self.stats_tracker = EngineStats(self.block_manager, self.scheduler, self.runner)
        self._requests: dict[str, _Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._rng = np.random.default_rng(self.config.seed)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | BeamSearchParams | None = None, *,
                    arrival_time: float | None = None) -> None:
        """Queue a request. `prompt` is text, a list of token ids, or {"prompt_token_ids": [...]};
        `params` a SamplingParams or, for beam search, a BeamSearchParams. Raises ValueError
        (and queues nothing) on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.config.kv_allocator != "paged" and (isinstance(params, BeamSearchParams) or params.n > 1):
            raise ValueError(f"kv_allocator={self.config.kv_allocator!r} is a baseline without block sharing: "
                             "it serves n=1 sampling only (no n > 1, no beam search)")
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        now = self._clock() if arrival_time is None else arrival_time
        if isinstance(params, BeamSearchParams):
            request = self._beam_request(request_id, text, token_ids, params, now)
        else:
            request = self._sampling_request(request_id, text, token_ids, params, now)
        self._requests[request_id] = request
        for seq in request.seqs:
            self._seqs[seq.seq_id] = seq
        self.scheduler.add(request.seqs[0])

    def _sampling_request(self, request_id, text, token_ids, params: SamplingParams, now) -> _Request:
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds the engine's max_logprobs="
                             f"{self.config.max_logprobs}")
        self._check_group_fits(params.n, len(token_ids) + params.max_tokens)
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        seqs = [self._new_seq(request_id, index, token_ids, params, now, completion_seed(base_seed, index))
                for index in range(params.n)]
        seqs[0].pending_forks = seqs[1:]  # forked once the prompt (but its last token) is computed
        return _Request(request_id, text, list(token_ids), params, seqs,
                        params.all_stop_token_ids(self.model_config.eos_token_ids), now)

    def _beam_request(self, request_id, text, token_ids, params: BeamSearchParams, now) -> _Request:
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        needed = num_candidates(params.beam_width, len(eos))
        if needed > self.runner.num_top_logprobs:
            raise ValueError(f"beam_width={params.beam_width} needs the top {needed} tokens per beam; the engine "
                             f"returns {self.runner.num_top_logprobs} (raise max_logprobs)")
        self._check_group_fits(params.beam_width, len(token_ids) + params.max_tokens)
        max_new = min(params.max_tokens, self.config.max_model_len - len(token_ids))
        greedy = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)  # the sampled token is unused
        seq = self._new_seq(request_id, 0, token_ids, greedy, now, seed=0)
        return _Request(request_id, text, list(token_ids), params, [seq], eos, now,
                        beam=BeamSearchState(params, eos, max_new))

    def _new_seq(self, request_id, index, token_ids, params, now, seed) -> Sequence:
        seq = Sequence(seq_id=self._next_seq_id, request_id=request_id, index=index,
                       prompt_token_ids=list(token_ids), sampling_params=params, arrival_time=now, seed=seed)
        self._next_seq_id += 1
        return seq

    def _check_group_fits(self, num_seqs: int, num_tokens: int) -> None:
        """A request's sequences must fit the cache together with nothing shared, or it
        could never finish (its own sequences would preempt each other forever)."""
        bm = self.block_manager
        needed = num_seqs * bm.num_blocks_needed(min(num_tokens, self.config.max_model_len))
        if needed > bm.num_usable_blocks - bm.watermark_blocks:
            raise ValueError(f"{num_seqs} sequences of up to {min(num_tokens, self.config.max_model_len)} tokens "
                             f"need {needed} KV blocks; the cache has {bm.num_usable_blocks - bm.watermark_blocks}"
                             " (lower n / beam_width / max_tokens, or raise num_blocks)")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks at once (unknown or finished ids: no-op)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.status.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._seqs.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (e.g. between benchmark runs); returns how many."""
        return self.block_manager.reset_prefix_cache()

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one jitted step, and return the requests that moved or finished."""
        host_start = time.perf_counter()
        output = self.scheduler.schedule()
        self.stats_tracker.record_schedule(output)
        if output.is_empty:
            if self.scheduler.has_unfinished():  # a step that schedules nothing changes nothing
                raise RuntimeError(f"the scheduler cannot make progress: {self.stats()}")
            return []
        device_before = self.runner.device_seconds
        result = self.runner.execute(output, self._seqs)
        now = self._clock()
        touched = {}
        for row, seq in self.scheduler.update(output, self._seqs):
            request = touched[seq.request_id] = self._requests[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
            if request.beam is not None:
                request.first_token_time = request.first_token_time or now
                seq.beam_candidates = list(zip(result.top_ids[row].tolist(), result.top_logprobs[row].tolist()))
                continue
            seq.output_token_ids.append(int(result.tokens[row]))
            seq.output_logprobs.append(float(result.logprobs[row]))
            seq.cumulative_logprob += float(result.logprobs[row])
            if request.params.logprobs:
                top = zip(result.top_ids[row].tolist(), result.top_logprobs[row].tolist())
                seq.output_top_logprobs.append(list(top)[: request.params.logprobs])
            self._check_stop(seq, now)
        results = []
        for request in touched.values():
            if request.beam is not None:
                if all(s.beam_candidates is not None for s in request.seqs):
                    self._advance_beams(request, now)
                if not request.finished:
                    continue  # beams are reported once the search is done
            finished = request.finished
            if finished or not self._final_outputs_only:
                results.append(self._output(request))
            if finished:
                del self._requests[request.request_id]
                for seq in request.seqs:
                    self._seqs.pop(seq.seq_id, None)
        step_seconds = time.perf_counter() - host_start
        self.stats_tracker.record_step(output, step_seconds, self.runner.device_seconds - device_before)
        return results

    def _advance_beams(self, request: _Request, now: float) -> None:
        """One beam-search step: keep, fork or drop beams as the search picked them.

        A beam kept once continues as the same sequence; kept k times, it is forked k-1
        times first (the forks share all its blocks; copy-on-write splits the last one);
        a beam not kept finishes and its blocks are freed at once, so beams that agree on
        a prefix keep sharing its blocks.
        """
        beams = request.seqs
        picks = request.beam.step([s.beam_candidates for s in beams])
        for seq in beams:
            seq.beam_candidates = None
        kept: dict[int, list[int]] = {}  # beam index -> tokens of its continuations
        for parent, token in picks:
            kept.setdefault(parent, []).append(token)
        new_beams: dict[int, list[Sequence]] = {}
        for parent, tokens in kept.items():
            seq = beams[parent]
            forks = []
            for _ in tokens[1:]:
                child = self._new_seq(request.request_id, 0, seq.prompt_token_ids, seq.sampling_params,
                                      request.arrival_time, seed=0)
                child.output_token_ids = list(seq.output_token_ids)
                child.first_token_time = seq.first_token_time
                self.scheduler.fork(seq, child)
                self._seqs[child.seq_id] = child
                forks.append(child)
            new_beams[parent] = [seq] + forks
            for s, token in zip(new_beams[parent], tokens):
                s.output_token_ids.append(token)
        for index, seq in enumerate(beams):
            if index not in kept:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._seqs.pop(seq.seq_id, None)
        order = {parent: iter(seqs) for parent, seqs in new_beams.items()}
        request.seqs = [next(order[parent]) for parent, _ in picks]
        if request.beam.done:
            for seq in request.seqs:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            request.finish_time = now

    def stats(self) -> dict:
        return self.stats_tracker.as_dict()

    # ---- helpers ----------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if set(prompt) != {"prompt_token_ids"}:
                raise ValueError(f"a dict prompt must be {{'prompt_token_ids': [...]}}, got keys {sorted(prompt)}")
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: the tokenizer would raise TypeError
                raise ValueError(f"the prompt is not valid Unicode text: {exc.reason} at index {exc.start}") from exc
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict; got {type(prompt).__name__}")

    def _validate_prompt(self, token_ids: Seq[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {limit}, so a prompt "
                             f"may have at most {limit - 1} tokens (room for one generated token)")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _check_stop(self, seq: Sequence, now: float) -> None:
        request = self._requests[seq.request_id]
        token = seq.output_token_ids[-1]
        status = None
        if token in request.stop_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif request.params.stop and self.tokenizer is not None:
            text = self._decode(seq.output_token_ids)
            hit = next((s for s in request.params.stop if s in text), None)
            if hit is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, hit
        if status is None and (len(seq.output_token_ids) >= request.params.max_tokens
                               or seq.num_tokens >= self.config.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            seq.finish_time = now
            self.scheduler.finish(seq, status)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, request: _Request) -> RequestOutput:
        if request.beam is not None:
            completions = self._beam_outputs(request)
        else:
            completions = [self._completion(request, seq) for seq in request.seqs]
        finished = request.finished
        first = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
        finish = [s.finish_time for s in request.seqs if s.finish_time is not None]
        finish_time = request.finish_time or (max(finish) if finish else None)
        metrics = {"arrival_time": request.arrival_time,
                   "first_token_time": min(first) if first else request.first_token_time,
                   "finish_time": finish_time if finished else None}
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             metrics)

    def _completion(self, request: _Request, seq: Sequence) -> CompletionOutput:
        text = self._decode(seq.output_token_ids)
        if isinstance(seq.stop_reason, str):
            text = text[: text.index(seq.stop_reason)]
        asked = request.params.logprobs is not None
        return CompletionOutput(
            index=seq.index, text=text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.status.value if seq.status.finished else None,
            logprobs=list(seq.output_logprobs) if asked else None, stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob,
            top_logprobs=list(seq.output_top_logprobs) if asked and request.params.logprobs else None)

    def _beam_outputs(self, request: _Request) -> list[CompletionOutput]:
        """The finished search's beams, best first."""
        out = []
        for index, hyp in enumerate(request.beam.results()):
            ended = bool(hyp.token_ids) and hyp.token_ids[-1] in request.stop_ids
            out.append(CompletionOutput(index=index, text=self._decode(hyp.token_ids), token_ids=list(hyp.token_ids),
                                        finish_reason="stop" if ended else "length",
                                        stop_reason=hyp.token_ids[-1] if ended else None,
                                        cumulative_logprob=hyp.cum_logprob, score=hyp.score))
        return out


def _resolve(config: EngineConfig, loaded: LoadedModel) -> EngineConfig:
    """Fill what was left open from the model and the platform: max_model_len,
    num_blocks, and the attention backend behind "auto"."""
    model_limit = loaded.config.max_position_embeddings
    max_model_len = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {model_limit}")
    num_blocks = config.num_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        num_blocks = budget // bytes_per_block(loaded.config, config.block_size, config.dtype,
                                               config.tensor_parallel_size)  # the budget is per device
    backend = config.attention_backend
    if backend == "auto":
        backend = auto_attention_backend(jax.default_backend())
    return dataclasses.replace(config, max_model_len=max_model_len, num_blocks=max(int(num_blocks), 2),
                               attention_backend=backend)


def _check_capacity(config: EngineConfig, bm: BlockManager) -> None:
    """The cache must hold one max_model_len sequence (beyond the admission watermark),
    or a long request could wait forever."""
    fits_blocks = bm.num_usable_blocks - bm.watermark_blocks
    if bm.num_blocks_needed(config.max_model_len) > fits_blocks:
        raise ValueError(
            f"the KV cache ({config.num_blocks} blocks of {config.block_size} tokens, {bm.watermark_blocks} kept "
            f"free as watermark) cannot hold one sequence of max_model_len={config.max_model_len} tokens; the "
            f"largest max_model_len that fits is {max(fits_blocks, 0) * config.block_size} (or raise "
            "num_blocks / kv_cache_memory_bytes)")
