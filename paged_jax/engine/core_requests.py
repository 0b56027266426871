"""A request's sequences, as the engine core builds them: checked, seeded and numbered.

A sampling request becomes its n completions (the first one alone is scheduled; the others
are forked from it once its prompt, but the last token, is computed); a beam search starts
as one sequence whose beams fork as the host-side search goes (beam_orchestration.py). Every
sequence gets an id unique for the engine's lifetime (the block manager's key), and every
completion a seed of its own (`completion_seed`), so its random stream depends on nothing
else in the engine. A file of its own so engine_core.py holds the step loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.config.engine_config import EngineConfig
from paged_jax.config.model_config import ModelConfig
from paged_jax.core.beam_search import BeamSearchParams, BeamSearchState, num_candidates
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.sequence import Sequence
from paged_jax.engine.kv_sizing import check_group_fits

_GOLDEN = 0x9E3779B1  # spreads (seed, index) pairs over 32-bit seeds


def completion_seed(request_seed: int, index: int) -> int:
    """The seed of completion `index` of a request: its stream depends on nothing else."""
    return (request_seed + index * _GOLDEN) % 2**32


@dataclasses.dataclass
class CoreRequest:
    request_id: str
    params: SamplingParams | BeamSearchParams
    seqs: list[Sequence]  # sampling: the n completions; beam search: the live beams, in beam order
    stop_ids: frozenset[int]
    arrival_time: float
    root: Sequence  # the first sequence: its prefix-cache hits are the request's num_cached_tokens
    beam: BeamSearchState | None = None
    # a beam search or structured outputs: its next step needs its tokens on the host (`_needs_tokens_now`)
    host_fed: bool = False
    # prompt logprobs computed since the request's last output: (token, logprob, rank, top-k)
    pending_prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] = dataclasses.field(
        default_factory=list)

    @property
    def first_token_time(self) -> float | None:
        """The root samples the request's first token: forks and beams join after it."""
        return self.root.first_token_time

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done or all(s.status.finished for s in self.seqs)
        seqs = self.seqs
        if len(seqs) == 1:  # most requests, checked twice per step each
            return seqs[0].status.finished
        return all(s.status.finished for s in seqs)


class RequestBuilder:
    """Builds requests' sequences for one engine: `config` (resolved), the `block_manager` a
    group must fit, `num_top_logprobs` (the runner's top-K width: beam candidates), the
    `structured_outputs` manager (None: constrained requests are refused)."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, block_manager, num_top_logprobs: int,
                 structured_outputs):
        self.model_config, self.config, self.block_manager = model_config, config, block_manager
        self.num_top_logprobs, self.structured_outputs = num_top_logprobs, structured_outputs
        self.next_seq_id = 0
        self._rng = np.random.default_rng(config.seed)

    def build(self, request_id, token_ids, params: SamplingParams | BeamSearchParams, now, cache_salt) -> CoreRequest:
        """The request's CoreRequest; ValueError (nothing built) on what the engine cannot serve."""
        if isinstance(params, BeamSearchParams):
            return self._beam_request(request_id, token_ids, params, now, cache_salt)
        return self._sampling_request(request_id, token_ids, params, now, cache_salt)

    def _sampling_request(self, request_id, token_ids, params: SamplingParams, now, cache_salt) -> CoreRequest:
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds the engine's max_logprobs="
                             f"{self.config.max_logprobs}")
        if params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise ValueError("structured_outputs needs an engine with a (fast Hugging Face) tokenizer and "
                                 "llguidance installed")
            self.structured_outputs.check(params.structured_outputs)  # an invalid grammar: ValueError, nothing queued
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the engine's max_logprobs="
                             f"{self.config.max_logprobs}")
        check_group_fits(self.config, self.block_manager, params.n, len(token_ids) + params.max_tokens)
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        seqs = [self._new_seq(request_id, index, token_ids, params, now, completion_seed(base_seed, index),
                              cache_salt) for index in range(params.n)]
        seqs[0].pending_forks = seqs[1:]  # forked once the prompt (but its last token) is computed
        return CoreRequest(request_id, params, seqs, params.all_stop_token_ids(self.model_config.eos_token_ids),
                           now, root=seqs[0], host_fed=params.structured_outputs is not None)

    def _beam_request(self, request_id, token_ids, params: BeamSearchParams, now, cache_salt) -> CoreRequest:
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        needed = num_candidates(params.beam_width, len(eos))
        if needed > self.num_top_logprobs:
            raise ValueError(f"beam_width={params.beam_width} needs the top {needed} tokens per beam; the engine "
                             f"returns {self.num_top_logprobs} (raise max_logprobs)")
        check_group_fits(self.config, self.block_manager, params.beam_width, len(token_ids) + params.max_tokens)
        max_new = min(params.max_tokens, self.config.max_model_len - len(token_ids))
        # the sampled token is unused; logprobs=needed makes the runner return each beam's candidates
        greedy = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=needed)
        seq = self._new_seq(request_id, 0, token_ids, greedy, now, 0, cache_salt)
        return CoreRequest(request_id, params, [seq], eos, now, root=seq, beam=BeamSearchState(params, eos, max_new),
                           host_fed=True)

    def _new_seq(self, request_id, index, token_ids, params, now, seed, cache_salt) -> Sequence:
        seq = Sequence(seq_id=self.next_seq_id, request_id=request_id, index=index,
                       prompt_token_ids=list(token_ids), sampling_params=params, arrival_time=now, seed=seed,
                       cache_salt=cache_salt)
        self.next_seq_id += 1
        return seq

    def fork_of(self, parent: Sequence) -> Sequence:
        seq = self._new_seq(parent.request_id, 0, parent.prompt_token_ids, parent.sampling_params,
                            parent.arrival_time, 0, parent.cache_salt)
        seq.priority = parent.priority
        return seq

