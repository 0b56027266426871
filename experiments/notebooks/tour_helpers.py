"""Read-only views of a running LLMEngine for the research notebook (tour.ipynb).

The notebook steps an engine by hand and looks inside it; these helpers keep its cells
short. They only read: block tables and token counts come from the block manager's
public queries, which tables hold which block from the device-resident (running)
sequences, so the "holders" of a block are its reference count by the block manager's
invariant (ref_count == tables holding it). The one exception is
`step_capturing_batch`, which wraps `runner.execute` and `runner.run_batch` for a single
step to keep the scheduler output and the padded batch that step sent to the device, and
unwraps them again.
"""

from __future__ import annotations

import collections
import dataclasses

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.worker.batch_inputs import BatchInputs


def running_seqs(engine, request_id: str) -> list:
    """The request's device-resident sequences, in completion order."""
    return sorted((s for s in engine.scheduler.running if s.request_id == request_id), key=lambda s: s.index)


def block_holders(engine) -> collections.Counter:
    """Physical block id -> number of running sequences whose block table holds it."""
    bm = engine.block_manager
    return collections.Counter(b for s in engine.scheduler.running for b in bm.block_table(s.seq_id))


def block_table_rows(engine, seq) -> list[dict]:
    """One row per logical block of `seq`: which physical block, which token positions
    it covers, how many of its slots hold K/V, how many tables share it, and its text."""
    bm, size = engine.block_manager, engine.block_manager.block_size
    num_tokens, holders = bm.num_tokens(seq.seq_id), block_holders(engine)
    rows = []
    for logical, physical in enumerate(bm.block_table(seq.seq_id)):
        start, end = logical * size, min((logical + 1) * size, num_tokens)
        text = engine.tokenizer.decode(seq.token_ids(start, end)) if engine.tokenizer is not None else ""
        rows.append({"logical": logical, "physical": physical, "positions": f"{start}..{end - 1}",
                     "filled": f"{end - start}/{size}", "holders": holders[physical], "text": text})
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain-text table (the notebook has no pandas): one column per key, left-aligned."""
    if not rows:
        return "(empty)"
    cells = [[repr(v) if isinstance(v, str) and k == "text" else str(v) for k, v in r.items()] for r in rows]
    keys = list(rows[0])
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def pool_summary(engine) -> dict:
    """Device block pool right now: usable (all but the null block), free, used (held by
    some table), shared (held by more than one table), and registered in the prefix
    cache (held, or free but still reusable until evicted)."""
    bm, holders = engine.block_manager, block_holders(engine)
    return {"usable": bm.num_usable_blocks, "free": bm.num_free_blocks,
            "used": bm.num_usable_blocks - bm.num_free_blocks,
            "shared": sum(1 for n in holders.values() if n > 1), "cached": bm.num_blocks_cached}


def step_capturing_batch(engine) -> tuple:
    """Run one engine step and return (scheduler output, the padded BatchInputs the runner
    turned it into and ran, the step's RequestOutputs)."""
    runner, captured = engine.runner, {}
    execute, run_batch = runner.execute, runner.run_batch

    def capture_output(output, seqs):
        captured["output"] = output
        return execute(output, seqs)

    def capture_batch(batch):
        captured["batch"] = batch
        return run_batch(batch)

    runner.execute, runner.run_batch = capture_output, capture_batch
    try:
        outputs = engine.step()
    finally:
        del runner.execute, runner.run_batch  # back to the class's methods
    return captured["output"], captured["batch"], outputs


def describe_batch(batch: BatchInputs, num_rows: int, num_tokens: int) -> str:
    """The padded batch's shapes and its interesting arrays, real part and padding apart."""
    lines = [f"{name:16s} {getattr(batch, name).dtype!s:7s} {getattr(batch, name).shape}"
             for name in BatchInputs._fields]
    lines.append("")
    lines.append(f"token_ids[:{num_tokens}]      {batch.token_ids[:num_tokens].tolist()}")
    lines.append(f"positions[:{num_tokens}]      {batch.positions[:num_tokens].tolist()}")
    lines.append(f"slot_mapping[:{num_tokens}]   {batch.slot_mapping[:num_tokens].tolist()}")
    lines.append(f"slot_mapping[{num_tokens}:]   {batch.slot_mapping[num_tokens:].tolist()}  (padding)")
    lines.append(f"query_start_loc     {batch.query_start_loc.tolist()}")
    lines.append(f"context_lens        {batch.context_lens.tolist()}")
    lines.append("block_tables (rows; trailing zeros = the null block):")
    lines += [f"  row {r}{' (padding)' if r >= num_rows else '':10s} {row.tolist()}"
              for r, row in enumerate(batch.block_tables)]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """The KV cache after one engine step (finished sequences already freed)."""

    step: int
    num_running: int  # sequences holding device blocks
    num_waiting: int  # admitted by nobody yet (or preempted by recompute)
    tokens_held: int  # token slots holding K/V, each physical block counted once
    slots_allocated: int  # token slots in blocks held (paged) or reserved (contiguous)
    block_size: int

    @property
    def utilization(self) -> float | None:
        return self.tokens_held / self.slots_allocated if self.slots_allocated else None

    @property
    def blocks_used(self) -> int:
        return self.slots_allocated // self.block_size


def run_trace(engine, trace, prefix: str = "trace") -> list[StepRecord]:
    """Serve a workloads.make_trace trace to completion (greedy, ignore_eos, so each
    request produces exactly its max_tokens) and record the KV cache after every step."""
    for i, request in enumerate(trace):
        engine.add_request(f"{prefix}-{i}", list(request.prompt_token_ids),
                           SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True))
    bm, records = engine.block_manager, []
    while engine.has_unfinished_requests():
        engine.step()
        records.append(StepRecord(len(records), len(engine.scheduler.running), len(engine.scheduler.waiting),
                                  bm.num_tokens_held(), bm.num_slots_allocated(), bm.block_size))
    return records


def mean_utilization(records: list[StepRecord]) -> float:
    """Utilization averaged over the steps that held any KV (as EngineStats does)."""
    values = [r.utilization for r in records if r.utilization is not None]
    return sum(values) / len(values)
