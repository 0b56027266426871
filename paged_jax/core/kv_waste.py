"""KV waste in token slots, the paper's Fig. 2 split, for whichever allocator the engine holds.

For one sequence with `R` slots allocated to it, `h` tokens held and final length `f`:

- internal = `R - max(f, h)` slots (clipped at 0): allocated, never to be used (the
  paper's "internal fragmentation");
- reservation = `min(f, R) - h` slots (clipped at 0): will be used by later tokens of
  the request, not yet (the paper's "reserved"). (The last sampled token's K/V is never
  written, so one of the `f` slots stays empty to the end; it is counted here.)
- external (whole cache) = free slots that the head of the waiting queue cannot use.

The paged BlockManager allocates a sequence only its table (`R` = its table's slots:
only the last block can be partly empty) and any free block serves any request, so its
external waste is 0: that case is computed here. An allocator that reserves beyond the
tables (the paper's contiguous baselines, paged_jax/baselines/) reports its own split
through the same interface: a method `kv_waste(running, waiting_head) -> dict`. So the
engine's statistics and pool snapshot measure a baseline without knowing it exists.
Pure Python; one pass over the running sequences, which is why the engine's stats take
it only with `EngineConfig(paper_metrics=True)`.
"""

from __future__ import annotations


def kv_waste(allocator, running, waiting_head) -> dict:
    """Waste in token slots now: {"internal", "reservation", "external"} (module docstring).

    `running`: the scheduler's running sequences (each with `seq_id` and
    `final_num_tokens`); `waiting_head`: the first waiting sequence or None. Per-sequence
    slots count a block shared by several tables once per table.
    """
    own = getattr(allocator, "kv_waste", None)
    if own is not None:  # an allocator that reserves ahead knows its own reservations
        return own(running, waiting_head)
    internal = reservation = 0
    block_size = allocator.block_size
    for seq in running:  # kept lean: no per-sequence method dispatch beyond the allocator's two
        seq_id = seq.seq_id
        if not allocator.has_seq(seq_id):
            continue
        held = allocator.num_tokens(seq_id)
        slots = -(-held // block_size) * block_size  # = its table's slots (invariant)
        final = seq.final_num_tokens
        if slots > final and slots > held:
            internal += slots - (final if final > held else held)
        if final > held:
            reservation += (final if final < slots else slots) - held
    return {"internal": internal, "reservation": reservation, "external": 0}
