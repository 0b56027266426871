"""The front end's prompt processing: every accepted prompt form, and what is refused."""

import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.processor import ProcessedPrompt, Processor, int_list, validate_max_tokens
from tests.helpers.model_free_runner import make_engine


class _Chars:
    """A stand-in tokenizer: one token per character."""

    def encode(self, text):
        return [ord(ch) for ch in text]


@pytest.fixture
def processor():
    return Processor(_Chars(), max_model_len=16, vocab_size=200)


@pytest.mark.parametrize("prompt, want", [
    ("hi", ProcessedPrompt("hi", [104, 105])),
    ([5, 6], ProcessedPrompt(None, [5, 6])),
    ((5, np.int32(6)), ProcessedPrompt(None, [5, 6])),
    (np.array([5, 6]), ProcessedPrompt(None, [5, 6])),
    ({"prompt_token_ids": [5, 6]}, ProcessedPrompt(None, [5, 6])),
    ({"prompt_token_ids": [5, 6], "cache_salt": "s"}, ProcessedPrompt(None, [5, 6], "s")),
    ({"prompt": "hi"}, ProcessedPrompt("hi", [104, 105])),
    ({"prompt": "hi", "cache_salt": "tenant"}, ProcessedPrompt("hi", [104, 105], "tenant")),
])
def test_accepted_prompts(processor, prompt, want):
    got = processor.process(prompt)
    assert got == want and all(type(t) is int for t in got.token_ids)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [5], "cache_salt": ""}, "cache_salt must be a non-empty str"),
    ({"prompt": "hi", "cache_salt": 7}, "cache_salt must be a non-empty str"),
    ({"prompt": 5}, "must hold a str"),
    ({"prompt_token_ids": "hi"}, "prompt_token_ids must be a list"),
    ({"prompt": "hi", "prompt_token_ids": [5]}, "a dict prompt must be"),
    ({"cache_salt": "s"}, "a dict prompt must be"),
    ({"prompt_token_ids": [5], "salt": "s"}, "prompt_token_ids"),
    ({"prompt": "bad \ud800"}, "not valid Unicode"),
    ({"prompt": "x" * 16}, "at most 15 tokens"),
    ({"prompt_token_ids": []}, "empty"),
    ([5, 200], "outside the vocabulary"),
    (5, "a prompt must be"),
    ([5, [6, 7]], "a prompt must be"),  # ragged: numpy's own error must not leak
    ([5.0, 6.0], "a prompt must be"),
    ([2**70], "outside the vocabulary"),  # past int64: the element-wise path
])
def test_refused_prompts(processor, prompt, message):
    with pytest.raises(ValueError, match=message):
        processor.process(prompt)


@pytest.mark.parametrize("prompt", [[True, 5], [5, False], (5, True), {"prompt_token_ids": [5, True]},
                                    [5, np.bool_(True)], np.array([True, False])])
def test_bools_are_not_token_ids(processor, prompt):
    """True is an int in Python: without a check [True, 5] would be the prompt [1, 5]."""
    with pytest.raises(ValueError, match="token ids must be ints, got the bool"):
        processor.process(prompt)


@pytest.mark.parametrize("ids", [[True, 5], (5, False), [5, np.bool_(True)], np.array([True])])
def test_the_core_path_refuses_bools_too(ids):
    """int_list converts the ids the engine core is handed directly (no Processor)."""
    with pytest.raises(ValueError, match="got the bool"):
        int_list(ids)
    assert int_list([5, np.int64(6)]) == [5, 6]
    assert int_list(t for t in (5, 6)) == [5, 6]  # read once: the bool check must not use it up


def test_text_needs_a_tokenizer():
    with pytest.raises(ValueError, match="no tokenizer"):
        Processor(None, 16, 200).process({"prompt": "hi"})
    assert Processor(None, 16, 200).process([5]).token_ids == [5]


def test_max_tokens_must_fit_the_context_left_by_the_prompt():
    validate_max_tokens(10, 6, 16)  # 10 + 6 == 16: the whole context, accepted
    with pytest.raises(ValueError) as caught:
        validate_max_tokens(10, 7, 16)
    message = str(caught.value)  # the numbers a caller needs: prompt, max_tokens, their sum, max_model_len, room
    for number in ("16 tokens", "17 tokens", "10 in the prompt", "max_tokens=7", "at most 6"):
        assert number in message, message


@pytest.mark.parametrize("kind", ["sampling", "beam"])
def test_the_engine_refuses_max_tokens_past_the_context_instead_of_clamping(kind):
    """Offline (LLMEngine.add_request, as LLM.generate calls it): prompt + max_tokens ==
    max_model_len runs to exactly max_tokens; one token more is a ValueError and queues
    nothing (it used to be cut to the context left, silently)."""
    engine = make_engine(EngineConfig(block_size=4, num_blocks=32, max_model_len=16, max_num_seqs=4,
                                      max_num_batched_tokens=16, attention_backend="reference"))
    prompt = {"prompt_token_ids": [5] * 10}

    def params(max_tokens):
        if kind == "beam":
            return BeamSearchParams(beam_width=2, max_tokens=max_tokens, ignore_eos=True)
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    with pytest.raises(ValueError, match="maximum context length is 16 tokens.*17 tokens"):
        engine.add_request("too-long", prompt, params(7))
    assert not engine.has_unfinished_requests()
    engine.add_request("fits", prompt, params(6))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and all(len(c.token_ids) == 6 for c in final.outputs)
