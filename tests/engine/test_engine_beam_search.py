"""Beam search inside the paged engine against transformers' beam search.

The beams run as sequences that fork (sharing blocks, copy-on-write on the last one) and
free as the search keeps or drops them, batched with other requests and, under a tight
KV budget, preempted by swap and by recompute. Every returned beam list must equal
transformers' (token ids, same order), up to a checked score tie (beam_oracle).
"""

import dataclasses
import numpy as np
import pytest
import torch
import transformers

from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import LoadedModel
from paged_jax.loading.hf_weights import load_hf_directory
from tests.helpers.beam_oracle import assert_beams_match, hf_beam_search
from tests.helpers.hf_variants import VARIANTS, reinit

MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-weight Llama in both frameworks, with an EOS id the model does emit (the
    third token of its best EOS-free beam), so hypotheses finish early."""
    path = str(tmp_path_factory.mktemp("tiny_llama_beams"))
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS["llama_tied"](), attn_implementation="eager",
                                                       dtype=torch.float32)
    reinit(hf, seed=11)
    hf.eval().save_pretrained(path)
    cfg, params = load_hf_directory(path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 9, 20, 37)]
    [best, _], _ = hf_beam_search(hf, prompts[1], 2, MAX_NEW)
    cfg = dataclasses.replace(cfg, eos_token_ids=(best[2],))
    return hf, LoadedModel(cfg, params, None, path, "hf", 0.0), prompts


def _cases(prompts):
    return [(p, w, lp, ignore) for p in prompts for w in (2, 4) for lp, ignore in ((1.0, False), (0.5, True))]


def _check(hf, model, cases, outputs):
    eos_results = 0
    for (prompt, width, lp, ignore_eos), out in zip(cases, outputs):
        eos = None if ignore_eos else model.config.eos_token_ids
        want, want_scores = hf_beam_search(hf, prompt, width, MAX_NEW, lp, eos)
        assert_beams_match([c.token_ids for c in out.outputs], want, [c.score for c in out.outputs], want_scores)
        assert [c.finish_reason for c in out.outputs] == ["stop" if eos and s[-1] in eos else "length"
                                                          for s in (c.token_ids for c in out.outputs)]
        eos_results += sum(bool(eos) and s[-1] in eos for s in want)
    return eos_results


def _run(model, cases, **settings):
    settings = {"seq_buckets": (4, 16), "token_buckets": (16, 64), **settings}  # few shapes to compile
    llm = LLM(model, block_size=4, max_model_len=64, max_num_seqs=16, max_num_batched_tokens=64,
              attention_backend="reference", paper_metrics=True, **settings)  # sharing_savings
    # Every case is queued at once, so beams of different requests share steps.
    for i, (prompt, width, lp, ignore_eos) in enumerate(cases):
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, BeamSearchParams(
            beam_width=width, max_tokens=MAX_NEW, length_penalty=lp, ignore_eos=ignore_eos))
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.finished, "beam requests report only when done"
            done[out.request_id] = out
    llm.engine.block_manager.check_invariants()
    stats = llm.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"], "every block is free (or free and cached)"
    return [done[f"r{i}"] for i in range(len(cases))], stats


def test_engine_beams_equal_transformers_in_a_busy_batch(tiny):
    hf, model, prompts = tiny
    cases = _cases(prompts)
    outputs, stats = _run(model, cases)
    assert _check(hf, model, cases, outputs) >= 4, "EOS must end some of transformers' beams"
    assert stats["sharing_savings"] > 0.2, stats  # beams share their common prefixes
    assert stats["max_batched_seqs"] > 4


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_beams_under_preemption(tiny, mode):
    hf, model, prompts = tiny
    cases = _cases(prompts[2:])
    outputs, stats = _run(model, cases, num_blocks=60, watermark=0.0, preemption_mode=mode,
                          swap_space_bytes=2**22, enable_prefix_caching=False)
    _check(hf, model, cases, outputs)
    assert stats["num_preemptions"] > 0, stats


@pytest.mark.slow  # SmolLM2 buckets compiled for one more engine; the tiny-model cases cover the engine
def test_llm_beam_search_on_smollm2(smollm2_hf):
    """SmolLM2 through LLM.beam_search (text in, beams with text out) against transformers
    loading the same GGUF."""
    llm = LLM("smollm2-135m", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    hf = smollm2_hf
    eos = llm.engine.model_config.eos_token_ids
    for text, width in [(chat, 4), ("The capital of France is", 2)]:
        [out] = llm.beam_search([text], BeamSearchParams(beam_width=width, max_tokens=12), use_tqdm=False)
        want, want_scores = hf_beam_search(hf, tok.encode(text), width, 12, 1.0, eos)
        assert_beams_match([s.token_ids for s in out.sequences], want, [s.score for s in out.sequences],
                           want_scores)
        assert out.sequences[0].text == tok.decode(out.sequences[0].token_ids, skip_special_tokens=True)
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    assert llm.stats()["num_blocks_free"] == llm.stats()["num_blocks_total"]
