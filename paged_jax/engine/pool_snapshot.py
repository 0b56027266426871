"""A picture of the engine's KV pool at one moment: every block's state, every request's
block tables, and the counters a dashboard plots over time.

Why: the allocator is what PagedAttention is about, and counts (a usage percentage) do
not show it. A snapshot shows which blocks are free, used, shared by forks or prefix-cache
hits, free but still cached (the LRU the next hit can revive), or, under a contiguous
baseline, reserved and not yet written or free in a gap too short for the next waiting
request (external fragmentation); and, per running, waiting and swapped request, the blocks of
each of its sequences, so a viewer can highlight them.

Taken on the thread that owns the engine, between steps (the server's engine thread:
entrypoints/openai/dashboard.py), so it is consistent. Pure Python and cheap: the pool's
states are one pass over its blocks into a string of one ASCII digit per block
(BlockPool.block_states; codes in core/block_pool.py BLOCK_STATES), and the tables are
the lists the block manager already holds; experiments/dashboard_snapshot_cost.py
measures it against a step. The result is a plain dict, JSON-ready.
"""

from __future__ import annotations

import time

from paged_jax.core.kv_waste import kv_waste
from paged_jax.core.block_pool import BLOCK_STATES, FRAGMENT


def take_snapshot(core, *, num_generated_tokens: int = 0, clock=time.monotonic) -> dict:
    """The snapshot of an EngineCore (see the module docstring). `num_generated_tokens`:
    the caller's running count of tokens the engine produced (the dashboard's tokens/s
    is its rate between snapshots)."""
    bm, sched = core.block_manager, core.scheduler
    device, host = bm.block_states()
    waiting_head = sched.waiting[0] if sched.waiting else None
    contiguous = hasattr(bm, "reservation")  # an allocator that reserves ahead (a baseline): shown, not imported
    if waiting_head is not None and contiguous:  # a contiguous baseline: its external fragments
        device = _mark_fragments(device, bm.free_gaps(), bm.reservation_blocks(waiting_head.final_num_tokens))
    requests: dict[str, dict] = {}
    queues = [("running", sched.running), ("swapped", [seq for group in sched.swapped for seq in group]),
              ("waiting", sched.waiting)]
    for state, seqs in queues:
        for seq in seqs:
            # a request's state is its most advanced sequence's (some of a group may be preempted)
            request = requests.setdefault(seq.request_id, {"request_id": seq.request_id, "state": state, "seqs": []})
            held = bm.has_seq(seq.seq_id)
            entry = {"seq_id": seq.seq_id, "index": seq.index, "state": state, "num_tokens": seq.num_tokens,
                     "num_computed_tokens": seq.num_computed_tokens,
                     "blocks": bm.block_table(seq.seq_id) if held else [],
                     "on_host": held and bm.is_swapped(seq.seq_id)}
            if held and contiguous:  # its whole run: the blocks past `blocks` are reserved, not yet written
                entry["reservation"] = list(bm.reservation(seq.seq_id))
            request["seqs"].append(entry)
    usable_slots = bm.num_usable_blocks * bm.block_size
    waste = kv_waste(bm, sched.running, waiting_head)
    counters = {
        "num_steps": core.stats_tracker.num_steps,
        "num_running": len(sched.running), "num_waiting": len(sched.waiting), "num_swapped": sched.num_swapped,
        "num_blocks_total": bm.num_usable_blocks, "num_blocks_free": bm.num_free_blocks,
        "num_blocks_cached": bm.num_blocks_cached,
        # what the grid shows, counted from it: used = held by one table or more
        "num_blocks_used": sum(device.count(c) for c in "125"),  # "6" (a fragment) is free
        "num_blocks_shared": device.count("2"),
        "kv_utilization": bm.num_tokens_held() / usable_slots if usable_slots else 0.0,
        **{f"waste_{kind}_slots": slots for kind, slots in waste.items()},
        "num_preemptions": sched.num_preemptions,
        "prefix_cache_hit_tokens": sched.prefix_cache_hit_tokens,
        "prefix_cache_query_tokens": sched.prefix_cache_query_tokens,
        "num_generated_tokens": num_generated_tokens,
    }
    return {"time": clock(), "allocator": core.config.kv_allocator, "block_size": bm.block_size,
            "states": list(BLOCK_STATES), "blocks": device, "host_blocks": host,
            "requests": list(requests.values()), "counters": counters}


def _mark_fragments(states: str, gaps: list[tuple[int, int]], needed: int) -> str:
    """`states` with every free gap shorter than `needed` blocks marked as a fragment."""
    out = bytearray(states, "ascii")
    for start, length in gaps:
        if length < needed:
            out[start:start + length] = bytes([FRAGMENT]) * length
    return out.decode("ascii")
