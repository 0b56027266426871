"""ModelRunner's host half without a device: for measuring the engine's own host work.

Each step runs the real batch preparation (`prepare_batch`, with the block tables kept
between steps) and returns seeded random tokens from the model's vocabulary instead of
running a model. What the engine does around it (scheduling, block manager, output
processing, detokenization of the random tokens) is the real engine's, so its host time
per step is the engine's host work alone, without the device step's interference (its
threads share the cores; its KV working set grows with the sequences) or its noise.
"""

from __future__ import annotations

import numpy as np

from paged_jax.worker.batch_inputs import prepare_batch
from paged_jax.worker.block_tables import HostBlockTables
from paged_jax.worker.model_runner import StepResult


class HostOnlyRunner:
    num_compilations = 0

    def __init__(self, model_config, params, config, *, num_blocks: int, num_host_blocks: int):
        del params, num_host_blocks
        self.config, self.num_blocks = config, num_blocks
        self.vocab_size = model_config.vocab_size
        self.num_top_logprobs = min(config.max_logprobs, model_config.vocab_size)
        self.device_seconds = 0.0
        self.block_tables = HostBlockTables(-(-config.max_model_len // config.block_size))
        self._rng = np.random.default_rng(config.seed)

    def warm_up(self, progress: bool = False) -> None:  # nothing compiles: no bar to show
        """Nothing to compile."""

    def execute(self, output, seqs) -> StepResult:
        c = self.config
        prepare_batch(output, seqs, self.block_tables, block_size=c.block_size, num_blocks=self.num_blocks,
                      seq_buckets=c.seq_buckets, token_buckets=c.token_buckets, max_copies=c.max_num_seqs)
        n, k = len(output.chunks), self.num_top_logprobs
        tokens = self._rng.integers(3, self.vocab_size, n).astype(np.int32)
        return StepResult(tokens, np.zeros(n, np.float32), np.zeros((n, k), np.int32), np.zeros((n, k), np.float32))
