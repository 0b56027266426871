"""The KV pool's snapshot (engine/pool_snapshot.py) tells the truth after every step.

The snapshot's block states come from the pools' reference counts and prefix-cache keys
(BlockPool.block_states); this test derives them independently from the block tables of
the sequences the snapshot lists (a block in two tables is shared, in one used, in none
free, or cached-free when the prefix cache still holds it) and checks the two agree after
every step of traffic that forks (n > 1, beams), shares prefixes, evicts, preempts by
recompute and by swap. So a table the snapshot leaves out, a wrong state code or a stale
counter fails here. The engine runs on the model-free runner (tests/helpers/model_free_runner.py).
"""

import collections
import json

import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.block_pool import BLOCK_STATES
from paged_jax.engine.pool_snapshot import take_snapshot
from tests.engine.test_pool_check import TIGHT, _traffic
from tests.helpers.model_free_runner import greedy, make_engine, serve

CODE = {name: str(i) for i, name in enumerate(BLOCK_STATES)}


def check_snapshot(engine) -> dict:
    core, bm = engine.core, engine.block_manager
    snap = take_snapshot(core, num_generated_tokens=7, clock=lambda: 1.5)
    assert json.loads(json.dumps(snap)) == snap  # JSON as it is
    assert snap["time"] == 1.5 and snap["counters"]["num_generated_tokens"] == 7
    blocks, host = snap["blocks"], snap["host_blocks"]
    assert len(blocks) == bm.num_blocks and len(host) == bm.num_host_blocks
    refs, host_refs = collections.Counter(), collections.Counter()
    seen_seqs = set()
    for request in snap["requests"]:
        for seq in request["seqs"]:
            seen_seqs.add(seq["seq_id"])
            (host_refs if seq["on_host"] else refs).update(seq["blocks"])
    sched = engine.scheduler
    queued = {s.seq_id: "running" for s in sched.running}
    queued.update({s.seq_id: "waiting" for s in sched.waiting})
    queued.update({s.seq_id: "swapped" for g in sched.swapped for s in g})
    assert seen_seqs == set(queued)
    for request in snap["requests"]:  # running if any of its sequences runs, else swapped, else waiting
        states = {s["state"] for s in request["seqs"]}
        assert states == {queued[s["seq_id"]] for s in request["seqs"]}
        assert request["state"] == next(x for x in ("running", "swapped", "waiting") if x in states)
    assert sum(len(s["blocks"]) > 0 for r in snap["requests"] for s in r["seqs"]) == bm.num_seqs_held
    cached = {b.block_id for b in bm._device.cached.values()}
    for block_id, state in enumerate(blocks):
        if block_id == 0:
            want = CODE["null"]
        elif refs[block_id] >= 2:
            want = CODE["shared"]
        elif refs[block_id] == 1:
            want = CODE["used"]
        else:
            want = CODE["cached"] if block_id in cached else CODE["free"]
        assert state == want, (block_id, state, want, refs[block_id])
    assert host == "".join(CODE["shared"] if host_refs[i] >= 2 else CODE["used"] if host_refs[i] else CODE["free"]
                           for i in range(bm.num_host_blocks))  # swapped forks share host blocks too
    c = snap["counters"]
    assert c["num_blocks_free"] == blocks.count(CODE["free"]) + blocks.count(CODE["cached"]) == bm.num_free_blocks
    assert c["num_blocks_used"] == bm.num_usable_blocks - bm.num_free_blocks
    assert c["num_blocks_shared"] == sum(n >= 2 for n in refs.values())
    assert c["num_blocks_cached"] == len(cached)
    assert (c["num_running"], c["num_waiting"], c["num_swapped"]) == (
        len(sched.running), len(sched.waiting), sched.num_swapped)
    assert c["num_steps"] == engine.stats()["num_steps"]
    return snap


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_every_steps_snapshot_agrees_with_the_block_tables(preemption_mode):
    seen = collections.Counter()

    def check(engine):
        snap = check_snapshot(engine)
        seen.update(set(snap["blocks"]))
        seen["host"] += snap["host_blocks"].strip("0") != ""
        seen["waiting"] += any(r["state"] == "waiting" for r in snap["requests"])

    config = EngineConfig(**TIGHT, preemption_mode=preemption_mode)
    finished, refused, engine = serve(config, _traffic(), check=check)
    assert len(finished) == 24 and not refused
    # the traffic showed every state a paged pool has (and, with swap, host blocks)
    assert {CODE[s] for s in ("free", "used", "shared", "cached", "null")} <= set(seen), seen
    assert seen["waiting"] and (seen["host"] > 0) == (preemption_mode == "swap")
    idle = check_snapshot(engine)
    assert idle["requests"] == [] and set(idle["blocks"][1:]) <= {CODE["free"], CODE["cached"]}


def test_a_forked_request_shows_its_prompt_blocks_shared():
    engine = make_engine(EngineConfig(**TIGHT))
    engine.add_request("fork", {"prompt_token_ids": list(range(100, 118))}, greedy(6, n=3))  # 18 tokens: 4 full + 1
    for _ in range(3):
        engine.step()
    snap = check_snapshot(engine)
    [request] = snap["requests"]
    assert request["request_id"] == "fork" and request["state"] == "running" and len(request["seqs"]) == 3
    tables = [s["blocks"] for s in request["seqs"]]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # the full prompt blocks, once in the pool
    assert all(snap["blocks"][b] == CODE["shared"] for b in tables[0][:4])
    assert len({t[-1] for t in tables}) == 3  # copy-on-write split the last block


def test_a_contiguous_reservation_shows_what_is_written_reserved_and_fragmented():
    """contiguous-max reserves max_model_len (16 blocks of 4) per request: of 40 usable
    blocks two reservations leave a gap of 8 that the third request cannot use."""
    engine = make_engine(EngineConfig(**{**TIGHT, "max_model_len": 64}, kv_allocator="contiguous-max",
                                      enable_prefix_caching=False))
    for name in "abc":
        engine.add_request(name, {"prompt_token_ids": list(range(100, 110))}, greedy(4))  # 10 tokens: 3 blocks
    engine.step()
    snap = take_snapshot(engine.core)
    assert [(r["request_id"], r["state"]) for r in snap["requests"]] == [("a", "running"), ("b", "running"),
                                                                        ("c", "waiting")]
    free_states = set()
    for request in snap["requests"][:2]:
        seq = request["seqs"][0]
        start, length = engine.block_manager.reservation(seq["seq_id"])
        assert length == 16 and seq["blocks"] == list(range(start, start + len(seq["blocks"])))
        written = len(seq["blocks"])
        assert snap["blocks"][start:start + length] == CODE["used"] * written + CODE["reserved"] * (length - written)
    assert snap["blocks"][0] == CODE["null"] and snap["host_blocks"] == ""
    gaps = engine.block_manager.free_gaps()
    assert sum(n for _, n in gaps) == 8
    for start, length in gaps:  # too short for c's 16 blocks: external fragmentation
        free_states |= set(snap["blocks"][start:start + length])
    assert free_states == {CODE["fragment"]}
    c = snap["counters"]
    assert c["num_blocks_used"] == 32 and c["num_blocks_free"] == 8 and c["waste_external_slots"] == 8 * 4
    assert c["waste_reservation_slots"] > 0 and snap["allocator"] == "contiguous-max"
