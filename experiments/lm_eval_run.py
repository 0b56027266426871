"""lm-evaluation-harness against our OpenAI-compatible server, checked against transformers.

    python -m experiments.lm_eval_run                     # SmolLM2-135M, the two local tasks in tests/data/lm_eval
    python -m experiments.lm_eval_run --tokenizer_backend=huggingface --output=lm_eval_smollm2_hf_tokenizer

Why: tests/entrypoints/test_lm_eval.py shows that `lm-eval --model local-completions`
works against the server (completions `echo` + `logprobs`, `/tokenize`, `/detokenize`,
`/tokenizer_info`), but on a tiny random-weight model. This is the same flow once on a
real model, recorded: what lm-eval reports for it, and whether every number lm-eval got
from us is the right one.

How: the model (--model, any `paged_jax.loading.load_model` source; float32) is served
in-process on loopback (`BackgroundServer(build_app(engine, ...))`, one engine with the
small engine settings below). Before the server starts, lm-eval's own task code builds
the tasks' requests in this process, and every generate-until request runs offline,
greedily, on the same engine (its prompt token ids as lm-eval encodes them, its
max_gen_toks, its `until` plus the EOS string, as local-completions sends them). Then
the lm-eval CLI runs as a subprocess (`python -m lm_eval --model local-completions
--tasks ... --include_path ... --log_samples --batch_size ...`, hub and datasets offline,
from the repository root; --timeout_s; on failure its stderr tail is printed and this
exits non-zero), and its results_*.json and samples_*.jsonl are read back:
  metrics          per task, as lm-eval reports them
  loglikelihoods   every loglikelihood request in the samples (multiple-choice and
                   loglikelihood tasks; loglikelihood_rolling is not checked) against
                   transformers' log p(continuation | context) on the same weights
                   (torch float32, eager attention; for a GGUF source the GGUF through
                   transformers' own GGUF loader, as tests/conftest.py's smollm2_hf), the
                   pair encoded as lm-eval's TemplateAPI encodes it (trailing spaces of
                   the context moved to the continuation, the context's tokens a prefix of
                   the whole's, left-truncated to max_length - 1): max and mean |diff|
  accuracy         multiple-choice accuracy recomputed from our loglikelihoods and from
                   transformers' (argmax over each doc's choices vs the doc's answer),
                   against the acc lm-eval reports
  generations      each generate-until output lm-eval got (prompt, ours) and whether it
                   equals the offline engine's greedy text for the same prompt token ids
  wall             the lm-eval run's wall time (server and engine already warm)
Needs the test extra (torch, transformers' GGUF support via accelerate, lm-eval[api]):
torch is imported here, after the lm-eval run, for the reference only.
Writes experiments/results/<output>.json.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# torch's OpenMP threads spin at every barrier by default (see peer_hf.py); set before torch loads
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model: any paged_jax.loading.load_model source (a GGUF or "
                                                      "a Hugging Face directory: transformers loads the reference).")
_TASKS = flags.DEFINE_string("tasks", "paged_jax_mc,paged_jax_generate", "lm-eval --tasks (comma-separated).")
_INCLUDE_PATH = flags.DEFINE_string("include_path", "tests/data/lm_eval", "lm-eval --include_path (relative: to "
                                                                          "the repository root; '' for none).")
_TOKENIZER_BACKEND = flags.DEFINE_enum("tokenizer_backend", "remote", ["remote", "huggingface"],
                                       "local-completions tokenizer_backend: 'remote' reads the server's "
                                       "/tokenizer_info and /tokenize; 'huggingface' loads the served tokenizer, "
                                       "saved into a temporary directory (no hub access).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 4, "lm-eval --batch_size (prompts per completions request).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Limit on the lm-eval subprocess, seconds.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "EngineConfig.block_size.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "EngineConfig.max_model_len; also lm-eval's "
                                                             "max_length, so it truncates to what the server takes.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 8, "EngineConfig.max_num_seqs.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "EngineConfig.max_num_batched_tokens.")
_SEQ_BUCKETS = flags.DEFINE_list("seq_buckets", ["8"], "EngineConfig.seq_buckets: few buckets, few warm-up "
                                                       "compiles (every seq x token bucket is compiled).")
_TOKEN_BUCKETS = flags.DEFINE_list("token_buckets", ["8", "64", "256"], "EngineConfig.token_buckets.")
_KV_GIB = flags.DEFINE_float("kv_cache_gib", 0.5, "KV cache budget, GiB.")
# "scan": as tests/helpers/server_harness.py; SmolLM2's 30 layers unrolled (the CPU default)
# compile for several seconds longer per shape, and this run is about correctness, not speed
_LAYER_LOOP = flags.DEFINE_enum("layer_loop", "scan", ["auto", "unroll", "scan"], "EngineConfig.layer_loop.")
_SEED = flags.DEFINE_integer("seed", 0, "Engine seed (greedy everywhere: it changes nothing lm-eval sees).")
_OUTPUT = flags.DEFINE_string("output", "lm_eval_smollm2", "Result name: experiments/results/<output>.json.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-3  # |ours - transformers| a loglikelihood may differ by (tests/entrypoints/test_lm_eval.py's)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _gen_key(context: str, gen_kwargs: dict) -> str:
    return json.dumps([context, gen_kwargs], sort_keys=True, default=str)


def encode_pair(tokenizer, context: str, continuation: str, max_length: int) -> tuple[list[int], int]:
    """(tokens, ctxlen) of one loglikelihood request as lm-eval's TemplateAPI sends it:
    `TemplateLM.loglikelihood` / `_encode_pair` (no special tokens; an empty context is the
    prefix token) and `batch_loglikelihood_requests` (left-truncated to max_length - 1)."""
    def enc(text):
        return list(tokenizer.encode(text, add_special_tokens=False))
    if context == "":
        continuation_enc = enc(continuation)
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        context_enc, continuation_enc = (([prefix], continuation_enc) if prefix != continuation_enc[0]
                                         else (continuation_enc[:1], continuation_enc[1:]))
    else:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = enc(context + continuation)
        context_enc = enc(context)
        continuation_enc = whole[len(context_enc):]
    limit = max_length - 1  # TemplateAPI: self.max_length = max_length - 1
    tokens = (context_enc + continuation_enc)[-limit:]
    ctxlen = len(context_enc) - max(0, len(context_enc) + len(continuation_enc) - limit)
    return tokens, ctxlen


def build_requests(tasks: list[str], include_path: str | None) -> tuple[dict, dict]:
    """lm-eval's own task code, in this process: ({task: output_type}, {task: [(context,
    gen_kwargs)]} of the generate-until requests), as the CLI will build them."""
    from lm_eval.tasks import TaskManager
    loaded = TaskManager(include_path=include_path).load(tasks)
    types, generate = {}, {}
    for name, task in loaded["tasks"].items():
        types[name] = task.get_config("output_type")
        if types[name] == "generate_until":
            task.build_all_requests(limit=None, rank=0, world_size=1)
            generate[name] = [tuple(i.args[:2]) for i in task.instances if i.request_type == "generate_until"]
    return types, generate


def offline_generations(engine, tokenizer, requests: list[tuple[str, dict]], max_length: int) -> dict:
    """_gen_key(context, gen_kwargs) -> the engine's text for each greedy request, its prompt
    as local-completions sends it: token ids without special tokens, left-truncated to
    max_length - 1 - max_gen_toks, max_tokens max_gen_toks, stop `until` + the EOS string.
    Sampled requests (temperature > 0) are left out: there is no one right output."""
    from paged_jax.core.sampling_params import SamplingParams
    keys = {}
    for i, (context, gen_kwargs) in enumerate(requests):
        if float(gen_kwargs.get("temperature", 0) or 0) != 0 or gen_kwargs.get("do_sample"):
            continue
        max_tokens = int(gen_kwargs.get("max_tokens", gen_kwargs.get("max_gen_toks", 256)))
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        if tokenizer.eos_token is not None and tokenizer.eos_token not in until:
            until.append(tokenizer.eos_token)
        ids = list(tokenizer.encode(context, add_special_tokens=False))[-(max_length - 1 - max_tokens):]
        engine.add_request(f"gen-{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=max_tokens, stop=until))
        keys[f"gen-{i}"] = _gen_key(context, gen_kwargs)
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[keys[out.request_id]] = out.outputs[0].text
    return texts


def run_lm_eval(base_url: str, served_name: str, output_path: str, tokenizer_dir: str | None) -> tuple[float, str]:
    """The lm-eval CLI against the server; (wall seconds, stdout). Exits on failure."""
    model_args = (f"model={served_name},base_url={base_url}/v1/completions,"
                  f"tokenizer_backend={_TOKENIZER_BACKEND.value},num_concurrent=1,max_retries=1,"
                  f"max_length={_MAX_MODEL_LEN.value}")
    if tokenizer_dir is not None:
        model_args += f",tokenizer={tokenizer_dir}"
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--tasks", _TASKS.value, "--output_path", output_path, "--log_samples",
               "--batch_size", str(_BATCH_SIZE.value)]
    if _INCLUDE_PATH.value:
        command += ["--include_path", _INCLUDE_PATH.value]
    print("running", " ".join(command), flush=True)
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=REPO, env={**os.environ, **OFFLINE_ENV}, capture_output=True,
                                text=True, timeout=_TIMEOUT.value)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-5000:]
        print(f"lm-eval did not finish in {_TIMEOUT.value} s; its stderr ends:\n"
              f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}", file=sys.stderr)
        sys.exit(1)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        print(f"lm-eval exited with {result.returncode}; its stdout ends:\n{result.stdout[-2000:]}\n"
              f"its stderr ends:\n{result.stderr[-5000:]}", file=sys.stderr)
        sys.exit(1)
    return wall, result.stdout


def _one(pattern: str) -> str:
    found = sorted(glob.glob(pattern, recursive=True))
    if len(found) != 1:
        sys.exit(f"expected one file matching {pattern}, found {found}")
    return found[0]


def reported_metrics(results: dict) -> dict:
    """{task: {metric,filter: value}} as lm-eval reports them (its alias left out)."""
    return {task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in results.items()}


def load_reference(loaded):
    """transformers' model on the same weights (float32, eager attention)."""
    import torch
    import transformers
    if loaded.kind == "gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(loaded.source), gguf_file=os.path.basename(loaded.source), dtype=torch.float32,
            attn_implementation="eager")
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.source, dtype=torch.float32,
                                                               attn_implementation="eager")
    return hf.eval()


def reference_loglikelihood(hf, tokens: list[int], ctxlen: int) -> float:
    """sum of log p(tokens[i] | tokens[:i]) for i >= ctxlen, in float64 from float32 logits."""
    import torch
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), dim=-1)
    return float(sum(logprobs[i - 1, tokens[i]] for i in range(ctxlen, len(tokens))))


def _gold(sample: dict):
    target = sample.get("target")
    try:
        return int(target)
    except (TypeError, ValueError):
        return None  # several golds, or a gold given as text: not recomputed


def check_loglikelihoods(hf, tokenizer, samples: dict, types: dict, reported: dict) -> dict:
    """Every loglikelihood request of the samples against transformers; multiple-choice
    accuracy from both sides against lm-eval's."""
    rows, accuracy = [], {}
    for task, task_samples in samples.items():
        if types.get(task) not in ("multiple_choice", "loglikelihood"):
            continue
        hits, same = {"ours": [], "transformers": []}, []
        for sample in task_samples:
            pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
            ours = [float(resp[0][0]) for resp in sample["resps"]]
            theirs = []
            for (context, continuation), mine in zip(pairs, ours):
                tokens, ctxlen = encode_pair(tokenizer, context, continuation, _MAX_MODEL_LEN.value)
                theirs.append(reference_loglikelihood(hf, tokens, ctxlen))
                rows.append({"task": task, "doc_id": sample.get("doc_id"), "context": context,
                             "continuation": continuation, "continuation_tokens": len(tokens) - ctxlen,
                             "ours": round(mine, 6), "transformers": round(theirs[-1], 6),
                             "abs_diff": abs(mine - theirs[-1])})
            gold = _gold(sample)
            if types[task] == "multiple_choice" and gold is not None:
                preds = [max(range(len(lls)), key=lambda i: (lls[i], -i)) for lls in (ours, theirs)]  # first max
                hits["ours"].append(preds[0] == gold)
                hits["transformers"].append(preds[1] == gold)
                same.append(preds[0] == preds[1])
        if types[task] == "multiple_choice" and hits["ours"]:
            acc = {side: statistics.mean(h) for side, h in hits.items()}
            lm_eval_acc = (reported.get(task) or {}).get("acc,none")
            accuracy[task] = {"lm_eval": lm_eval_acc, "from_our_loglikelihoods": acc["ours"],
                              "from_transformers_loglikelihoods": acc["transformers"],
                              "transformers_equals_lm_eval": lm_eval_acc is not None
                              and abs(acc["transformers"] - lm_eval_acc) < 1e-12,
                              "ours_equals_lm_eval": lm_eval_acc is not None and abs(acc["ours"] - lm_eval_acc) < 1e-12,
                              "docs": len(hits["ours"]), "same_prediction_docs": sum(same)}
    diffs = [r["abs_diff"] for r in rows]
    largest = sorted(rows, key=lambda r: -r["abs_diff"])[:5]
    return {"num_requests": len(rows),
            "max_abs_diff": max(diffs) if diffs else None,
            "mean_abs_diff": statistics.mean(diffs) if diffs else None,
            "tolerance": TOLERANCE, "over_tolerance": sum(d > TOLERANCE for d in diffs),
            "largest_diffs": [{**r, "abs_diff": float(f"{r['abs_diff']:.3g}")} for r in largest],
            "accuracy": accuracy}


def check_generations(samples: dict, types: dict, offline: dict) -> list[dict]:
    rows = []
    for task, task_samples in samples.items():
        if types.get(task) != "generate_until":
            continue
        for sample in task_samples:
            args = sample["arguments"]["gen_args_0"]
            ours = sample["resps"][0][0]
            expected = offline.get(_gen_key(args["arg_0"], args["arg_1"]))
            rows.append({"task": task, "prompt": args["arg_0"], "ours": ours, "offline": expected,
                         "equal_to_offline": None if expected is None else ours == expected})
    return rows


def main(argv):
    del argv
    import importlib.metadata

    os.chdir(REPO)  # task files name their data relative to the repository root
    os.environ.update(OFFLINE_ENV)
    from experiments.reporting.results_io import write_result
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.entrypoints.openai import ServerSettings, build_app
    from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
    from paged_jax.loading import load_model
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()

    tasks = [t for t in _TASKS.value.split(",") if t]
    start = time.perf_counter()
    loaded = load_model(_MODEL.value)
    if loaded.kind not in ("gguf", "hf"):
        raise app.UsageError(f"{loaded.source} is a {loaded.kind}: transformers has no loader for it (the reference)")
    if loaded.tokenizer is None:
        raise app.UsageError(f"{loaded.source} has no tokenizer: the server cannot serve text")
    tokenizer = loaded.tokenizer
    config = EngineConfig(block_size=_BLOCK_SIZE.value, kv_cache_memory_bytes=int(_KV_GIB.value * 2**30),
                          max_model_len=_MAX_MODEL_LEN.value, max_num_seqs=_MAX_NUM_SEQS.value,
                          max_num_batched_tokens=_MAX_BATCHED.value, layer_loop=_LAYER_LOOP.value,
                          seq_buckets=tuple(int(b) for b in _SEQ_BUCKETS.value),
                          token_buckets=tuple(int(b) for b in _TOKEN_BUCKETS.value), seed=_SEED.value)
    engine = LLMEngine(loaded, config)
    setup_s = time.perf_counter() - start
    print(f"engine ready in {setup_s:.0f} s", flush=True)

    types, generate = build_requests(tasks, _INCLUDE_PATH.value or None)
    offline = offline_generations(engine, tokenizer, [r for reqs in generate.values() for r in reqs],
                                  _MAX_MODEL_LEN.value)
    served_name = _MODEL.value if os.sep not in _MODEL.value else os.path.basename(_MODEL.value.rstrip(os.sep))
    work = tempfile.mkdtemp(prefix="lm_eval_run_")
    try:
        tokenizer_dir = None
        if _TOKENIZER_BACKEND.value == "huggingface":
            tokenizer_dir = os.path.join(work, "tokenizer")
            tokenizer.save_pretrained(tokenizer_dir)
        server = BackgroundServer(build_app(engine, ServerSettings(served_model_name=served_name)))
        try:
            wall, _ = run_lm_eval(server.base_url, served_name, os.path.join(work, "out"), tokenizer_dir)
        finally:
            server.stop()
        results_file = _one(os.path.join(work, "out", "**", "results_*.json"))
        with open(results_file) as f:
            results = json.load(f)
        samples = {task: _read_jsonl(_one(os.path.join(work, "out", "**", f"samples_{task}_*.jsonl")))
                   for task in results["results"] if task in types}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    reported = reported_metrics(results["results"])
    print("lm-eval:", json.dumps(reported), f"({wall:.0f} s)", flush=True)
    start = time.perf_counter()
    hf = load_reference(loaded)
    loglikelihoods = check_loglikelihoods(hf, tokenizer, samples, types, reported)
    reference_s = time.perf_counter() - start
    generations = check_generations(samples, types, offline)

    versions = {name: importlib.metadata.version(name) for name in ("lm_eval", "transformers", "torch")}
    figures = {"model": loaded.source, "served_model_name": served_name, "versions": versions,
               "lm_eval_version": versions["lm_eval"], "tasks": tasks, "output_types": types,
               "tokenizer_backend": _TOKENIZER_BACKEND.value, "metrics": reported,
               "n_samples": results.get("n-samples"), "loglikelihoods": loglikelihoods,
               "generations": generations,
               "generations_equal_to_offline": sum(bool(g["equal_to_offline"]) for g in generations),
               "generations_checked": sum(g["equal_to_offline"] is not None for g in generations),
               "lm_eval_wall_s": round(wall, 1), "engine_setup_s": round(setup_s, 1),
               "reference_s": round(reference_s, 1),
               "engine_settings": {"block_size": config.block_size, "max_model_len": config.max_model_len,
                                   "max_num_seqs": config.max_num_seqs,
                                   "max_num_batched_tokens": config.max_num_batched_tokens,
                                   "layer_loop": engine.config.layer_loop,
                                   "attention_backend": engine.config.attention_backend,
                                   "seq_buckets": list(config.seq_buckets), "token_buckets": list(config.token_buckets)},
               "load_average_end": os.getloadavg()}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    ll = loglikelihoods
    if ll["num_requests"]:
        print(f"{ll['num_requests']} loglikelihoods: max |ours - transformers| {ll['max_abs_diff']:.3g}, mean "
              f"{ll['mean_abs_diff']:.3g}; {ll['over_tolerance']} over {TOLERANCE:g}")
    for task, acc in ll["accuracy"].items():
        print(f"{task}: acc lm-eval {acc['lm_eval']}, from ours {acc['from_our_loglikelihoods']}, from transformers "
              f"{acc['from_transformers_loglikelihoods']}")
    for g in generations:
        print(f"{g['prompt']!r} -> {g['ours']!r} (offline {'equal' if g['equal_to_offline'] else g['offline']!r})")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
