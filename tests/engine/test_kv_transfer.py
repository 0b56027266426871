"""Disaggregated prefill / decode inside one process (paged_jax/engine/kv_transfer.py).

A prefill engine computes each prompt (max_tokens=1) and exports its cached blocks'
K/V; a decode engine imports them and generates. The decode engine's greedy output
must equal one engine's doing everything, it must actually use the imported blocks
(its prefix-cache hits are the imported tokens, and its blocks hold the prefill
engine's K/V bit for bit), and a bad PromptKV is refused before anything is registered.
"""

import dataclasses

import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.kv_transfer import PromptKV
from paged_jax.engine.llm_engine import LLMEngine

CONFIG = EngineConfig(block_size=4, num_blocks=96, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                      seq_buckets=(4,), token_buckets=(32,), attention_backend="reference", kv_transfer=True)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(engine, requests):
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 250, n)] for n in (3, 4, 9, 16, 23, 30)]


def test_decode_engine_continues_from_the_prefill_engines_blocks(tiny_llama, prompts):
    reference = _run(LLMEngine(tiny_llama, CONFIG), [(str(i), p, GREEDY) for i, p in enumerate(prompts)])
    prefill, decode = LLMEngine(tiny_llama, CONFIG), LLMEngine(tiny_llama, CONFIG)
    _run(prefill, [(str(i), p, dataclasses.replace(GREEDY, max_tokens=1)) for i, p in enumerate(prompts)])
    imported = 0
    for i, prompt in enumerate(prompts):
        kv = prefill.export_prompt_kv(prompt)
        full_blocks = (len(prompt) - 1) // CONFIG.block_size
        if full_blocks == 0:
            assert kv is None
            continue
        assert kv.num_blocks == full_blocks and kv.token_ids == tuple(prompt[: full_blocks * CONFIG.block_size])
        assert decode.import_prompt_kv(kv) == full_blocks
        imported += full_blocks
        # the decode engine's cached blocks now hold exactly the prefill engine's K/V
        hits = decode.block_manager.find_cached_prefix(lambda s, e: prompt[s:e], len(prompt))
        k, v = decode.runner.read_blocks([b.block_id for b in hits])
        np.testing.assert_array_equal(k, kv.k)
        np.testing.assert_array_equal(v, kv.v)
    outputs = _run(decode, [(str(i), p, GREEDY) for i, p in enumerate(prompts)])
    assert outputs == reference
    stats = decode.stats()
    assert stats["num_imported_blocks"] == imported > 0
    assert stats["prefix_cache_hit_tokens"] == imported * CONFIG.block_size  # every imported block was used
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_importing_what_is_cached_writes_nothing_and_bad_kv_is_refused(tiny_llama, prompts):
    prefill, decode = LLMEngine(tiny_llama, CONFIG), LLMEngine(tiny_llama, CONFIG)
    prompt = prompts[-1]
    _run(prefill, [("p", prompt, dataclasses.replace(GREEDY, max_tokens=1))])
    kv = prefill.export_prompt_kv(prompt)
    assert decode.import_prompt_kv(kv) == kv.num_blocks
    assert decode.import_prompt_kv(kv) == 0  # all cached already
    cached = decode.stats()["num_blocks_cached"]
    wrong = PromptKV(kv.token_ids[:4], 4, kv.k[:, :1, :, :, :-1].copy(), kv.v[:, :1, :, :, :-1].copy())
    other = LLMEngine(tiny_llama, CONFIG)
    with pytest.raises(ValueError, match="must be float32"):
        other.import_prompt_kv(wrong)
    assert other.stats()["num_blocks_cached"] == 0  # nothing registered under the wrong K/V
    assert decode.stats()["num_blocks_cached"] == cached
    with pytest.raises(ValueError, match="kv_transfer=True"):
        LLMEngine(tiny_llama, dataclasses.replace(CONFIG, kv_transfer=False)).export_prompt_kv(prompt)


@pytest.mark.parametrize("connector_name", ["host_memory", "jax_transfer"])
def test_connectors_carry_the_prompt_kv(tiny_llama, prompts, connector_name):
    """save on one side, load on the other (jax_transfer: two transfer servers, as two
    processes would hold), then the decode engine's greedy output equals one engine's."""
    from paged_jax.engine.kv_connector import make_connector
    producer = make_connector(connector_name)
    consumer = producer if connector_name == "host_memory" else make_connector(connector_name)
    prompt = prompts[-1]
    reference = _run(LLMEngine(tiny_llama, CONFIG), [("r", prompt, GREEDY)])
    prefill, decode = LLMEngine(tiny_llama, CONFIG), LLMEngine(tiny_llama, CONFIG)
    _run(prefill, [("r", prompt, dataclasses.replace(GREEDY, max_tokens=1))])
    sent = prefill.export_prompt_kv(prompt)
    params = producer.save("r", sent)
    import json
    params = json.loads(json.dumps(params))  # what travels with the request is JSON
    received = consumer.load(params, prompt)
    np.testing.assert_array_equal(received.k, sent.k)
    np.testing.assert_array_equal(received.v, sent.v)
    assert received.token_ids == sent.token_ids
    assert decode.import_prompt_kv(received) == sent.num_blocks
    assert _run(decode, [("r", prompt, GREEDY)]) == reference
    if connector_name == "host_memory":
        with pytest.raises(KeyError, match="loaded already"):
            consumer.load(params, prompt)
