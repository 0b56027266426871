"""Time to first token with a 1k-token shared prefix: cold vs warm prefix cache.

    python -m experiments.prefix_cache_ttft                   # SmolLM2-135M, 8 requests
    python -m experiments.prefix_cache_ttft --num_requests=2 --max_tokens=4

Why: a prefix-cache hit skips the prefill of every full block the prompt shares with a
cached one, so a request with a long shared system prompt and a short question should
reach its first token in roughly the time of the question's prefill alone (target:
warm TTFT <= cold TTFT / 10 at a 1k-token prefix).

Every request runs alone on one engine (model loaded once). Suffixes s_0..s_N are short
distinct questions after the same --prefix_len-token prefix. For i = 0..N-1:
  reset the cache; cold(prefix + s_i)     -- nothing cached; fills the cache
  warm(prefix + s_{i+1})                  -- only the prefix's full blocks can hit
plus one last cold(prefix + s_N). So s_1..s_N each run cold and warm: their greedy
outputs must be equal (cached K/V gives the same tokens as recomputed K/V).
Hits per warm request must be min(lcp // B, (P - 1) // B) * B, lcp the common prefix
with the cached prompt, P the prompt length: floor(prefix_len / B) * B here, since the
suffixes differ inside their first block. TTFT = first_token_time - arrival_time from
RequestOutput.metrics. A throwaway cold + warm pair on another prefix runs first.
"""

from __future__ import annotations

import os
import statistics

from absl import app, flags
from tqdm.auto import tqdm

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source); needs a tokenizer.")
_PREFIX_LEN = flags.DEFINE_integer("prefix_len", 1024, "Tokens in the shared prefix.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 8, "Warm requests measured (cold: one more).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Greedy tokens per request (compared cold vs warm).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "Engine max_model_len.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget per step (prefill chunk).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 4, "Sequences per step (few: fewer shapes to compile).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the prefix's rule order.")
_ATTENTION = flags.DEFINE_enum("attention_backend", "auto", ["auto", "pallas", "reference"],
                               "Engine attention: the Pallas kernel, the jnp reference, or auto (per platform).")

_TOPICS = ("rivers", "prime numbers", "bread", "volcanoes", "sorting", "tides", "jazz", "glaciers", "bridges",
           "owls", "compilers", "tea", "comets", "maps", "bees", "clocks")


def _prefix_ids(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """A deterministic pseudo system prompt (numbered rules) cut to exactly num_tokens."""
    import numpy as np
    rng = np.random.default_rng(seed)
    i = 0
    head = "You are a careful assistant. Follow every rule below when you answer.\n"
    ids = list(tokenizer.encode(head))
    while len(ids) < num_tokens:
        topic = _TOPICS[int(rng.integers(len(_TOPICS)))]
        ids += tokenizer.encode(f"Rule {i}: when asked about {topic}, answer in plain words and cite rule {i}.\n")
        i += 1
    return ids[:num_tokens]


def _suffix_ids(tokenizer, i: int) -> list[int]:
    text = f"Question {i}: In one sentence, what does rule {7 * i + 3} say about {_TOPICS[i % len(_TOPICS)]}?\nAnswer:"
    return list(tokenizer.encode(text))


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.loading import load_model
    from paged_jax.core.sampling_params import SamplingParams
    enable_compilation_cache()
    load_start = os.getloadavg()
    model = load_model(_MODEL.value, dtype="float32")
    llm = LLM(model, block_size=_BLOCK_SIZE.value, max_model_len=_MAX_MODEL_LEN.value,
              max_num_batched_tokens=_MAX_BATCHED.value, max_num_seqs=_MAX_NUM_SEQS.value,
              enable_chunked_prefill=True, enable_prefix_caching=True, attention_backend=_ATTENTION.value)
    tok, B, n = llm.get_tokenizer(), _BLOCK_SIZE.value, _NUM_REQUESTS.value
    params = SamplingParams(temperature=0, max_tokens=_MAX_TOKENS.value, ignore_eos=True)
    prefix = _prefix_ids(tok, _PREFIX_LEN.value, _SEED.value)
    prompts = [prefix + _suffix_ids(tok, i) for i in range(n + 1)]

    def run(prompt):
        """One request alone: (TTFT seconds, output token ids, prefix-cache hit tokens)."""
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        ttft = out.metrics["first_token_time"] - out.metrics["arrival_time"]
        return ttft, out.outputs[0].token_ids, llm.stats()["prefix_cache_hit_tokens"] - hits_before

    # throwaway pair on another prefix: first-call costs are not charged to either side
    other = _prefix_ids(tok, _PREFIX_LEN.value, _SEED.value + 1)
    llm.reset_prefix_cache()
    run(other + _suffix_ids(tok, 1000))
    run(other + _suffix_ids(tok, 1001))

    cold, warm = {}, {}  # suffix index -> (ttft, tokens, hits)
    expected_hits = {}
    for i in tqdm(range(n + 1), desc="cold/warm pairs"):
        llm.reset_prefix_cache()
        cold[i] = run(prompts[i])
        if i < n:
            nxt = prompts[i + 1]
            expected_hits[i + 1] = min(_lcp(prompts[i], nxt) // B, (len(nxt) - 1) // B) * B
            warm[i + 1] = run(nxt)
    load_end = os.getloadavg()

    ids = sorted(warm)
    cold_t = [cold[i][0] for i in range(n + 1)]
    warm_t = [warm[i][0] for i in ids]
    prefix_hits = _PREFIX_LEN.value // B * B
    hits_ok = all(warm[i][2] == expected_hits[i] == prefix_hits for i in ids)
    cold_hits_zero = all(cold[i][2] == 0 for i in cold)
    outputs_equal = all(cold[i][1] == warm[i][1] for i in ids)

    print(f"\n{'req':>3} {'prompt':>6} {'cold ms':>9} {'warm ms':>9} {'warm/cold':>9} {'hits':>5} {'expect':>6} same")
    for i in ids:
        print(f"{i:>3} {len(prompts[i]):>6} {cold[i][0] * 1e3:>9.1f} {warm[i][0] * 1e3:>9.1f} "
              f"{warm[i][0] / cold[i][0]:>9.4f} {warm[i][2]:>5} {expected_hits[i]:>6} {cold[i][1] == warm[i][1]}")
    ratio_mean = statistics.mean(warm_t) / statistics.mean(cold_t)
    ratio_median = statistics.median(warm_t) / statistics.median(cold_t)
    print(f"cold TTFT mean {statistics.mean(cold_t) * 1e3:.1f} ms, median {statistics.median(cold_t) * 1e3:.1f} ms; "
          f"warm mean {statistics.mean(warm_t) * 1e3:.1f} ms, median {statistics.median(warm_t) * 1e3:.1f} ms")
    print(f"warm/cold: mean {ratio_mean:.4f}, median {ratio_median:.4f} (target <= 0.1); hits per warm request "
          f"{prefix_hits} = floor({_PREFIX_LEN.value}/{B})*{B}: {hits_ok}; cold hits 0: {cold_hits_zero}; "
          f"greedy outputs equal: {outputs_equal}")
    print(f"load average 1/5/15 min: before {load_start}, after {load_end} on {os.cpu_count()} cores")

    stats = llm.stats()
    figures = {
        "model": model.source, "dtype": "float32", "prefix_len": _PREFIX_LEN.value,
        "prompt_lens": [len(p) for p in prompts], "block_size": B,
        "cold_ttft_s": [round(t, 4) for t in cold_t], "warm_ttft_s": [round(t, 4) for t in warm_t],
        "cold_ttft_mean_s": round(statistics.mean(cold_t), 4), "cold_ttft_median_s": round(statistics.median(cold_t), 4),
        "warm_ttft_mean_s": round(statistics.mean(warm_t), 4), "warm_ttft_median_s": round(statistics.median(warm_t), 4),
        "warm_over_cold_mean": round(ratio_mean, 4), "warm_over_cold_median": round(ratio_median, 4),
        "meets_target_0_1": ratio_mean <= 0.1,
        "warm_hit_tokens": [warm[i][2] for i in ids], "expected_hit_tokens": prefix_hits,
        "hit_arithmetic_ok": hits_ok, "cold_hit_tokens_zero": cold_hits_zero,
        "greedy_outputs_equal": outputs_equal,
        "num_compilations_after_warm_up": stats["num_compilations_after_warm_up"],
        "load_average_before": load_start, "load_average_after": load_end,
    }
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    name = "prefix_cache_ttft" + ("" if _ATTENTION.value == "auto" else f"_{_ATTENTION.value}")
    print("wrote", write_result(name, flags=flag_values, figures=figures, seed=_SEED.value))
    if not (hits_ok and cold_hits_zero and outputs_equal):
        raise SystemExit("check failed: hit arithmetic or greedy equality (see the table above)")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
