"""Disaggregated prefill / decode through the OpenAI server (vLLM's kv_transfer_params).

A prefill server answers a `do_remote_decode` request with the params of the prompt's
saved K/V; a decode server given those params pulls them, adopts them and generates.
The decode server's greedy tokens must equal one plain server's, it must really use the
K/V (imported blocks, prefix-cache hits), and misuse is a 400 that names the argument.
The connector is the in-process one (both servers live in this process); the transfer
server between processes is tested in tests/experiments/test_disagg_prefill_decode.py.
"""

import httpx
import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine.kv_connector import HostMemoryConnector
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer

MODEL = "tiny"
CONFIG = EngineConfig(block_size=4, num_blocks=96, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                      seq_buckets=(4,), token_buckets=(32,), attention_backend="reference", kv_transfer=True)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 250, 21)]  # 5 full blocks before the last token


@pytest.fixture(scope="module")
def servers(tiny_llama):
    connector = HostMemoryConnector()
    settings = ServerSettings(served_model_name=MODEL)
    built = {name: BackgroundServer(build_app(LLMEngine(tiny_llama, CONFIG), settings, kv_connector=connector),
                                    grace=0.5)
             for name in ("plain", "prefill", "decode")}
    built["no_connector"] = BackgroundServer(build_app(LLMEngine(tiny_llama, CONFIG), settings), grace=0.5)
    yield built
    for server in built.values():
        server.stop()


def _post(server, **body):
    return httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body},
                      timeout=60)


def test_prefill_then_decode_equals_one_server(servers):
    reference = _post(servers["plain"], max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    assert reference.status_code == 200, reference.text
    prefill = _post(servers["prefill"], max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
    assert prefill.status_code == 200, prefill.text
    params = prefill.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["connector"] == "host_memory"
    assert params["num_tokens"] == 20 and params["shape"][1] == 5
    decoded = _post(servers["decode"], max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True,
                    kv_transfer_params=params)
    assert decoded.status_code == 200, decoded.text
    assert decoded.json()["choices"][0]["token_ids"] == reference.json()["choices"][0]["token_ids"]
    assert "kv_transfer_params" not in decoded.json()
    stats = servers["decode"].loop.stats()
    assert stats["num_imported_blocks"] == 5
    assert stats["prefix_cache_hit_tokens"] == 20  # the request ran on the imported blocks
    again = _post(servers["decode"], max_tokens=2, kv_transfer_params=params)  # the K/V were taken once
    assert again.status_code == 400 and again.json()["error"]["param"] == "kv_transfer_params"


@pytest.mark.parametrize("server, body, message", [
    ("no_connector", {"kv_transfer_params": {"do_remote_decode": True}}, "--kv_connector"),
    ("prefill", {"kv_transfer_params": {}}, "exactly one of"),
    ("prefill", {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": True}}, "exactly one of"),
    ("prefill", {"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "stream"),
    ("prefill", {"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "n = 1"),
    ("decode", {"kv_transfer_params": {"do_remote_prefill": True, "connector": "host_memory"}}, "can load"),
])
def test_misuse_is_a_400(servers, server, body, message):
    response = _post(servers[server], max_tokens=2, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and message in error["message"], error
