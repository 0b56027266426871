"""Seeded synthetic request traces with the paper's length statistics.

The paper serves ShareGPT (mean prompt 161 / output 338 tokens) and Alpaca (19 / 58).
No data set is downloaded: prompts are random token ids, and lengths are drawn from a
log-normal with the data set's mean (sigma sets the spread; the mean is kept exactly in
expectation: mu = ln(mean) - sigma^2 / 2), capped so prompt + output <= max_model_len.
`scale` shrinks both means for CPU runs while keeping the shape of the distribution.

The paper's other workloads are variants of these: `shared-prefix`
puts one common prefix (the paper's 1-shot and 5-shot prompts: 80 and 341 tokens) before
each Alpaca-like prompt; `sampling` and `beam` are Alpaca-like requests that ask for n
parallel samples or a beam search of width w (the fields `n` and `beam_width`).
`system-prompts` is the fleet workload (prefix-aware routing): `num_prefixes` distinct
prefixes of `prefix_len` tokens (an application's system prompts), each request after
one of them drawn uniformly, then an Alpaca-like question.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# name -> (mean prompt tokens, mean output tokens)
DATASETS = {"sharegpt": (161, 338), "alpaca": (19, 58)}
# variant -> the data set whose lengths it draws (prompts after any shared prefix)
VARIANTS = {"shared-prefix": "alpaca", "sampling": "alpaca", "beam": "alpaca", "system-prompts": "alpaca"}
WORKLOADS = tuple(DATASETS) + tuple(VARIANTS)
PAPER_PREFIX_LENS = (80, 341)  # 1-shot and 5-shot prompts of the paper's translation workload
SIGMA = 0.8  # log-normal spread of both lengths


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # output length (run with ignore_eos so it is exact)
    arrival_time: float  # seconds after the start; 0 for offline runs
    n: int = 1  # parallel samples ("sampling")
    beam_width: int = 0  # 0: no beam search ("beam")
    priority: int = 0  # lower is served first (engines with scheduling_policy="priority")


def _lognormal(rng, mean: float, size: int, sigma: float) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2
    return np.maximum(1, np.round(rng.lognormal(mu, sigma, size))).astype(int)


def make_trace(workload: str, num_requests: int, *, seed: int = 0, scale: float = 1.0, max_model_len: int = 2048,
               vocab_size: int = 49152, request_rate: float | None = None, first_token_id: int = 3,
               prefix_len: int = PAPER_PREFIX_LENS[0], n: int = 4, beam_width: int = 4,
               sigma: float = SIGMA, num_prefixes: int = 16) -> list[Request]:
    """`num_requests` requests of `workload` (one of WORKLOADS); Poisson arrivals at
    `request_rate` per second, or all at t = 0 when it is None. `prefix_len` applies to
    "shared-prefix" and "system-prompts" (the prefix is not scaled: it is the paper's
    prompt, or a system prompt), `num_prefixes` to "system-prompts", `n` to "sampling",
    `beam_width` to "beam". `sigma` is the log-normal spread of both lengths
    (the means stay the data set's)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; available: {list(WORKLOADS)}")
    if scale <= 0 or num_requests < 1 or sigma < 0:
        raise ValueError("scale must be > 0, num_requests >= 1 and sigma >= 0")
    shared = prefix_len if workload in ("shared-prefix", "system-prompts") else 0
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    if not 0 <= shared < max_model_len - 1:
        raise ValueError(f"prefix_len={prefix_len} leaves no room in max_model_len={max_model_len}")
    rng = np.random.default_rng(seed)
    mean_prompt, mean_output = DATASETS[VARIANTS.get(workload, workload)]
    prefixes = [tuple(int(t) for t in rng.integers(first_token_id, vocab_size, shared))
                for _ in range(num_prefixes if workload == "system-prompts" else 1)]
    prompt_lens = np.minimum(_lognormal(rng, mean_prompt * scale, num_requests, sigma), max_model_len - shared - 1)
    output_lens = np.minimum(_lognormal(rng, mean_output * scale, num_requests, sigma), max_model_len - shared - prompt_lens)
    if request_rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, num_requests))
    extra = {"sampling": {"n": n}, "beam": {"beam_width": beam_width}}.get(workload, {})
    # drawn after everything above, so the other workloads' traces stay what they were
    which = rng.integers(0, len(prefixes), num_requests) if len(prefixes) > 1 else np.zeros(num_requests, int)
    return [Request(prefixes[w] + tuple(int(t) for t in rng.integers(first_token_id, vocab_size, p)), int(m),
                    float(a), **extra)
            for p, m, a, w in zip(prompt_lens, output_lens, arrivals, which)]


def trace_means(trace, digits: int | None = None) -> dict:
    """A trace's lengths as records report them: mean prompt tokens and mean output tokens
    (max_tokens), rounded to `digits` where given. One function so that every record's
    "mean_prompt_tokens" / "mean_output_tokens" mean the same thing."""
    if not trace:
        raise ValueError("trace_means needs at least one request")
    means = {"mean_prompt_tokens": float(np.mean([len(r.prompt_token_ids) for r in trace])),
             "mean_output_tokens": float(np.mean([r.max_tokens for r in trace]))}
    return means if digits is None else {k: round(v, digits) for k, v in means.items()}


def fluid_ratio(prompt_lens, output_lens) -> float:
    """E[o (p + o)] / E[o (p + o / 2)]: memory per running request, oracle over paged, when
    the running set is weighted by output length and a paged request is on average half
    way through its output (no block rounding, no fragmentation)."""
    p, o = np.asarray(prompt_lens, float), np.asarray(output_lens, float)
    return float(np.sum(o * (p + o)) / np.sum(o * (p + o / 2)))
