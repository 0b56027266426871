"""Beam-search oracles: transformers' beam search, and ours driven densely, plus the
comparison rule between them.

`hf_beam_search` is the ground truth. `dense_beam_search` runs paged_jax's
`BeamSearchState` on logits that `reference.prompt_logits` recomputes from scratch for
every live beam each step (no KV cache, so no paging, forking or block bookkeeping can be
wrong): what the engine's beam search must reproduce. `assert_beams_match` accepts the
one legitimate difference, a near-tie in the final ranking.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import torch
import transformers

from paged_jax.baselines import reference
from paged_jax.core.beam_search import BeamHypothesis, BeamSearchParams, BeamSearchState

# Same sequence, two implementations: float noise in the scores (sums of up to 16 logprobs
# whose logits agree to ~1e-4) stays well below this; so does a genuine tie.
SCORE_TOLERANCE = 1e-3


def dense_beam_search(params, cfg, prompt_ids: Sequence[int], beam_params: BeamSearchParams,
                      eos_ids: Sequence[int] = ()) -> list[BeamHypothesis]:
    """paged_jax's beam search with dense recomputation: the W hypotheses, best first.

    params, cfg: our model (as `load_hf_directory` / `load_model` return them). Each
    step runs prompt + generated tokens of every live beam through
    `reference.prompt_logits`, takes log_softmax of the last position's float32 logits
    (as the device will) and hands each beam's top-K to the state machine. `eos_ids`
    finish a hypothesis unless `beam_params.ignore_eos`. Slow (quadratic), for tests only.
    """
    state = BeamSearchState(beam_params, frozenset(eos_ids))
    while not state.done:
        seqs = [list(prompt_ids) + list(ids) for ids, _ in state.live_beams]
        last = np.stack([logits[-1] for logits in reference.prompt_logits(params, cfg, seqs)]).astype(np.float32)
        state.step(top_k_candidates(np.asarray(jax.nn.log_softmax(last, axis=-1)), state.num_candidates))
    return state.results()


def top_k_candidates(logprobs: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """f32[beams, vocab] -> per beam its k best (token_id, logprob), best first."""
    logprobs = np.asarray(logprobs, np.float32)
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return [[(int(t), float(row[t])) for t in idx] for row, idx in zip(logprobs, order)]


def hf_generate_beams(hf_model, prompt_ids: Sequence[int], beam_width: int, max_new_tokens: int,
                      length_penalty: float = 1.0, eos_token_ids: Sequence[int] | None = None):
    """transformers' beam search output (GenerateBeamDecoderOnlyOutput) for one prompt.

    Only the options named here are set: the model's own generation_config is swapped for
    a fresh one during the call, because generate() fills every unset option from it
    (repetition penalty, min length, a default EOS, ...). eos_token_ids None or empty:
    no EOS (hypotheses run to max_new_tokens). Denormals are flushed during the call:
    GGUF-dequantized weights (SmolLM2) hold denormal floats that make torch's CPU
    matmuls ~40x slower; flushing them moves logits by ~1e-38. One torch thread: on a
    shared 2-core machine two spinning OpenMP threads made tiny-model steps ~20x slower.
    """
    config = transformers.GenerationConfig(
        num_beams=beam_width, num_return_sequences=beam_width, do_sample=False, early_stopping=False,
        length_penalty=float(length_penalty), max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_token_ids) if eos_token_ids else None, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True)
    saved, hf_model.generation_config = hf_model.generation_config, transformers.GenerationConfig()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        with torch.no_grad():
            return hf_model.generate(torch.tensor([list(prompt_ids)]),
                                     attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                     generation_config=config)
    finally:
        hf_model.generation_config = saved
        torch.set_num_threads(saved_threads)
        torch.set_flush_denormal(False)  # torch's default (it has no getter to restore from)


def hf_beam_search(hf_model, prompt_ids: Sequence[int], beam_width: int, max_new_tokens: int,
                   length_penalty: float = 1.0, eos_token_ids: Sequence[int] | None = None
                   ) -> tuple[list[list[int]], list[float]]:
    """transformers' W hypotheses (generated ids only, in its order, best first) and scores.

    Padding is stripped by beam_indices (-1 past a hypothesis' end) rather than by value:
    the pad value is not a reserved id (transformers pads with pad_token_id, or with
    eos[0] when pad is 0, or -1 when there is no EOS).
    """
    out = hf_generate_beams(hf_model, prompt_ids, beam_width, max_new_tokens, length_penalty, eos_token_ids)
    return hf_output_beams(out, len(prompt_ids), max_new_tokens, eos_token_ids)


def hf_output_beams(out, num_prompt_tokens: int, max_new_tokens: int, eos_token_ids: Sequence[int] | None = None
                    ) -> tuple[list[list[int]], list[float]]:
    """hf_beam_search's result from an `hf_generate_beams` output (to reuse one run)."""
    eos = set(eos_token_ids or ())
    sequences = []
    for row, indices in zip(out.sequences.tolist(), out.beam_indices.tolist()):
        ids = row[num_prompt_tokens:][: sum(i != -1 for i in indices)]
        ends = [i for i, t in enumerate(ids) if t in eos]
        assert (ends == [len(ids) - 1]) if ends else len(ids) == max_new_tokens, (ids, eos)
        sequences.append(ids)
    return sequences, out.sequences_scores.tolist()


def assert_beams_match(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
                       our_scores: Sequence[float], their_scores: Sequence[float],
                       tol: float = SCORE_TOLERANCE) -> None:
    """Our W hypotheses (best first) equal transformers', up to a checked score tie.

    Every hypothesis before the first differing rank must agree in tokens and score
    (within tol). At the first differing rank r the two hypotheses found there must score
    within tol of each other: which of two tied hypotheses ranks r (or survives at all) is
    float noise, and everything after r may reorder because of it. Past r only this is
    checked: a hypothesis both sides found has the same score on both.
    """
    ours, theirs = [list(s) for s in ours], [list(s) for s in theirs]
    show = "\n".join([f"  ours   {s} {x:.6f}" for s, x in zip(ours, our_scores)] +
                     [f"  theirs {s} {x:.6f}" for s, x in zip(theirs, their_scores)])
    assert len(ours) == len(theirs) == len(our_scores) == len(their_scores), f"beam counts differ:\n{show}"
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        gap = abs(our_scores[rank] - their_scores[rank])
        if a == b:
            assert gap <= tol, f"rank {rank}: same tokens, scores differ by {gap:.3g} > {tol}\n{show}"
            continue
        assert gap <= tol, (f"hypotheses differ at rank {rank} and their scores differ by {gap:.3g} > {tol}: "
                            f"not a tie\n{show}")
        mine = {tuple(s): x for s, x in zip(ours, our_scores)}
        for s, x in zip(theirs, their_scores):
            if tuple(s) in mine:
                assert abs(mine[tuple(s)] - x) <= tol, f"{s}: scores {mine[tuple(s)]:.6f} vs {x:.6f}\n{show}"
        return
