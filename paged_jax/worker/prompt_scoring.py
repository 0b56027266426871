"""Scoring a step's prompt positions for prompt logprobs, a fixed number of rows per call.

The model step returns every token's final hidden state; the positions whose next token is
a prompt token of a sequence that asked (`BatchInputs.prompt_targets`) are gathered on the
host and scored by the runner's jitted prompt-logprob head (`step_head.prompt_logprob_head`)
PROMPT_LOGPROB_ROWS at a time, the last call padded: one compiled shape whatever the number
of positions, and no step holds [tokens, vocab] logits.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from paged_jax.worker.batch_inputs import BatchInputs
from paged_jax.worker.step_head import PromptLogprobRows

PROMPT_LOGPROB_ROWS = 64  # prompt positions scored per call of the prompt-logprob head (one compiled shape)


def score_prompt_positions(head: Callable, hidden, batch: BatchInputs) -> PromptLogprobRows:
    """`head(hidden f32[R, H], targets i32[R])` -> (logprobs, ranks, top logprobs, top ids) for
    R = PROMPT_LOGPROB_ROWS; returns the batch's scored positions in flat token order."""
    flat = np.flatnonzero(batch.prompt_targets >= 0).astype(np.int32)
    hidden = np.asarray(hidden)
    parts = []
    for i in range(0, len(flat), PROMPT_LOGPROB_ROWS):
        chunk = flat[i:i + PROMPT_LOGPROB_ROWS]
        rows = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
        rows[: len(chunk)] = chunk
        out = head(hidden[rows], batch.prompt_targets[rows].clip(0))
        parts.append([np.asarray(a)[: len(chunk)] for a in out])
    logprobs, ranks, top_logprobs, top_ids = (np.concatenate(a) for a in zip(*parts))
    rows = np.searchsorted(batch.query_start_loc, flat, side="right").astype(np.int32) - 1
    return PromptLogprobRows(rows, batch.positions[flat], logprobs, ranks, top_ids, top_logprobs)
