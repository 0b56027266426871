"""SamplingParams: what a request asks of generation, with vLLM's names and defaults.

Pure Python and validated on construction, so a bad request is refused before it
touches the engine (and the engine stays usable).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence

from paged_jax.core.structured_outputs import StructuredOutputsParams

INT32_MAX = 2**31 - 1  # top_k reaches an i32 array in the jitted step
FLOAT32_MAX = 3.4028234663852886e38  # temperature reaches an f32 array: above this it is inf there


def _finite(name: str, value) -> None:
    """NaN compares false with everything, so without this `temperature=NaN` would pass
    every range check and silently act as greedy; infinities are never meaningful here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind).

    A streaming server wants only what is new, a batch caller only the end: building the
    whole completion so far for every step (CUMULATIVE) costs O(output length) per step,
    which the other two kinds avoid."""

    CUMULATIVE = 0  # every output: the whole text, token ids and logprobs so far
    DELTA = 1  # every output: only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, once the request finished, whole


def _output_kind(value) -> RequestOutputKind:
    """A RequestOutputKind, or its name in any case ("delta"); anything else is refused."""
    if isinstance(value, RequestOutputKind):
        return value
    if isinstance(value, str) and value.upper() in RequestOutputKind.__members__:
        return RequestOutputKind[value.upper()]
    allowed = ", ".join(f"RequestOutputKind.{k.name} ({k.name.lower()!r})" for k in RequestOutputKind)
    raise ValueError(f"output_kind must be one of {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt (parallel sampling shares the prompt's blocks)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely); 0 = off
    seed: int | None = None  # per-request seed: the stream depends only on (seed, token index)
    max_tokens: int = 16  # new tokens at most
    stop: tuple[str, ...] | None = None  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] | None = None  # extra stop tokens besides EOS
    ignore_eos: bool = False  # keep generating past EOS
    logprobs: int | None = None  # return the chosen token's logprob (and top-k later); None = off
    # Per prompt token (but the first), its logprob under the model given the tokens before it,
    # plus the prompt_logprobs most likely alternatives (vLLM's `prompt_logprobs`); None = off.
    # Such a request never reads the prefix cache (a cached block has no logits: vLLM's rule).
    prompt_logprobs: int | None = None
    # A constraint the output must satisfy (a JSON schema, regex, choice, grammar: vLLM's
    # StructuredOutputsParams); None = free text
    structured_outputs: StructuredOutputsParams | None = None
    # What each RequestOutput carries: the whole completion so far (CUMULATIVE), what is new
    # (DELTA: a stream), or nothing until it finished (FINAL_ONLY); a name ("delta") works too
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        object.__setattr__(self, "output_kind", _output_kind(self.output_kind))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p"):
            _finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > FLOAT32_MAX:
            raise ValueError(f"temperature must be at most {FLOAT32_MAX:.8g} (the largest float32), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be an int in [0, {INT32_MAX}] (0 = off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be None or an int in [0, 2**32), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an int >= 0, got {self.prompt_logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
            if any(not isinstance(s, str) or not s for s in self.stop):
                raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
            if any(t < 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def all_stop_token_ids(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """Token ids that end a completion: EOS (unless ignore_eos) plus stop_token_ids."""
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return frozenset(ids)
