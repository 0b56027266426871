"""Schema fuzzing of the OpenAI-compatible server: every endpoint, from its own OpenAPI schema.

    python -m experiments.fuzz_server                      # SmolLM2-135M, 400 cases per endpoint (~6-8 min here)
    python -m experiments.fuzz_server --max_examples=20 --seconds=120 --output=fuzz_server_dry   # a quick run

Why: tests/entrypoints/test_server_errors.py checks the bad inputs someone thought of;
this lets schemathesis think of others. The server documents what it accepts (its
/openapi.json: types, ranges, enums, which arguments need which; protocol.py and
openapi_docs.py), and experiments/benchmarks/schema_fuzz.py sends, for every operation,
up to --max_examples cases generated from it, half valid by the schema and half
violating it somewhere, within --seconds for all (each operation gets the time left
divided by the operations left). The contract: every response is a 2xx or a 4xx in
OpenAI's error shape, never a 5xx or a hang (--request_timeout_s, a stream read to its
end), JSON where JSON is documented, matching the documented response schema. Cases the
schema allows but that only cost time (max_tokens 500, n 128) are lowered to
--case_max_tokens and --case_n (schema_fuzz.bound_generation_cost).

Afterwards the engine must still be the engine: a greedy completion and a greedy chat
answer, generated offline on the same engine before the server started, are asked again
and compared token for token; /health is 200 and every KV block is free again.

How: one LLMEngine with small buckets (tests/helpers/server_harness.py's settings) serves
in-process on loopback (`BackgroundServer(build_app(engine, ...))`, --api_key on, the
body limit --max_request_body_bytes). Writes experiments/results/<output>.json with the
figures per operation (cases by mode, status classes and codes, failures grouped with
their smallest reproducer, negative cases the server accepted, seconds, the slowest
case) and the final checks; exits non-zero when a failure or a check failed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model: any paged_jax.loading.load_model source with a "
                                                      "tokenizer.")
_MAX_EXAMPLES = flags.DEFINE_integer("max_examples", 400, "Cases per endpoint (half of them negative, where the "
                                                          "schema has anything to violate).")
_SECONDS = flags.DEFINE_float("seconds", 480.0, "Fuzzing time for all endpoints together, seconds.")
_REQUEST_TIMEOUT = flags.DEFINE_float("request_timeout_s", 60.0, "A response (a stream read whole) slower than "
                                                                 "this is a hang, seconds.")
_NEGATIVE = flags.DEFINE_boolean("negative", True, "Also cases that violate the schema.")
_SEED = flags.DEFINE_integer("seed", 0, "Hypothesis seed (-1: random); the engine's seed too.")
_CASE_MAX_TOKENS = flags.DEFINE_integer("case_max_tokens", 4, "Generated max_tokens above this (or none) become "
                                                              "this: the cost bound of one case.")
_CASE_N = flags.DEFINE_integer("case_n", 2, "Generated n in (case_n, 128] becomes this.")
_API_KEY = flags.DEFINE_string("api_key", "fuzz-key", "The server's --api_key (every case sends it).")
_MAX_BODY = flags.DEFINE_integer("max_request_body_bytes", 64 * 1024, "ServerSettings.max_request_body_bytes.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "EngineConfig.block_size.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 160, "EngineConfig.num_blocks.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "EngineConfig.max_model_len.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "EngineConfig.max_num_seqs.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 128, "EngineConfig.max_num_batched_tokens.")
_SEQ_BUCKETS = flags.DEFINE_list("seq_buckets", ["4", "16"], "EngineConfig.seq_buckets.")
_TOKEN_BUCKETS = flags.DEFINE_list("token_buckets", ["16", "64", "128"], "EngineConfig.token_buckets.")
# "scan": as tests/helpers/server_harness.py (SmolLM2's 30 layers unrolled compile for longer per shape)
_LAYER_LOOP = flags.DEFINE_enum("layer_loop", "scan", ["auto", "unroll", "scan"], "EngineConfig.layer_loop.")
_OUTPUT = flags.DEFINE_string("output", "fuzz_server", "Result name: experiments/results/<output>.json.")

COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY_TOKENS = 16


def offline_greedy(engine, tokenizer) -> dict:
    """{"completion" | "chat": {"token_ids", "text", "finish_reason"}}: the engine's own
    greedy answers, before the server owns it (chat: the template rendered as the server does)."""
    from paged_jax.core.sampling_params import SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS)
    chat_ids = list(tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    engine.add_request("completion", COMPLETION_PROMPT, greedy)
    engine.add_request("chat", {"prompt_token_ids": chat_ids}, greedy)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                finals[out.request_id] = {"token_ids": list(c.token_ids), "text": c.text,
                                          "finish_reason": c.finish_reason}
    return finals


def final_checks(server, engine, name: str, offline: dict) -> dict:
    """After the fuzz: the greedy answers equal the offline ones, /health is 200, the engine is
    idle with every KV block free."""
    import httpx

    from experiments.benchmarks.schema_fuzz import served_greedy
    key = _API_KEY.value
    served = {"completion": served_greedy(server.base_url, key, name, prompt=COMPLETION_PROMPT,
                                          max_tokens=GREEDY_TOKENS),
              "chat": served_greedy(server.base_url, key, name, messages=CHAT_MESSAGES, max_tokens=GREEDY_TOKENS)}
    greedy = {k: {"offline": offline[k], "served": served[k],
                  "equal": all(served[k][f] == offline[k][f] for f in ("token_ids", "text", "finish_reason"))}
              for k in served}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s = server.loop.stats()
        if not (s["num_running"] or s["num_waiting"] or s.get("num_swapped", 0) or s["num_pending"]):
            break
        time.sleep(0.05)
    time.sleep(0.1)
    bm = engine.block_manager
    return {"greedy": greedy, "greedy_equal": all(g["equal"] for g in greedy.values()),
            "health_status": httpx.get(server.base_url + "/health", timeout=30).status_code,
            "free_blocks": bm.num_free_blocks, "usable_blocks": bm.num_usable_blocks,
            "all_blocks_free": bm.num_free_blocks == bm.num_usable_blocks}


class _Progress:
    """One tqdm bar per operation (cases sent of max_examples), closed with a summary line."""

    def __init__(self):
        self.bar, self.label = None, None

    def __call__(self, label: str, done: int, total: int) -> None:
        from tqdm import tqdm
        if label != self.label:
            self.close()
            self.bar, self.label = tqdm(total=total, desc=label, unit="case", leave=False), label
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.label = None, None


def _line(report) -> str:
    d = report.to_dict()
    codes = " ".join(f"{k}:{v}" for k, v in d["status_codes"].items())
    return (f"{report.label:<26} {d['cases']:>4} cases ({d['by_mode']['positive']} positive, "
            f"{d['by_mode']['negative']} negative) [{codes}] failures {d['num_failures']}, negative accepted "
            f"{d['num_negative_accepted']}, {d['seconds']:.0f} s (slowest {d['slowest_case_s']:.1f} s; "
            f"{d['stopped_by']})")


def main(argv):
    del argv
    from experiments.benchmarks.schema_fuzz import FuzzConfig, bound_generation_cost, fuzz
    from experiments.reporting.results_io import write_result
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.entrypoints.openai import ServerSettings, build_app
    from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
    from paged_jax.loading import load_model
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

    start = time.perf_counter()
    loaded = load_model(_MODEL.value)
    if loaded.tokenizer is None:
        raise app.UsageError(f"{loaded.source} has no tokenizer: the text routes cannot be fuzzed")
    config = EngineConfig(block_size=_BLOCK_SIZE.value, num_blocks=_NUM_BLOCKS.value,
                          max_model_len=_MAX_MODEL_LEN.value, max_num_seqs=_MAX_NUM_SEQS.value,
                          max_num_batched_tokens=_MAX_BATCHED.value, layer_loop=_LAYER_LOOP.value,
                          seq_buckets=tuple(int(b) for b in _SEQ_BUCKETS.value),
                          token_buckets=tuple(int(b) for b in _TOKEN_BUCKETS.value), seed=max(_SEED.value, 0))
    engine = LLMEngine(loaded, config)
    offline = offline_greedy(engine, loaded.tokenizer)
    setup_s = time.perf_counter() - start
    name = _MODEL.value if os.sep not in _MODEL.value else os.path.basename(_MODEL.value.rstrip(os.sep))
    print(f"engine ready in {setup_s:.0f} s; offline greedy: {json.dumps({k: v['text'] for k, v in offline.items()})}",
          flush=True)
    fuzz_config = FuzzConfig(max_examples=_MAX_EXAMPLES.value, seconds=_SECONDS.value,
                             request_timeout_s=_REQUEST_TIMEOUT.value, negative=_NEGATIVE.value,
                             seed=None if _SEED.value < 0 else _SEED.value)
    prepare = functools.partial(bound_generation_cost, max_tokens=_CASE_MAX_TOKENS.value, n=_CASE_N.value)
    server = BackgroundServer(build_app(engine, ServerSettings(served_model_name=name, api_key=_API_KEY.value,
                                                               max_request_body_bytes=_MAX_BODY.value)))
    progress = _Progress()
    try:
        def on_operation(report) -> None:
            progress.close()
            print(_line(report), flush=True)

        report = fuzz(server.base_url, _API_KEY.value, fuzz_config, prepare=prepare, progress=progress,
                      on_operation=on_operation)
        checks = final_checks(server, engine, name, offline)
    finally:
        progress.close()
        server.stop()

    operations = report.to_dict()
    figures = {
        "model": loaded.source, "served_model_name": name,
        "versions": {p: importlib.metadata.version(p) for p in ("schemathesis", "hypothesis", "fastapi", "pydantic")},
        "fuzz": {"max_examples": fuzz_config.max_examples, "seconds_budget": fuzz_config.seconds,
                 "request_timeout_s": fuzz_config.request_timeout_s, "negative": fuzz_config.negative,
                 "seed": fuzz_config.seed, "case_max_tokens": _CASE_MAX_TOKENS.value, "case_n": _CASE_N.value},
        **operations,
        "num_negative_accepted": sum(o["num_negative_accepted"] for o in operations["operations"].values()),
        "checks": checks,
        "engine_setup_s": round(setup_s, 1),
        "engine_settings": {"block_size": config.block_size, "num_blocks": config.num_blocks,
                            "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
                            "max_num_batched_tokens": config.max_num_batched_tokens,
                            "layer_loop": engine.config.layer_loop, "seq_buckets": list(config.seq_buckets),
                            "token_buckets": list(config.token_buckets)},
        "load_average_end": os.getloadavg(),
    }
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    print(f"{operations['cases']} cases on {operations['num_operations']} operations in {operations['seconds']:.0f} s: "
          f"{operations['num_failures']} failures, {figures['num_negative_accepted']} negative cases accepted; "
          f"greedy after the fuzz equal to offline: {checks['greedy_equal']}, /health {checks['health_status']}, "
          f"all KV blocks free: {checks['all_blocks_free']}")
    ok = operations["num_failures"] == 0 and checks["greedy_equal"] and checks["health_status"] == 200 \
        and checks["all_blocks_free"]
    if not ok:
        for label, op in operations["operations"].items():
            for group in op["failures"]:
                print(f"FAILURE {label}: {group['kind']} ({group['count']}x) {group['detail']}\n  reproducer: "
                      f"{json.dumps(group['reproducer'], default=str)[:2000]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
