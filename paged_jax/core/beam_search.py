"""Beam search bookkeeping: transformers' beam search as a host-side state machine.

The engine runs each live beam as a sequence. Every step the device returns, for each
live beam, its top-K next tokens with their log-probabilities (log_softmax of the raw
float32 logits, no temperature); `BeamSearchState.step` decides which (parent, token)
pairs become the next live beams, which hypotheses are finished, and when the search is
over. The engine then forks / frees KV blocks to match. Pure Python, so the rules can be
read and tested without a device.

It reproduces `transformers` (5.x) `GenerationMixin._beam_search` with num_beams=W,
num_return_sequences=W, do_sample=False, early_stopping=False and no logits processors,
so that the engine's beams can be checked against transformers beam for beam. One step,
transformers' helper names in brackets:

1. Every (beam, token) candidate scores cum_logprob + logprob; the best
   K = num_candidates(W, num_eos) over all beams are kept [_get_top_k_continuations].
   K > W leaves W unfinished candidates even when the best ones all end in EOS.
2. A candidate "hits" when its token is an EOS or its length reaches max_new_tokens.
   The best W candidates that do not hit are the next live beams, in rank order
   [_get_running_beams_for_next_iteration].
3. Hits ranked among the top W (only those: the rest are spares) become finished
   hypotheses scored cum_logprob / generated_len ** length_penalty, generated_len
   counting the new token (EOS included); the finished set keeps the best W, older ones
   first on equal scores [_update_finished_beams].
4. The search ends when all K candidates hit (the length limit), or when W hypotheses
   are finished and the best live beam, scored at the current length, does not beat the
   worst finished one [_check_early_stop_heuristic, early_stopping=False].

Arithmetic: transformers accumulates in float32, so every sum and quotient here is
rounded to float32 (an IEEE single op equals the double op rounded once more), and equal
device logprobs give bit-identical decisions. Exact ties cannot be matched: torch.topk
on CPU orders equal values arbitrarily (not by index); here they go to the lower
(beam, token). Assumes a vocabulary of at least K tokens (transformers would otherwise
draw from its -1e9 placeholder beams on the first step).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence


def _f32(x: float) -> float:
    """x rounded to the nearest float32, as torch stores it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """What a beam-search request asks for, with vLLM's names.

    beam_width=1 is allowed but is not transformers' num_beams=1 (that runs greedy
    search, which stops at the first EOS; this keeps a spare beam past it).
    """

    beam_width: int  # W: live beams per step, and hypotheses returned
    max_tokens: int  # new tokens at most per hypothesis (an EOS counts)
    length_penalty: float = 1.0  # finished score = cum_logprob / generated_len ** length_penalty
    ignore_eos: bool = False  # EOS is an ordinary token: every hypothesis runs to max_tokens

    @property
    def n(self) -> int:
        """How many completions the request returns (SamplingParams' name): its beams."""
        return self.beam_width

    def __post_init__(self):
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float))
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


def num_candidates(beam_width: int, num_eos: int) -> int:
    """K, the candidates kept per step and so the top-K the device returns per beam.

    transformers' beams_to_keep: with n EOS ids each beam's best n tokens may all be EOS,
    so (1 + n) * W candidates still hold W unfinished ones; at least 2W.
    """
    return max(2, 1 + num_eos) * beam_width


@dataclasses.dataclass(frozen=True)
class BeamHypothesis:
    """A finished beam."""

    token_ids: tuple[int, ...]  # generated tokens only; a final EOS is included
    cum_logprob: float  # sum of the tokens' logprobs (float32 arithmetic)
    score: float  # cum_logprob / len(token_ids) ** length_penalty; results are ranked by it


class BeamSearchState:
    """One request's beam search: live beams, finished hypotheses, and whether it is over.

    Starts with one live beam, the prompt (empty generated tokens): transformers' other
    W-1 initial beams score -1e9 and never contribute a candidate. After each step the
    live beams are exactly transformers' running_sequences, in its order.
    """

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int] = frozenset(),
                 max_new_tokens: int | None = None):
        """eos_token_ids: ids that finish a hypothesis (ignored when params.ignore_eos).
        max_new_tokens: the length limit if lower than params.max_tokens (e.g. the room
        the model's context leaves after the prompt); defaults to params.max_tokens."""
        max_new_tokens = params.max_tokens if max_new_tokens is None else max_new_tokens
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(int(t) for t in eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.num_candidates = num_candidates(params.beam_width, len(self.eos_token_ids))
        self._live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]  # (generated ids, cum logprob)
        self._finished: list[BeamHypothesis] = []  # best first, at most W
        # transformers' is_early_stop_heuristic_unsatisfied: sticky, and the search ends
        # the step it turns False, so it never needs to be consulted afterwards.
        self._improvable = True
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def live_beams(self) -> list[tuple[tuple[int, ...], float]]:
        """(generated token ids, cum logprob) per live beam, in the order step() expects."""
        return list(self._live)

    @property
    def finished(self) -> list[BeamHypothesis]:
        """The best hypotheses finished so far, best first (at most W; final once done)."""
        return list(self._finished)

    def step(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, int]]:
        """Advance one token.

        candidates[i]: live beam i's top-K (token_id, logprob), K = self.num_candidates
        (more is fine). Returns the next live beams as (parent beam index, token id), in
        transformers' order; a parent may appear several times, and a live beam not
        named is dropped. Returns [] when the search is done (results() is then final).
        """
        if self._done:
            raise RuntimeError("beam search is done; read results() instead of stepping")
        if len(candidates) != len(self._live):
            raise ValueError(f"need one candidate list per live beam ({len(self._live)}), got {len(candidates)}")
        width, k = self.params.beam_width, self.num_candidates
        pool = []  # (cum logprob, parent, token id)
        for parent, ((_, cum), cands) in enumerate(zip(self._live, candidates)):
            if len(cands) < k:
                raise ValueError(f"live beam {parent} has {len(cands)} candidates; need its top {k} "
                                 f"(num_candidates({width}, {len(self.eos_token_ids)}))")
            pool += [(_f32(cum + _f32(logprob)), parent, int(token)) for token, logprob in cands]
        pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = pool[:k]
        generated_len = len(self._live[0][0]) + 1  # all live beams have the same length
        at_limit = generated_len >= self.max_new_tokens
        hits = [at_limit or token in self.eos_token_ids for _, _, token in top]
        penalty = _f32(generated_len ** self.params.length_penalty)

        new_finished = [BeamHypothesis(self._live[parent][0] + (token,), cum, _f32(cum / penalty))
                        for (cum, parent, token), hit in zip(top[:width], hits) if hit]
        # Stable sort: on equal scores the older hypothesis stays ahead.
        self._finished = sorted(self._finished + new_finished, key=lambda h: -h.score)[:width]
        running = [c for c, hit in zip(top, hits) if not hit][:width]
        self._live = [(self._live[parent][0] + (token,), cum) for cum, parent, token in running]

        if len(self._finished) == width and self._live:
            best_possible = _f32(self._live[0][1] / penalty)
            self._improvable = self._improvable and best_possible > self._finished[-1].score
        if all(hits) or not self._improvable or not self._live:
            self._done, self._live = True, []
            return []
        return [(parent, token) for _, parent, token in running]

    def results(self) -> list[BeamHypothesis]:
        """The finished hypotheses, best score first (W of them unless the vocabulary < K)."""
        if not self._done:
            raise RuntimeError("beam search is not done yet; keep calling step()")
        return list(self._finished)
