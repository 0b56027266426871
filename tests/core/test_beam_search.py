"""Beam search selection (paged_jax.core.beam_search) against transformers' `_beam_search`.

First hand-checkable steps with made-up candidates (W=2, vocabulary 0..4, EOS 4, so
K = num_candidates(2, 1) = 4 candidates per beam), the arithmetic in comments; every
logprob is a short binary fraction, so float32 sums and quotients are exact. Then
transformers on tiny random models and SmolLM2-135M: (a) its own per-step logprobs
replayed through our state machine must give its beams and scores bit for bit (same
float32 inputs, same decisions), and (b) our dense driver on our model must give its
beams up to a checked score tie (beam_oracle.assert_beams_match).
"""

import numpy as np
import pytest
import torch
import transformers

from paged_jax.core.beam_search import BeamHypothesis, BeamSearchParams, BeamSearchState, num_candidates
from paged_jax.loading.hf_weights import load_hf_directory
from tests.helpers.beam_oracle import (assert_beams_match, dense_beam_search, hf_generate_beams, hf_output_beams,
                         top_k_candidates)
from tests.helpers.hf_variants import VARIANTS, reinit

EOS = 4


def _state(max_new_tokens=10, length_penalty=1.0, width=2, ignore_eos=False):
    params = BeamSearchParams(beam_width=width, max_tokens=max_new_tokens, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
    return BeamSearchState(params, frozenset({EOS}))


def _c(*pairs):
    """_c(t0, lp0, t1, lp1, ...) -> [(t0, lp0), (t1, lp1), ...]"""
    return list(zip(pairs[::2], pairs[1::2]))


def _hyps(state):
    return [(h.token_ids, h.cum_logprob, h.score) for h in state.results()]


# ---- hand-checkable steps ---------------------------------------------------------------

def test_num_candidates():
    # transformers' beams_to_keep = max(2, 1 + n_eos) * W
    assert [num_candidates(2, 0), num_candidates(2, 1), num_candidates(2, 2), num_candidates(4, 3)] == [4, 4, 6, 16]
    assert _state().num_candidates == 4 and _state(width=3).num_candidates == 6


def test_params_are_validated():
    for bad, match in [({"beam_width": 0}, "beam_width must be an int >= 1, got 0"),
                       ({"beam_width": True}, "beam_width must be an int"),
                       ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
                       ({"max_tokens": 2.0}, "max_tokens must be an int"),
                       ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
                       ({"length_penalty": "1"}, "length_penalty must be a finite number"),
                       ({"ignore_eos": 1}, "ignore_eos must be a bool")]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        BeamSearchState(BeamSearchParams(2, 4), frozenset(), max_new_tokens=0)


def test_first_step_expands_the_prompt_then_ranks_across_beams():
    s = _state()
    assert s.live_beams == [((), 0.0)]  # only the prompt: transformers' other beams start at -1e9
    assert s.step([_c(0, -0.5, 1, -1.0, 2, -2.0, 3, -3.0)]) == [(0, 0), (0, 1)]  # one parent, twice
    assert s.live_beams == [((0,), -0.5), ((1,), -1.0)]
    # beam 0 (cum -0.5): tokens 2, 3 -> -1.5, -2.0;  beam 1 (cum -1.0): tokens 0, 1 -> -1.25, -3.0.
    # Best over both: -1.25 (beam 1), -1.5 (beam 0): beam 1's child ranks first.
    assert s.step([_c(2, -1.0, 3, -1.5, 0, -3.0, 1, -4.0),
                   _c(0, -0.25, 1, -2.0, 2, -3.0, 3, -4.0)]) == [(1, 0), (0, 2)]
    assert s.live_beams == [((1, 0), -1.25), ((0, 2), -1.5)]
    assert not s.done


def test_eos_finishes_a_hypothesis_only_within_the_top_w():
    s = _state()
    # EOS ranked 2 of K=4 (>= W): a spare candidate, not a finished hypothesis.
    assert s.step([_c(0, -0.5, 1, -1.0, EOS, -2.0, 2, -3.0)]) == [(0, 0), (0, 1)]
    assert s.finished == []
    # Step 2: ranks -1.0 (0,3), -1.25 (1,EOS) finished, -1.5 (0,EOS) rank 2 ignored, -2.0 (1,0).
    # The live beams are the best 2 that did not end: (0,3) and (1,0), skipping the EOS ranks.
    assert s.step([_c(3, -0.5, EOS, -1.0, 0, -3.0, 1, -4.0),
                   _c(EOS, -0.25, 0, -1.0, 2, -3.0, 3, -4.0)]) == [(0, 3), (1, 0)]
    # (1, EOS): cum -1.25, 2 generated tokens (EOS counts) -> score -1.25 / 2 ** 1.0 = -0.625
    assert s.finished == [BeamHypothesis((1, EOS), -1.25, -0.625)]


def test_length_penalty_counts_generated_tokens_including_eos():
    for length_penalty, score in [(1.0, -3.0 / 2), (2.0, -3.0 / 4), (0.0, -3.0), (-1.0, -6.0)]:
        s = _state(max_new_tokens=2, length_penalty=length_penalty)
        s.step([_c(0, -1.0, 1, -5.0, 2, -6.0, 3, -7.0)])
        # Step 2 is the last (max_new_tokens=2): every candidate ends, the top W are results.
        # (0, EOS): cum -1.0 + -2.0 = -3.0 over 2 tokens -> -3.0 / 2 ** length_penalty
        # pool: -3.0 (0,EOS), -3.5 (0,0), -6.0 (1,0), -7.0 (1,1): ranks 0 and 1 are results.
        assert s.step([_c(EOS, -2.0, 0, -2.5, 2, -8.0, 3, -9.0), _c(0, -1.0, 1, -2.0, 2, -3.0, 3, -4.0)]) == []
        assert _hyps(s)[0] == ((0, EOS), -3.0, score)


def test_stops_at_max_new_tokens_with_the_top_w_candidates():
    s = _state(max_new_tokens=2)
    s.step([_c(0, -0.5, 1, -1.0, 2, -2.0, 3, -3.0)])
    # Candidates: -1.0 (0,1), -1.5 (1,2), -2.0 (0,0), -2.5 (0,2): all hit the length limit;
    # only ranks 0 and 1 are results, scored cum / 2.
    assert s.step([_c(1, -0.5, 0, -1.5, 2, -2.0, 3, -3.0), _c(2, -0.5, 0, -2.0, 1, -3.0, 3, -4.0)]) == []
    assert s.done and s.live_beams == []
    assert _hyps(s) == [((0, 1), -1.0, -0.5), ((1, 2), -1.5, -0.75)]
    with pytest.raises(RuntimeError, match="beam search is done"):
        s.step([])


def test_max_new_tokens_one():
    s = _state(max_new_tokens=1)
    assert s.step([_c(EOS, -0.25, 0, -0.5, 1, -1.0, 2, -2.0)]) == []
    assert _hyps(s) == [((EOS,), -0.25, -0.25), ((0,), -0.5, -0.5)]


def _early_stop_case(length_penalty):
    """Step 1 finishes (EOS,) at -0.25; step 2 finishes (0, EOS) at cum -0.75 and leaves
    (0, 0) live at cum -0.875: the finished set is full (W=2) after step 2."""
    s = _state(length_penalty=length_penalty)
    s.step([_c(EOS, -0.25, 0, -0.5, 1, -0.75, 2, -1.0)])
    # pool: -0.75 (0,EOS), -0.875 (0,0), -2.75 (1,0), -3.5 (0,1)
    out = s.step([_c(EOS, -0.25, 0, -0.375, 1, -3.0, 2, -4.0), _c(0, -2.0, 1, -3.0, 2, -4.0, 3, -5.0)])
    return s, out


def test_early_stop_heuristic_ends_when_no_live_beam_can_win():
    # length_penalty 1: finished (EOS,) -0.25/1 = -0.25 and (0,EOS) -0.75/2 = -0.375 (worst).
    # Best live beam now: -0.875/2 = -0.4375 <= -0.375 -> stop before max_new_tokens.
    s, out = _early_stop_case(1.0)
    assert out == [] and s.done
    assert _hyps(s) == [((EOS,), -0.25, -0.25), ((0, EOS), -0.75, -0.375)]


def test_early_stop_heuristic_needs_a_full_finished_set_and_a_hopeless_best_beam():
    # One finished hypothesis (W=2): no stop, however bad the live beams.
    s = _state()
    s.step([_c(EOS, -0.25, 0, -8.0, 1, -9.0, 2, -10.0)])
    assert not s.done
    # length_penalty 2: finished (EOS,) -0.25/1 = -0.25 (worst) and (0,EOS) -0.75/4 = -0.1875.
    # Best live beam: -0.875/4 = -0.21875 > -0.25: it could still win -> go on.
    s, out = _early_stop_case(2.0)
    assert out == [(0, 0), (1, 0)] and not s.done
    assert s.finished == [BeamHypothesis((0, EOS), -0.75, -0.1875), BeamHypothesis((EOS,), -0.25, -0.25)]


def test_finished_set_keeps_the_best_w():
    s, _ = _early_stop_case(2.0)  # live (0,0) -0.875, (1,0) -2.75; finished -0.1875, -0.25
    # Step 3 pool: -1.0 (0,0,EOS), -1.375 (0,0,0), -3.875 (0,0,1), -4.75 (1,0,0).
    # (0,0,EOS) scores -1.0/3**2 = -0.111, the new best; (EOS,) at -0.25 drops out.
    # Best live (0,0,0): -1.375/9 = -0.153 > -0.1875, the worst finished: go on.
    assert s.step([_c(EOS, -0.125, 0, -0.5, 1, -3.0, 2, -4.0),
                   _c(0, -2.0, 1, -3.0, 2, -4.0, 3, -5.0)]) == [(0, 0), (0, 1)]
    assert [h.token_ids for h in s.finished] == [(0, 0, EOS), (0, EOS)]
    assert s.finished[0].score == pytest.approx(-1.0 / 9, rel=1e-7)
    # Step 4: (0,0,0,EOS) ranks first (cum -4.375) but scores -4.375/16 = -0.273, worse
    # than both finished: the set is unchanged. Best live -10.375/16 < -0.1875: done.
    assert s.step([_c(EOS, -3.0, 0, -9.0, 1, -9.5, 2, -10.0), _c(0, -9.0, 1, -9.5, 2, -10.0, 3, -11.0)]) == []
    assert [h.token_ids for h in s.results()] == [(0, 0, EOS), (0, EOS)]


def test_ignore_eos_makes_eos_an_ordinary_token():
    s = _state(max_new_tokens=2, ignore_eos=True)
    assert s.eos_token_ids == frozenset() and s.num_candidates == 4
    assert s.step([_c(EOS, -0.25, 0, -0.5, 1, -1.0, 2, -2.0)]) == [(0, EOS), (0, 0)]


def test_misuse_is_refused():
    s = _state()
    with pytest.raises(RuntimeError, match="not done yet"):
        s.results()
    with pytest.raises(ValueError, match=r"one candidate list per live beam \(1\), got 2"):
        s.step([_c(0, -1.0), _c(0, -1.0)])
    with pytest.raises(ValueError, match=r"live beam 0 has 3 candidates; need its top 4"):
        s.step([_c(0, -1.0, 1, -2.0, 2, -3.0)])


# ---- the comparison rule --------------------------------------------------------------

def test_assert_beams_match_accepts_only_ties():
    assert_beams_match([[1, 2], [3]], [[1, 2], [3]], [-1.0, -2.0], [-1.0001, -2.0])
    assert_beams_match([[1, 2], [3]], [[3], [1, 2]], [-1.0, -1.0002], [-1.0001, -1.0])  # a swapped tie
    assert_beams_match([[1, 2], [3]], [[1, 2], [4]], [-1.0, -2.0], [-1.0, -2.0005])  # the last slot, tied
    with pytest.raises(AssertionError, match="differ at rank 1 .* not a tie"):
        assert_beams_match([[1, 2], [3]], [[1, 2], [4]], [-1.0, -2.0], [-1.0, -2.5])
    with pytest.raises(AssertionError, match="rank 0: same tokens, scores differ"):
        assert_beams_match([[1, 2]], [[1, 2]], [-1.0], [-1.1])
    with pytest.raises(AssertionError, match=r"\[1, 2\]: scores"):  # swapped, but one score is off
        assert_beams_match([[1, 2], [3]], [[3], [1, 2]], [-1.0, -1.0], [-1.0, -1.5])
    with pytest.raises(AssertionError, match="beam counts differ"):
        assert_beams_match([[1]], [[1], [2]], [-1.0], [-1.0, -2.0])


# ---- against transformers -------------------------------------------------------------

MAX_NEW = 12
WIDTHS = (2, 4)
LENGTH_PENALTIES = (1.0, 0.5, 2.0)


def _replay(out, beam_params, eos_ids):
    """Our state machine fed transformers' own per-step logprobs (out.scores: f32[W, vocab]
    per step, rows in its running-beam order; on step 1 all rows are the prompt)."""
    state = BeamSearchState(beam_params, frozenset(eos_ids))
    for step_logprobs in out.scores:
        assert not state.done
        state.step(top_k_candidates(step_logprobs[: len(state.live_beams)].numpy(), state.num_candidates))
    assert state.done, "transformers stopped earlier than we would"
    return state.results()


def _eos_settings(hf_model, prompt):
    """(eos ids, ignore_eos) cases with EOS ids the random model does emit, so hypotheses
    end early and the EOS rules matter: tokens 2 and a later one of its best EOS-free
    beam; the prompt's 3rd and 6th likeliest next tokens (on step 1 they rank 2 and 5,
    spare candidates that must not finish, for W=2 with K=6, and the 6th for W=4 with
    K=12); and the first case again with the EOS ignored."""
    out = hf_generate_beams(hf_model, prompt, 2, MAX_NEW)
    [best, second], _ = hf_output_beams(out, len(prompt), MAX_NEW)
    other = next(t for t in best[5:] + second if t != best[2])
    ranked = torch.argsort(out.scores[0][0], descending=True).tolist()
    return [((best[2],), True), ((best[2],), False), ((best[2], other), False), ((ranked[2], ranked[5]), False)]


def _check_case(hf_model, cfg, params, prompt, width, length_penalty, eos_ids, ignore_eos, stats):
    beam_params = BeamSearchParams(width, MAX_NEW, length_penalty, ignore_eos=ignore_eos)
    hf_eos = None if ignore_eos else eos_ids
    out = hf_generate_beams(hf_model, prompt, width, MAX_NEW, length_penalty, hf_eos)
    seqs, scores = hf_output_beams(out, len(prompt), MAX_NEW, hf_eos)
    where = f"prompt {prompt}, W={width}, length_penalty={length_penalty}, eos={hf_eos}"
    replayed = _replay(out, beam_params, eos_ids)
    assert [list(h.token_ids) for h in replayed] == seqs, where
    assert [h.score for h in replayed] == scores, where  # float32, bit for bit
    dense = dense_beam_search(params, cfg, prompt, beam_params, eos_ids)
    assert_beams_match([h.token_ids for h in dense], seqs, [h.score for h in dense], scores)
    stats["eos_results"] += sum(bool(hf_eos) and s[-1] in hf_eos for s in seqs)
    stats["early_stops"] += len(out.scores) < MAX_NEW


@pytest.mark.parametrize("variant", ["llama_tied", "qwen2_linear_rope"])
def test_matches_transformers_on_tiny_models(tmp_path, variant):
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant](), attn_implementation="eager",
                                                       dtype=torch.float32)
    reinit(hf, seed=7)
    hf.eval()
    hf.save_pretrained(str(tmp_path))
    cfg, params = load_hf_directory(str(tmp_path))
    rng = np.random.default_rng(3)
    stats = {"eos_results": 0, "early_stops": 0}
    for prompt_len in (3, 9, 20):
        prompt = rng.integers(3, 256, size=prompt_len).tolist()
        for eos_ids, ignore_eos in _eos_settings(hf, prompt):
            for width in WIDTHS:
                for length_penalty in LENGTH_PENALTIES:
                    _check_case(hf, cfg, params, prompt, width, length_penalty, eos_ids, ignore_eos, stats)
    # The cases exercise what they are meant to: EOS-ended results, and the heuristic stop.
    assert stats["eos_results"] >= 5 and stats["early_stops"] >= 1, stats


@pytest.fixture(scope="module")
def smollm2_both(smollm2_path, smollm2_hf):
    from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer
    from paged_jax.loading.gguf_weights import load_gguf
    cfg, params = load_gguf(smollm2_path)
    return smollm2_hf, cfg, params, load_gguf_tokenizer(smollm2_path)


@pytest.mark.slow  # SmolLM2 in transformers and in the engine; the tiny-model cases cover the rules
def test_matches_transformers_on_smollm2(smollm2_both):
    hf, cfg, params, tok = smollm2_both
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    stats = {"eos_results": 0, "early_stops": 0}
    for text, width, length_penalty in [(chat, 4, 0.5), ("The capital of France is", 2, 1.0)]:
        _check_case(hf, cfg, params, tok.encode(text), width, length_penalty, cfg.eos_token_ids, False, stats)
    assert stats["eos_results"] >= 2, stats  # "...is Paris.<|im_end|>" and "...Paris, France.<|im_end|>"
