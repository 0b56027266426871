"""A step-time model: how long one engine step takes, from what the scheduler put in it.

The simulator (experiments/simulate.py) runs the real scheduler and block manager
without a model; this model stands in for the device. One step's time is linear in
three features of its SchedulerOutput,

    t = intercept + per_token * num_tokens + per_seq * num_seqs + per_context_token * context_tokens

where num_tokens is the tokens whose K/V the step computes (prefill chunks + decodes;
the MLP and projections scale with it), num_seqs the scheduled rows (sampling, logits,
per-row overhead), and context_tokens the sum over rows of the tokens each row attends to
(start_position + num_tokens: the attention kernel's reads). A `bucketed` model counts
num_tokens and num_seqs as the padded shape the runner runs (paged_jax/worker/batch_inputs.py:
every step is padded to a compiled bucket, so 9 decoding rows cost what 16 do). Why linear: on one device a
step is a handful of matmuls and one paged-attention pass, each close to linear in one of
these counts; experiments/calibrate_step_time.py fits the coefficients to measured steps
of the real engine and records the error on held-out steps, so how good "linear" is, is
a measured number rather than an assumption.

The fit is least squares with every coefficient >= 0 (a negative cost would let a bigger
step be cheaper, which would reward the simulator for batching nonsense); with four
features the exact non-negative solution is found by trying every subset of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np

from paged_jax.worker.batch_inputs import batch_shape

FEATURES = ("num_tokens", "num_seqs", "context_tokens")


def step_features(output, seq_buckets=None, token_buckets=None) -> tuple[int, int, int]:
    """(num_tokens, num_seqs, context_tokens) of a SchedulerOutput; with the engine's
    buckets, num_tokens and num_seqs are the padded shape the runner runs (batch_shape)."""
    num_tokens = context = 0
    for chunk in output.chunks:
        n = len(chunk.token_ids)
        num_tokens += n
        context += chunk.start_position + n
    num_seqs = len(output.chunks)
    if seq_buckets is not None:
        num_seqs, num_tokens = batch_shape(seq_buckets, token_buckets, num_seqs, num_tokens)
    return num_tokens, num_seqs, context


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    intercept_s: float  # fixed cost of a step (dispatch, padding to the smallest bucket)
    per_token_s: float  # per token computed (prefill or decode)
    per_seq_s: float  # per scheduled sequence (row)
    per_context_token_s: float  # per token of context attended to, summed over rows
    # True: num_tokens and num_seqs are the padded bucket shape the runner compiles for
    # (a step costs what its bucket costs: 9 decoding rows run as 16); False: raw counts
    bucketed: bool = False
    source: str = ""  # what it was fitted on (model, device), for the record

    def __post_init__(self):
        for field in ("intercept_s", "per_token_s", "per_seq_s", "per_context_token_s"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{field} must be a number >= 0, got {value!r}")

    def seconds(self, num_tokens: int, num_seqs: int, context_tokens: int) -> float:
        return (self.intercept_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs
                + self.per_context_token_s * context_tokens)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Seconds for each row of f[n, 3] (FEATURES order)."""
        features = np.asarray(features, np.float64)
        return self.intercept_s + features @ np.array([self.per_token_s, self.per_seq_s, self.per_context_token_s])

    @classmethod
    def fit(cls, features, seconds, *, bucketed: bool = False, source: str = "") -> StepTimeModel:
        """Non-negative least squares of `seconds` (f[n]) on `features` (f[n, 3]) plus an
        intercept: the best of the unconstrained fits over every subset of the four terms
        whose coefficients all come out >= 0 (terms outside the subset are 0)."""
        x = np.asarray(features, np.float64)
        y = np.asarray(seconds, np.float64)
        if x.ndim != 2 or x.shape[1] != len(FEATURES) or y.shape != (x.shape[0],):
            raise ValueError(f"features must be f[n, {len(FEATURES)}] and seconds f[n]; got {x.shape}, {y.shape}")
        if x.shape[0] < 1 + len(FEATURES):
            raise ValueError(f"need at least {1 + len(FEATURES)} steps to fit 4 coefficients, got {x.shape[0]}")
        design = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
        best, best_error = np.zeros(design.shape[1]), float(np.sum(y ** 2))
        for size in range(1, design.shape[1] + 1):
            for subset in itertools.combinations(range(design.shape[1]), size):
                coef, *_ = np.linalg.lstsq(design[:, subset], y, rcond=None)
                if np.any(coef < 0):
                    continue
                error = float(np.sum((design[:, subset] @ coef - y) ** 2))
                if error < best_error:
                    best, best_error = np.zeros(design.shape[1]), error
                    best[list(subset)] = coef
        return cls(*(float(c) for c in best), bucketed=bucketed, source=source)

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepTimeModel:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def load(cls, path: str) -> StepTimeModel:
        """From a JSON file: a bare model dict, or a results record whose figures hold it
        under "model" (what calibrate_step_time.py writes)."""
        with open(path) as f:
            data = json.load(f)
        if "figures" in data:
            data = data["figures"]["model"]
        return cls.from_dict(data)


def fit_error(model: StepTimeModel, features, seconds) -> dict:
    """How far the model is from measured steps: mean / p90 / max relative error per step,
    and the relative error of the summed time (what a simulation's clock accumulates)."""
    seconds = np.asarray(seconds, np.float64)
    predicted = model.predict(features)
    relative = np.abs(predicted - seconds) / seconds
    return {"num_steps": int(seconds.size), "mean_relative_error": float(relative.mean()),
            "p90_relative_error": float(np.percentile(relative, 90)), "max_relative_error": float(relative.max()),
            "total_relative_error": float(abs(predicted.sum() - seconds.sum()) / seconds.sum())}
