"""Beam search on paged sequences: fork, keep and drop beams as the search picks them.

The search itself (which (beam, token) pairs survive a step) is host-side bookkeeping in
core/beam_search.py; this module makes the KV cache follow it. A beam kept once
continues as the same sequence; kept k times, it is forked k-1 times first (the forks
share all its blocks; copy-on-write splits the last one); a beam not kept finishes and
its blocks are freed at once, so beams that agree on a prefix keep sharing its blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from paged_jax.core.beam_search import BeamSearchState
from paged_jax.core.sequence import Sequence, SequenceStatus
from paged_jax.engine.core_outputs import CompletionDelta


@dataclasses.dataclass
class BeamStep:
    beams: list[Sequence]  # the live beams after the step, in the search's beam order
    forked: list[Sequence]  # new sequences (the engine core must start tracking them)
    dropped: list[Sequence]  # finished sequences (the engine core must stop tracking them)


def advance_beams(state: BeamSearchState, beams: list[Sequence], scheduler,
                  new_seq: Callable[[Sequence], Sequence]) -> BeamStep:
    """One beam-search step once every live beam holds its candidates (`beam_candidates`).

    `new_seq(parent)` makes an empty sequence of the parent's request (a fresh id, no
    blocks); here it becomes a fork carrying the parent's tokens. When the search is done
    every beam is dropped and `beams` comes back empty.
    """
    picks = state.step([s.beam_candidates for s in beams])
    for seq in beams:
        seq.beam_candidates = None
    kept: dict[int, list[int]] = {}  # beam index -> tokens of its continuations
    for parent, token in picks:
        kept.setdefault(parent, []).append(token)
    continuations: dict[int, list[Sequence]] = {}
    forked = []
    for parent, tokens in kept.items():
        seq = beams[parent]
        children = []
        for _ in tokens[1:]:
            child = new_seq(seq)
            child.output_token_ids = list(seq.output_token_ids)
            child.first_token_time = seq.first_token_time
            scheduler.fork(seq, child)
            children.append(child)
        forked += children
        continuations[parent] = [seq] + children
        for s, token in zip(continuations[parent], tokens):
            s.output_token_ids.append(token)
    dropped = []
    for index, seq in enumerate(beams):
        if index not in kept:
            scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            dropped.append(seq)
    order = {parent: iter(seqs) for parent, seqs in continuations.items()}
    return BeamStep([next(order[parent]) for parent, _ in picks], forked, dropped)


def beam_results(state: BeamSearchState, stop_ids: frozenset[int]) -> list[CompletionDelta]:
    """The finished search's hypotheses, best first, as whole completions."""
    out = []
    for index, hyp in enumerate(state.results()):
        ended = bool(hyp.token_ids) and hyp.token_ids[-1] in stop_ids
        out.append(CompletionDelta(index=index, new_token_ids=list(hyp.token_ids), new_logprobs=[],
                                   new_top_logprobs=None, cumulative_logprob=hyp.cum_logprob,
                                   finish_reason="stop" if ended else "length",
                                   stop_reason=hyp.token_ids[-1] if ended else None, score=hyp.score))
    return out
