"""The engine's own logits for a prompt, as its jitted step computed them.

Near-tie checks (a greedy output differs from the reference's: were the two tokens'
logits within rounding of each other?) need the logits of the engine that ran, in its
serving layout and dtype, not a separate forward pass: `next_token_logits` prefills a
prompt alone and keeps the step's last-position row.
"""

from __future__ import annotations


class LastLogits:
    """Wraps a runner's jitted step to keep a copy of row 0 of the last step's logits (the
    engine's own, in its serving layout and dtype); `with` scope restores the step."""

    def __init__(self, runner):
        self.runner, self.row = runner, None

    def __enter__(self):
        import jax
        import numpy as np
        step = self.original = self.runner._step

        def capture(*args, **static):  # static: the step's kind
            out = step(*args, **static)  # (logits, kv cache, hidden states, head-kernel argmax, token feed)
            self.row = np.array(jax.device_get(out[0])[0], np.float32)  # a copy: the buffer is donated next step
            return out
        self.runner._step = capture
        return self

    def __exit__(self, *exc):
        self.runner._step = self.original


def next_token_logits(llm, token_ids) -> tuple:
    """(logits row, greedy token) after `token_ids`, one prefill of that request alone."""
    from paged_jax.core.sampling_params import SamplingParams
    with LastLogits(llm.engine.runner) as last:
        out = llm.generate([{"prompt_token_ids": list(token_ids)}],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return last.row, out[0].outputs[0].token_ids[0]
