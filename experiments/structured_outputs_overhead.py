"""What structured outputs cost the engine's step: 32 rows under a JSON schema vs none.

    python -m experiments.structured_outputs_overhead      # SmolLM2-135M-Instruct, bf16, 32 rows, 2 rounds (~1.5 min)
    python -m experiments.structured_outputs_overhead --rounds=1 --max_tokens=24 --nocompact --output=so_overhead_dry
                                                           # a quick run of the script

Why: a constrained request adds work to every step it samples in: the host fills the
row's token bitmask from its llguidance matcher (`StructuredOutputManager.bitmask`:
llguidance's executor fills the rows on its threads; on a CPU the runner calls it before
the model step, elsewhere while the dispatched step runs, `ModelRunner.overlap_host_work`); on the
device, the masked head unpacks the bitmask and masks the logits before the argmax
(paged_jax/worker/step_head.py); after the step, each matcher consumes its token
(`StructuredOutputManager.accept`, once per row). The target (the structured-outputs
issue) is <= 10% on the step with a JSON schema on every one of 32 rows. Here one
LLMEngine (max_num_seqs 32, seq bucket 32, token buckets 32 / 256, so warm-up compiles
little) serves --num_seqs requests of one chat prompt family ("describe a person as
JSON"), greedy, ignore_eos, max_tokens --max_tokens, all added at once, in these modes:
  unconstrained   no structured_outputs
  json            a JSON schema on every row (name / age / city / tags, bounded lengths),
                  disable_any_whitespace=False (llguidance's flexible whitespace)
  json_compact    (--compact) the same schema, disable_any_whitespace=True
A constrained completion stops once its JSON is complete, so the runs are compared per
*decode step with all 32 rows decoding* (every chunk one token that samples), not per
request; the unconstrained run's steps are cut to the same count as the constrained run
of its round (the same output positions, so the same context lengths). Per
such step the script records (by wrapping the engine's own methods, as
trace_step_breakdown.py wraps `run_batch`): the core's step wall (`EngineCore.step`),
the host bitmask (`bitmask`), the matchers' advance (`accept`, summed over the step's
rows), `ModelRunner.execute` (batch preparation + device), `run_batch` (device), and in
it the jitted model step (its dispatch; waited for only with --block_parts, which
serializes the bitmask after it) and the head, blocked on (the head is where the mask is
applied, and without --block_parts it includes waiting for the model step). The grammar compile time of the first constrained request (`check`: the
llguidance tokenizer, built once per engine, then the grammar) and the matcher creation
per sequence are recorded apart: they are not per step. Modes alternate in each of
--rounds rounds (A B C A B C: this VM is shared and noisy), after an untimed warm-up run
of each; medians per round and over all rounds. The overhead is given twice: the
step's (median constrained step / median unconstrained step - 1), which carries the
VM's noise (the jitted model step, the same computation in both, drifts by several ms
between runs), and its parts' (bitmask + accept + head + batch preparation, each the
constrained median minus the unconstrained one, over the unconstrained step). Writes
experiments/results/<output>.json.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source with a Hugging Face tokenizer).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "EngineConfig.dtype.")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 32, "Requests per run (and EngineConfig.max_num_seqs, seq bucket).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 96, "SamplingParams.max_tokens of every request (ignore_eos).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds of the modes, alternated (A B C A B C).")
_COMPACT = flags.DEFINE_boolean("compact", True, "Also run the schema with disable_any_whitespace=True.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "EngineConfig.max_num_batched_tokens "
                                                                   "(the larger token bucket).")
_KV_GIB = flags.DEFINE_float("kv_cache_gib", 0.25, "KV cache budget, GiB.")
_SEED = flags.DEFINE_integer("seed", 0, "Engine seed.")
_BLOCK_PARTS = flags.DEFINE_boolean(
    "block_parts", False, "Wait for the model step when timing it (exact model / head split, but the "
    "runner's overlap of the host bitmask with the model step is lost); off: `model` is its dispatch and "
    "`head` includes waiting for it, the step wall is what serving sees.")
_OUTPUT = flags.DEFINE_string("output", "structured_outputs_overhead",
                              "Result name: experiments/results/<output>.json.")

MAX_MODEL_LEN = 512
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "minLength": 1, "maxLength": 24},
        "bio": {"type": "string", "minLength": 1, "maxLength": 160},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 16},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags", "bio"],
    "additionalProperties": False,
}
_NAMES = ("Alice", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Gustav", "Hana")
_JOBS = ("baker", "nurse", "pilot", "teacher")
# per step, in this order: what the wrappers time
PARTS = ("step", "bitmask", "accept", "execute", "run_batch", "model", "head")


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of one family (a person as JSON; names and jobs vary), as token ids."""
    out = []
    for i in range(n):
        name, job = _NAMES[i % len(_NAMES)], _JOBS[(i // len(_NAMES)) % len(_JOBS)]
        message = (f"Describe a fictional {job} named {name} as a JSON object with the fields name, age, city, "
                   f"tags (one to three short words) and bio (one sentence). Reply with the JSON only.")
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def mode_params(mode: str, max_tokens: int):
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.core.structured_outputs import StructuredOutputsParams
    constraint = None
    if mode != "unconstrained":
        constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=mode == "json_compact")
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint)


class StepTimer:
    """Wraps an LLMEngine's core step, structured-output manager and runner to time each
    part of every step; `steps` holds one dict per core step (seconds, and whether it was a
    decode step of `rows` rows)."""

    def __init__(self, engine):
        import jax
        core, runner, manager = engine.core, engine.core.runner, engine.core.structured_outputs
        self.steps, self.checks, self.matchers = [], [], []
        self.current = None
        originals = {"step": core.step, "bitmask": manager.bitmask, "accept": manager.accept,
                     "execute": runner.execute, "run_batch": runner.run_batch, "model": runner._step,
                     "head": runner._heads.run, "check": manager.check, "matcher": manager.compiler.matcher}

        def timed(part, fn, block=False):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                result = fn(*args, **kwargs)
                if block:
                    jax.block_until_ready(result[0] if part == "model" else result)
                if self.current is not None:
                    self.current[part] = self.current.get(part, 0.0) + time.perf_counter() - start
                return result
            return wrapper

        def step():
            self.current = {}
            start = time.perf_counter()
            out = originals["step"]()
            self.current["step"] = time.perf_counter() - start
            if "execute" in self.current:  # a step that ran something
                self.steps.append(self.current)
            self.current = None
            return out

        def execute(output, seqs, **kwargs):
            chunks = output.chunks
            self.current["rows"] = len(chunks)
            self.current["decode"] = all(len(c.token_ids) == 1 and c.sample for c in chunks)
            self.current["masked"] = kwargs.get("token_bitmask") is not None
            return timed("execute", originals["execute"])(output, seqs, **kwargs)

        def apart(store, fn):  # a list attribute of this timer, read at call time
            def wrapper(*args):
                start = time.perf_counter()
                result = fn(*args)
                getattr(self, store).append(time.perf_counter() - start)
                return result
            return wrapper

        core.step, runner.execute = step, execute
        manager.bitmask, manager.accept = timed("bitmask", originals["bitmask"]), timed("accept", originals["accept"])
        runner.run_batch = timed("run_batch", originals["run_batch"])
        runner._step = timed("model", originals["model"], _BLOCK_PARTS.value)
        runner._heads.run = timed("head", originals["head"], True)
        manager.check = apart("checks", originals["check"])
        manager.compiler.matcher = apart("matchers", originals["matcher"])

    def decode_steps(self, rows: int) -> list[dict]:
        return [s for s in self.steps if s["decode"] and s["rows"] == rows]


def run_mode(engine, timer: StepTimer, prompt_ids, mode: str, max_tokens: int) -> dict:
    """All requests at once, stepped to the end; the decode steps at full batch and the outputs."""
    engine.reset_prefix_cache()  # every run prefills the same way
    params = mode_params(mode, max_tokens)
    timer.steps = []
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"{mode}-{i}", {"prompt_token_ids": ids}, params)
    outputs, start = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    wall = time.perf_counter() - start
    completions = [outputs[f"{mode}-{i}"] for i in range(len(prompt_ids))]
    return {"wall_s": wall, "steps": timer.steps, "decode": timer.decode_steps(len(prompt_ids)),
            "completions": completions}


def _median_ms(steps, part) -> float | None:
    values = [s.get(part, 0.0) for s in steps]
    return round(1e3 * statistics.median(values), 3) if values else None


def summarize(steps: list[dict]) -> dict:
    """Median milliseconds per part over these steps."""
    return {"steps": len(steps), **{f"{p}_ms": _median_ms(steps, p) for p in PARTS}}


def completions_summary(mode: str, completions) -> dict:
    lengths = [len(c.token_ids) for c in completions]
    row = {"mean_output_tokens": round(statistics.mean(lengths), 1), "min_output_tokens": min(lengths),
           "max_output_tokens": max(lengths),
           "finish_reasons": {r: sum(c.finish_reason == r for c in completions)
                              for r in sorted({c.finish_reason for c in completions})}}
    if mode != "unconstrained":
        valid = 0
        for c in completions:
            try:
                obj = json.loads(c.text)
            except ValueError:
                continue
            valid += isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
        row["valid_json_fraction"] = round(valid / len(completions), 4)
    row["example"] = completions[0].text
    return row


def overhead(base: dict, constrained: dict) -> dict:
    """Constrained over unconstrained per decode step: the step's fraction and its parts (ms)."""
    diff = lambda p: round(constrained[f"{p}_ms"] - base[f"{p}_ms"], 3)
    # batch preparation (the mask copy): execute outside run_batch, less the bitmask, which on a CPU the
    # runner computes there, before the batch (ModelRunner.overlap_host_work)
    outside = lambda r: r["execute_ms"] - r["run_batch_ms"] - r["bitmask_ms"]  # noqa: E731
    prepare = round(outside(constrained) - outside(base), 3)
    return {"step_overhead_fraction": round(constrained["step_ms"] / base["step_ms"] - 1, 4),
            # the jitted model step is the same computation in both (the mask is applied in the head):
            # its difference is the VM's noise, taken out here
            "step_overhead_fraction_net_of_model_drift": round(
                (diff("step") - diff("model")) / base["step_ms"], 4),
            # the parts timed on their own (less exposed to the noise than the whole step)
            "parts_overhead_fraction": round(
                (diff("bitmask") + diff("accept") + diff("head") + prepare) / base["step_ms"], 4),
            "step_ms_delta": diff("step"), "model_ms_delta": diff("model"), "bitmask_ms": constrained["bitmask_ms"],
            "accept_ms": constrained["accept_ms"], "accept_ms_delta": diff("accept"),
            "head_ms_delta": diff("head"), "run_batch_ms_delta": diff("run_batch"),
            "prepare_ms_delta": prepare}


def main(argv):
    del argv
    import os

    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import write_result
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    n = _NUM_SEQS.value
    loaded = load_for_benchmark(_MODEL.value, MAX_MODEL_LEN)
    if loaded.tokenizer is None:
        raise app.UsageError(f"--model={_MODEL.value} has no tokenizer: structured outputs need one")
    config = EngineConfig(max_num_seqs=n, max_num_batched_tokens=_MAX_BATCHED.value, seq_buckets=(n,),
                          token_buckets=(n, _MAX_BATCHED.value), max_model_len=MAX_MODEL_LEN, dtype=_DTYPE.value,
                          kv_cache_memory_bytes=int(_KV_GIB.value * 2**30), seed=_SEED.value)
    start = time.perf_counter()
    engine = LLMEngine(loaded, config, final_outputs_only=True)
    setup_s = time.perf_counter() - start
    manager = engine.core.structured_outputs
    if manager is None:
        raise app.UsageError("this engine has no structured-output manager (a fast tokenizer and llguidance needed)")
    timer = StepTimer(engine)
    start = time.perf_counter()
    manager.compiler._ll_tokenizer  # built once per engine, at the first constrained request
    ll_tokenizer_s = time.perf_counter() - start
    prompt_ids = prompts(engine.tokenizer, n)
    modes = ["unconstrained", "json"] + (["json_compact"] if _COMPACT.value else [])
    compile_s = {}
    for mode in modes:  # untimed warm-up runs; the first constrained request of each mode compiles its grammar
        timer.checks = []
        run_mode(engine, timer, prompt_ids, mode, min(8, _MAX_TOKENS.value))
        if mode != "unconstrained":
            first_masked = next(s for s in timer.steps if s["masked"])
            compile_s[mode] = {"first_check_s": round(timer.checks[0], 4),
                               "first_bitmask_ms": round(1e3 * first_masked["bitmask"], 3),
                               "first_bitmask_step_rows": first_masked["rows"],
                               "later_checks_median_s": round(statistics.median(timer.checks[1:]), 6)}
    timer.matchers = []
    rounds, decode, outputs = [], {m: [] for m in modes}, {}
    for r in range(_ROUNDS.value):
        row, steps = {"round": r}, {}
        for mode in modes:
            run = run_mode(engine, timer, prompt_ids, mode, _MAX_TOKENS.value)
            steps[mode], outputs[mode] = run["decode"], run["completions"]
            row[mode] = {"wall_s": round(run["wall_s"], 2), "num_steps": len(run["steps"]),
                         "all_decode_steps": summarize(run["decode"])}
        for mode in modes[1:]:  # unconstrained cut to this mode's count: the same output positions
            k = min(len(steps["unconstrained"]), len(steps[mode]))
            base, constrained = steps["unconstrained"][:k], steps[mode][:k]
            decode[mode].append((base, constrained))
            row[f"{mode}_overhead"] = {"unconstrained": summarize(base), mode: summarize(constrained),
                                       **overhead(summarize(base), summarize(constrained))}
        rounds.append(row)
        print(f"round {r}: " + "; ".join(
            f"{m} {o[m]['step_ms']:.1f} vs unconstrained {o['unconstrained']['step_ms']:.1f} ms/step over "
            f"{o[m]['steps']} decode steps of {n} rows: +{o['step_overhead_fraction']:.1%}"
            for m, o in ((m, row[f"{m}_overhead"]) for m in modes[1:])), flush=True)
    pooled = {}
    for mode in modes[1:]:
        base = summarize([s for b, _ in decode[mode] for s in b])
        constrained = summarize([s for _, c in decode[mode] for s in c])
        pooled[mode] = {"unconstrained": base, mode: constrained, **overhead(base, constrained)}
    figures = {
        "model": loaded.source, "dtype": _DTYPE.value, "num_seqs": n, "max_tokens": _MAX_TOKENS.value,
        "schema": SCHEMA, "modes": modes, "setup_s": round(setup_s, 1),
        "attention_backend": engine.config.attention_backend, "weight_layout": engine.runner.weight_layout,
        "mean_prompt_tokens": round(statistics.mean(map(len, prompt_ids)), 1),
        "overhead": pooled,
        "target_overhead_fraction": 0.10,
        "grammar": {"ll_tokenizer_build_s": round(ll_tokenizer_s, 3), **compile_s,
                    "matcher_create_median_ms": round(1e3 * statistics.median(timer.matchers), 3)
                    if timer.matchers else None},
        "completions": {m: completions_summary(m, outputs[m]) for m in modes},
        "rounds": rounds, "load_average_end": os.getloadavg(),
    }
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    for m, o in pooled.items():
        for name in ("unconstrained", m):
            p = o[name]
            print(f"{name:>14}: {p['steps']} steps, step {p['step_ms']:.1f} ms (bitmask {p['bitmask_ms']:.2f}, accept "
                  f"{p['accept_ms']:.2f}, execute {p['execute_ms']:.1f}, run_batch {p['run_batch_ms']:.1f}, model "
                  f"{p['model_ms']:.1f}, head {p['head_ms']:.2f} ms)")
        print(f"{m}: +{o['step_overhead_fraction']:.1%} per step ({o['step_ms_delta']:+.2f} ms); its parts "
              f"+{o['parts_overhead_fraction']:.1%} (bitmask {o['bitmask_ms']:.2f}, accept {o['accept_ms_delta']:+.2f}, "
              f"head {o['head_ms_delta']:+.2f}, prepare {o['prepare_ms_delta']:+.2f} ms); model step drift "
              f"{o['model_ms_delta']:+.2f} ms")
    print("grammar:", figures["grammar"])


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
