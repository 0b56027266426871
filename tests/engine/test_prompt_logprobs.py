"""Prompt logprobs (`SamplingParams(prompt_logprobs=k)`) against transformers' log-softmax
of the same prompt on the same random weights: with chunked prefill splitting prompts, with
a prefix already cached (the request must not take it: cached blocks have no logits), with
a preemption recomputing a prompt (no position reported twice), with n > 1 and in vLLM's
shape (None first, then {token: Logprob} holding the prompt token and the top k)."""

import random

import numpy as np
import pytest
import torch
import transformers

from paged_jax.core.outputs import Logprob
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import load_model
from tests.helpers.hf_variants import VARIANTS, reinit


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_tied")
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS["llama_tied"](), attn_implementation="eager",
                                                       dtype=torch.float32)
    reinit(hf, seed=3)
    hf.eval()
    hf.save_pretrained(str(path))
    return path, hf


def _hf_log_softmax(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()


def _check_against_hf(hf, prompt, prompt_logprobs, k):
    """Every position's prompt-token logprob and rank, and its top k, against transformers."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    reference = _hf_log_softmax(hf, prompt)
    for i in range(1, len(prompt)):
        row, position = reference[i - 1], prompt_logprobs[i]
        token = prompt[i]
        assert isinstance(position[token], Logprob)
        assert position[token].logprob == pytest.approx(row[token], abs=1e-4)
        assert position[token].rank == 1 + int(np.sum(row > row[token] + 1e-6))
        best = np.argsort(-row)[:k].tolist()  # random weights: no near-ties among them
        assert set(position) == {token, *best}
        for j, t in enumerate(best):
            assert position[t].logprob == pytest.approx(row[t], abs=1e-4)
            assert t == token or position[t].rank == j + 1


def test_prompt_logprobs_equal_transformers_with_chunks_cache_hits_and_preemption(hf_model_dir):
    path, hf = hf_model_dir
    rng = random.Random(7)
    shared = [rng.randrange(3, 256) for _ in range(40)]  # 5 full blocks of 8, cached by the first request
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (30, 9, 57)]
    prompts += [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 2, 70)]
    # a 24-token budget splits every long prompt into chunks; 26 blocks of 8 force a preemption
    llm = LLM(load_model(str(path)), block_size=8, num_blocks=26, max_model_len=160, max_num_seqs=4,
              max_num_batched_tokens=24)
    warm = llm.generate([{"prompt_token_ids": shared + [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=1),
                        use_tqdm=False)[0]
    assert warm.prompt_logprobs is None  # not asked for
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=k)
              for k in (3, 0, 5, 2, 1, 4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    for prompt, sp, out in zip(prompts, params, outs):
        assert out.num_cached_tokens == 0  # the cached shared prefix was not taken
        _check_against_hf(hf, prompt, out.prompt_logprobs, sp.prompt_logprobs)
    # a request without prompt logprobs does take the same cached prefix
    again = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens >= 40


def test_prompt_logprobs_with_n_and_decoded_tokens(hf_model_dir):
    path, hf = hf_model_dir
    llm = LLM(load_model(str(path)), block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32)
    prompt = [9, 200, 31, 4, 77, 150, 3, 18, 250, 66, 42]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    _check_against_hf(hf, prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_validation(hf_model_dir):
    path, _ = hf_model_dir
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    llm = LLM(load_model(str(path)), block_size=8, num_blocks=16, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, max_logprobs=4)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(prompt_logprobs=5), use_tqdm=False)
