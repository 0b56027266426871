"""The paged engine on the real default model: text in, text out, equal to the reference.

(The reference itself equals transformers' greedy output on these weights:
test_gguf.py::test_greedy_matches_transformers.)
"""

import pytest

from paged_jax.baselines import reference
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import load_model
from tests.helpers.greedy_check import assert_greedy_match

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def llm(smollm2):
    # two step shapes only: SmolLM2's 30 unrolled layers compile for several seconds per shape
    return LLM(smollm2, block_size=16, num_blocks=48, max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=64, seq_buckets=(4,), token_buckets=(4, 64))


def test_greedy_text_equals_reference(llm, smollm2):
    tok = smollm2.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = PROMPTS + [chat]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids and out.prompt == prompt
        [want] = reference.generate(smollm2.params, smollm2.config, [ids], max_new_tokens=24)
        got = out.outputs[0].token_ids
        assert_greedy_match(ids, want, got,
                            lambda p: reference.prompt_logits(smollm2.params, smollm2.config, [p])[0][-1])
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True)
        # a stop token ends with "stop", otherwise max_tokens ends with "length"
        assert out.outputs[0].finish_reason == ("stop" if got[-1] in smollm2.config.eos_token_ids else "length")
    assert "Paris" in outs[-1].outputs[0].text
    assert outs[-1].outputs[0].finish_reason == "stop"  # the chat answer ends with <|im_end|>


def test_stop_string_cuts_the_text(llm):
    [free] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=24),
                          use_tqdm=False)
    assert "." in free.outputs[0].text
    [cut] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=24, stop=["."]),
                         use_tqdm=False)
    assert cut.outputs[0].text == free.outputs[0].text.split(".")[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == "."


def test_a_prompt_that_is_not_valid_unicode_is_refused(llm):
    """A lone surrogate made the tokenizer raise TypeError inside the engine (a 500 in the server)."""
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(["fine", "bad \ud800 text"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    [out] = llm.generate(["fine"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_prompt_logprobs_equal_the_reference(llm, smollm2):
    """A prompt longer than the 64-token budget (so its prefill is chunked), scored twice: the
    second time its blocks are cached, which a prompt-logprobs request must not take."""
    import numpy as np

    tok = smollm2.tokenizer
    text = " ".join(PROMPTS) + " The quick brown fox jumps over the lazy dog. " * 6
    ids = tok.encode(text)
    assert len(ids) > 64
    logits = np.asarray(reference.prompt_logits(smollm2.params, smollm2.config, [ids])[0], np.float64)
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for _ in range(2):
        [out] = llm.generate([text], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
        assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            position = out.prompt_logprobs[i]
            assert position[ids[i]].logprob == pytest.approx(expected[i - 1, ids[i]], abs=1e-4)
            assert position[ids[i]].decoded_token == tok.decode([ids[i]])
            best = np.argsort(-expected[i - 1])[:2].tolist()
            assert set(position) == {ids[i], *best}
