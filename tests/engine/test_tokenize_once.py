"""A text prompt is tokenized once on its way in, by LLM and by LLMEngine.

LLM validates every prompt of a batch before it queues any; the engine then takes the
processed prompts as they are instead of tokenizing the text again (for a long prompt
the tokenizer is a good part of the host's work per request).
"""

import pytest

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import LoadedModel

SETTINGS = dict(block_size=8, num_blocks=64, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                seq_buckets=(4,), token_buckets=(32,))  # one shape to compile


class _CountingTokenizer:
    """One token per letter; counts the texts it encodes."""

    def __init__(self):
        self.encoded: list[str] = []

    def encode(self, text):
        self.encoded.append(text)
        return [3 + ord(ch) % 200 for ch in text]

    def decode(self, token_ids, skip_special_tokens=True, **kwargs):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


@pytest.fixture(scope="module")
def llm_and_tokenizer(tiny_llama):
    tokenizer = _CountingTokenizer()
    loaded = LoadedModel(tiny_llama.config, tiny_llama.params, tokenizer, "memory", "memory", 0.0)
    return LLM(loaded, **SETTINGS), tokenizer


def test_llm_generate_tokenizes_each_text_prompt_once(llm_and_tokenizer):
    llm, tokenizer = llm_and_tokenizer
    tokenizer.encoded.clear()
    outputs = llm.generate(["hello", {"prompt": "world", "cache_salt": "s"}],
                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert sorted(tokenizer.encoded) == ["hello", "world"]
    assert [o.prompt for o in outputs] == ["hello", "world"]
    assert [len(o.prompt_token_ids) for o in outputs] == [5, 5]


def test_llm_engine_add_request_tokenizes_a_text_prompt_once(llm_and_tokenizer):
    llm, tokenizer = llm_and_tokenizer
    tokenizer.encoded.clear()
    llm.engine.add_request("r", "again", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert tokenizer.encoded == ["again"]
