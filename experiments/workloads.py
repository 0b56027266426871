"""Seeded synthetic request traces with the paper's length statistics.

The paper serves ShareGPT (mean prompt 161 / output 338 tokens) and Alpaca (19 / 58).
No data set is downloaded: prompts are random token ids, and lengths are drawn from a
log-normal with the data set's mean (sigma sets the spread; the mean is kept exactly in
expectation: mu = ln(mean) - sigma^2 / 2), capped so prompt + output <= max_model_len.
`scale` shrinks both means for CPU runs while keeping the shape of the distribution.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# name -> (mean prompt tokens, mean output tokens)
DATASETS = {"sharegpt": (161, 338), "alpaca": (19, 58)}
SIGMA = 0.8  # log-normal spread of both lengths


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # output length (run with ignore_eos so it is exact)
    arrival_time: float  # seconds after the start; 0 for offline runs


def _lognormal(rng, mean: float, size: int) -> np.ndarray:
    mu = math.log(mean) - SIGMA**2 / 2
    return np.maximum(1, np.round(rng.lognormal(mu, SIGMA, size))).astype(int)


def make_trace(workload: str, num_requests: int, *, seed: int = 0, scale: float = 1.0, max_model_len: int = 2048,
               vocab_size: int = 49152, request_rate: float | None = None, first_token_id: int = 3) -> list[Request]:
    """`num_requests` requests of `workload`; Poisson arrivals at `request_rate` per second,
    or all at t = 0 when it is None."""
    if workload not in DATASETS:
        raise ValueError(f"unknown workload {workload!r}; available: {sorted(DATASETS)}")
    if scale <= 0 or num_requests < 1:
        raise ValueError("scale must be > 0 and num_requests >= 1")
    rng = np.random.default_rng(seed)
    mean_prompt, mean_output = DATASETS[workload]
    prompt_lens = np.minimum(_lognormal(rng, mean_prompt * scale, num_requests), max_model_len - 1)
    output_lens = np.minimum(_lognormal(rng, mean_output * scale, num_requests), max_model_len - prompt_lens)
    if request_rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, num_requests))
    return [Request(tuple(int(t) for t in rng.integers(first_token_id, vocab_size, n)), int(m), float(a))
            for n, m, a in zip(prompt_lens, output_lens, arrivals)]
