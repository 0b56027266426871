"""KV connectors: how a prompt's K/V (a PromptKV) travels from a prefill engine to a decode engine.

The shape is vLLM's KV-connector split, kept small: after prefill the producer side
`save`s a request's PromptKV and gets `kv_transfer_params` (a JSON-able dict the
request carries onward, as vLLM's responses and requests carry `kv_transfer_params`);
before decode the consumer side `load`s a PromptKV from those params and the prompt.
Which blocks leave is the engine's business (engine/kv_transfer.py: the prompt's cached
full blocks); the connector only moves arrays, so another transport plugs in by
implementing these two methods.

Transports here:
- `TransferServerConnector`: `jax.experimental.transfer`, the transfer server
  tpu-inference moves KV with: the producer registers the arrays under a random id
  (`await_pull`), the consumer connects to the producer's address and pulls them into
  its own device memory. Works between processes on CPU too (loopback).
- `HostMemoryConnector`: the fallback through host memory, for engines in one process
  (tests, notebooks): the params name an entry in the connector's own table.
"""

from __future__ import annotations

import secrets
import threading
from typing import Protocol

import numpy as np

from paged_jax.engine.kv_transfer import PromptKV


class KVConnector(Protocol):
    def save(self, request_id: str, kv: PromptKV) -> dict:
        """Offer `kv` to one consumer; returns the params that let it load them."""

    def load(self, params: dict, prompt_token_ids) -> PromptKV:
        """The PromptKV that `params` (from save) name, for this prompt."""


def _describe(kv: PromptKV) -> dict:
    return {"num_tokens": len(kv.token_ids), "block_size": kv.block_size, "shape": list(kv.k.shape),
            "dtype": str(kv.k.dtype), "cache_salt": kv.cache_salt}


def _prompt_kv(params: dict, prompt_token_ids, k: np.ndarray, v: np.ndarray) -> PromptKV:
    prompt = [int(t) for t in prompt_token_ids]
    n = int(params["num_tokens"])
    if n > len(prompt):
        raise ValueError(f"the K/V cover {n} tokens; the prompt has {len(prompt)}")
    return PromptKV(tuple(prompt[:n]), int(params["block_size"]), k, v, params.get("cache_salt"))


class HostMemoryConnector:
    """Producer and consumer in one process: save keeps the arrays, load takes them once."""

    def __init__(self):
        self._entries: dict[str, PromptKV] = {}
        self._lock = threading.Lock()

    def save(self, request_id: str, kv: PromptKV) -> dict:
        key = f"{request_id}-{secrets.token_hex(8)}"
        with self._lock:
            self._entries[key] = kv
        return {"connector": "host_memory", "key": key, **_describe(kv)}

    def load(self, params: dict, prompt_token_ids) -> PromptKV:
        with self._lock:
            kv = self._entries.pop(params["key"], None)
        if kv is None:
            raise KeyError(f"no saved K/V under {params['key']!r} (loaded already, or never saved here)")
        return _prompt_kv(params, prompt_token_ids, kv.k, kv.v)

    @property
    def num_pending(self) -> int:
        return len(self._entries)


class TransferServerConnector:
    """jax.experimental.transfer between processes: one transfer server per process,
    listening on `host` (loopback by default); `save` registers the arrays for one pull,
    `load` pulls from the address in the params (connections are kept per address)."""

    def __init__(self, host: str = "127.0.0.1"):
        import jax
        from jax.experimental import transfer
        self._jax = jax
        self._device = jax.devices()[0]
        self._server = transfer.start_transfer_server(self._device.client, f"{host}:0",
                                                      [f"{host}:0"] * jax.device_count())
        self._connections = {}
        self._lock = threading.Lock()
        self.num_saved = self.num_loaded = 0
        self.bytes_loaded = 0

    @property
    def address(self) -> str:
        return self._server.address()

    def save(self, request_id: str, kv: PromptKV) -> dict:
        del request_id
        uuid = secrets.randbits(62)
        arrays = [self._jax.device_put(a, self._device) for a in (kv.k, kv.v)]
        self._server.await_pull(uuid, arrays)  # held by the server until the consumer pulls them
        self.num_saved += 1
        return {"connector": "jax_transfer", "remote_address": self.address, "uuid": uuid, **_describe(kv)}

    def load(self, params: dict, prompt_token_ids) -> PromptKV:
        jax = self._jax
        address = params["remote_address"]
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = self._server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        spec = jax.ShapeDtypeStruct(tuple(params["shape"]), np.dtype(params["dtype"]), sharding=sharding)
        k, v = connection.pull(int(params["uuid"]), [spec, spec])
        k, v = np.asarray(k), np.asarray(v)
        self.num_loaded += 1
        self.bytes_loaded += k.nbytes + v.nbytes
        return _prompt_kv(params, prompt_token_ids, k, v)


def make_connector(name: str) -> KVConnector:
    if name == "jax_transfer":
        return TransferServerConnector()
    if name == "host_memory":
        return HostMemoryConnector()
    raise ValueError(f"unknown KV connector {name!r}; available: ['jax_transfer', 'host_memory']")
