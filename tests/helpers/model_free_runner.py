"""A model-free runner that checks every K/V read, for scheduler and block-manager tests.

ModelRunner's interface without a model: instead of K/V tensors it keeps, for every
device and host slot, the prefix whose last token's K/V the slot would hold (K/V of a
token depend on every token before it). Each step it executes the swap and copy orders
in the runner's order (swap-out, swap-in, copy-on-write), writes each chunk's slots
(no slot twice in one step), and then checks that every position each chunk attends to
holds exactly that sequence's own prefix: a block handed out too early, a shared block
written in place, a lost swap or a prefix-cache hit computed under another prefix all
show up as a wrong read. Block tables arrive as updates (keep k entries, then new ids),
as ModelRunner gets them; this runner rebuilds each table from its updates only, so a
wrong or missing update reads the wrong K/V too. "Sampling" is a fixed function of the sequence's seed and length
(so n > 1 completions diverge and copy-on-write happens); beams get distinct candidates.

Used with LLMEngine's injection points: `serve(config, requests)` runs the real engine
(scheduler, block manager or contiguous allocator, stop checks) on this runner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import configs
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.allocators import make_allocator
from paged_jax.loading import LoadedModel
from paged_jax.worker.model_runner import StepResult

MODEL_CONFIG = configs.get_config("tiny_llama")  # a vocabulary and a KV layout; no weights are built
FIRST_TOKEN, NUM_TOKENS = 10, 40  # what the runner samples: ids 10..49 (EOS is 2)


class KVReadError(AssertionError):
    """A chunk would attend to a slot that does not hold its own prefix."""


class ContentCheckingRunner:
    num_compilations = 0

    def __init__(self, model_config, params, config, *, num_blocks: int, num_host_blocks: int):
        del params
        self.block_size, self.num_blocks, self.num_host_blocks = config.block_size, num_blocks, num_host_blocks
        self.max_copies = config.max_num_seqs  # ModelRunner's per-step limit
        self.num_top_logprobs = min(config.max_logprobs, model_config.vocab_size)
        self.device: dict[int, list] = {}  # device block id -> per slot: the prefix it holds K/V of
        self.tables: dict[int, list[int]] = {}  # seq id -> block table, rebuilt from the chunks' updates
        self.host: dict[int, list] = {}
        self.device_seconds = 0.0
        self.num_steps = 0

    def warm_up(self, progress: bool = False) -> None:  # nothing compiles: no bar to show
        """Nothing to compile."""

    def _slot(self, pool: dict, block: int) -> list:
        return pool.setdefault(block, [None] * self.block_size)

    def execute(self, output, seqs) -> StepResult:
        self.num_steps += 1
        for src, dst in output.swap_out:
            assert 0 < src < self.num_blocks and 0 <= dst < self.num_host_blocks, (src, dst)
            self.host[dst] = list(self._slot(self.device, src))
        for src, dst in output.swap_in:
            assert 0 <= src < self.num_host_blocks and 0 < dst < self.num_blocks, (src, dst)
            self.device[dst] = list(self._slot(self.host, src))
        if len(output.block_copies) > self.max_copies:
            raise AssertionError(f"{len(output.block_copies)} block copies exceed the runner's {self.max_copies}")
        for src, dst in output.block_copies:
            self.device[dst] = list(self._slot(self.device, src))
        for seq_id in output.finished_seq_ids + output.preempted_seq_ids:
            self.tables.pop(seq_id, None)
        tables = {}
        for chunk in output.chunks:
            if chunk.num_kept_blocks and len(self.tables.get(chunk.seq_id, ())) < chunk.num_kept_blocks:
                raise KVReadError(f"seq {chunk.seq_id}: an update keeps {chunk.num_kept_blocks} blocks of "
                                  f"{self.tables.get(chunk.seq_id)}")
            kept = self.tables.get(chunk.seq_id, [])[: chunk.num_kept_blocks]
            tables[chunk.seq_id] = self.tables[chunk.seq_id] = kept + list(chunk.new_block_ids)
        written: set[tuple[int, int]] = set()
        for chunk in output.chunks:  # every chunk writes its slots, then all of them read
            seq, table = seqs[chunk.seq_id], tables[chunk.seq_id]
            start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
            if list(chunk.token_ids) != seq.token_ids(start, end):
                raise KVReadError(f"seq {seq.seq_id}: chunk tokens are not tokens [{start}, {end})")
            if len(table) * self.block_size < end or 0 in table:
                raise KVReadError(f"seq {seq.seq_id}: block table {table} cannot hold {end} tokens")
            prefix = seq.token_ids(0, end)
            for pos in range(start, end):
                slot = (table[pos // self.block_size], pos % self.block_size)
                if slot in written:
                    raise KVReadError(f"seq {seq.seq_id}: slot {slot} written twice in one step")
                written.add(slot)
                self._slot(self.device, slot[0])[slot[1]] = tuple(prefix[: pos + 1])
        for chunk in output.chunks:
            seq, table = seqs[chunk.seq_id], tables[chunk.seq_id]
            end = chunk.start_position + chunk.num_tokens
            prefix = seq.token_ids(0, end)
            for pos in range(end):
                block = table[pos // self.block_size]
                held = self._slot(self.device, block)[pos % self.block_size]
                if held != tuple(prefix[: pos + 1]):
                    raise KVReadError(f"seq {seq.seq_id} reads position {pos} from block {block}: holds K/V of "
                                      f"{held}, its prefix is {tuple(prefix[: pos + 1])}")
        rows = [seqs[c.seq_id] for c in output.chunks]
        tokens = np.array([FIRST_TOKEN + (s.seed * 7 + s.num_tokens * 13) % NUM_TOKENS for s in rows], np.int32)
        k = self.num_top_logprobs
        top_ids = np.array([[FIRST_TOKEN + (t - FIRST_TOKEN + j) % NUM_TOKENS for j in range(k)] for t in tokens],
                           np.int32).reshape(len(rows), k)
        top_logprobs = np.tile(-np.arange(1, k + 1, dtype=np.float32), (len(rows), 1))
        return StepResult(tokens, np.full(len(rows), -1.0, np.float32), top_ids, top_logprobs)


class StepClock:
    """Seconds = steps taken; the engine reads it for arrival and finish times."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    params: object  # SamplingParams or BeamSearchParams
    arrival_step: int = 0


def make_engine(config, clock=None) -> LLMEngine:
    model = LoadedModel(MODEL_CONFIG, None, None, "model-free", "none", 0.0)
    return LLMEngine(model, config, runner_factory=ContentCheckingRunner, clock=clock or StepClock(),
                     allocator_factory=make_allocator)  # config.kv_allocator may name a baseline


def serve(config, requests: list[Req], *, max_steps: int = 10_000, check=None) -> tuple[dict, set[str], LLMEngine]:
    """Feed `requests` (each at its arrival step) to a model-free engine until it is idle.

    Returns (request id -> final RequestOutput, ids the engine refused with ValueError,
    the engine). `check(engine)` runs after every step (invariants). Raises what the engine
    raises (RuntimeError when it cannot make progress), or AssertionError after max_steps.
    """
    clock = StepClock()
    engine = make_engine(config, clock)
    finished, refused, step = {}, set(), 0
    pending = sorted(enumerate(requests), key=lambda r: r[1].arrival_step)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_step <= step:
            i, req = pending.pop(0)
            try:
                engine.add_request(str(i), {"prompt_token_ids": list(req.prompt)}, req.params)
            except ValueError:
                refused.add(str(i))
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if check is not None:
                check(engine)
        step += 1
        clock.now = float(step)
        if step > max_steps:
            raise AssertionError(f"no end after {max_steps} steps: {engine.stats()}")
    return finished, refused, engine


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, temperature=0.0)
