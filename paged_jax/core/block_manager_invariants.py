"""The block manager's invariants, checked from outside (tests, notebooks, experiments).

Kept apart from block_manager.py: walking every table and pool is test-time work, not
part of allocation, and the manager's file stays about allocation alone.
"""

from __future__ import annotations


def broken_invariants(bm) -> list[str]:
    """Every broken invariant of BlockManager `bm` (see its class docstring), as text:
    tables and token counts agree, each table has ceil(tokens / block_size) blocks of its
    side's pool (never the null block), and each block's ref_count is the number of tables
    holding it."""
    problems = [f"device pool: {p}" for p in bm._device.check_invariants()]
    host, swapped = bm._swap.pool, bm._swap.swapped
    problems += [f"host pool: {p}" for p in host.check_invariants()]
    if not swapped <= bm._tables.keys():
        problems.append(f"swapped ids {swapped - bm._tables.keys()} have no table")
    if bm._tables.keys() != bm._num_tokens.keys():
        problems.append("block tables and token counts name different sequences")
    for side, pool in (("device", bm._device), ("host", host)):
        holders = {id(b): 0 for b in pool.blocks}  # id(block) -> tables holding it
        for seq_id, table in bm._tables.items():
            if (seq_id in swapped) != (side == "host"):
                continue
            needed = bm.num_blocks_needed(bm._num_tokens.get(seq_id, 0))
            if len(table) != needed:
                problems.append(
                    f"sequence {seq_id}: {len(table)} blocks for "
                    f"{bm._num_tokens.get(seq_id)} tokens, expected {needed}")
            for block in table:
                if block is pool.null_block:
                    problems.append(f"sequence {seq_id} holds the null block")
                elif id(block) not in holders:
                    problems.append(
                        f"sequence {seq_id} holds block {block.block_id} "
                        f"that is not in the {side} pool")
                else:
                    holders[id(block)] += 1
        for block in pool.blocks:
            if block is not pool.null_block and block.ref_count != holders[id(block)]:
                problems.append(
                    f"{side} block {block.block_id}: ref_count {block.ref_count} but "
                    f"{holders[id(block)]} tables hold it")
    return problems
