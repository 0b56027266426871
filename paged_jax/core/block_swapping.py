"""The swap space: host memory that swap preemption moves whole groups of tables to and back.

A part the block manager holds (`BlockManager._swap`), not a half of its class: it owns
its own state, the host block pool and the set of sequences whose tables live there, and
takes what it works on (the manager's tables, the device pool) as arguments. The
manager keeps deciding what a table is; this file only moves a group of them (a
request's forks) between the device pool and the host pool, keeping the group's sharing
intact: each distinct block gets one copy, held by as many of the group's tables as
held the original. Pure Python.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool, KVCacheBlock


class SwapSpace:
    """A host block pool and the sequences swapped out to it."""

    def __init__(self, num_host_blocks: int) -> None:
        self.pool = BlockPool(num_host_blocks, reserve_null_block=False)
        self.swapped: set[int] = set()  # seq ids whose tables refer to host blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def group_blocks(self, tables: dict[int, list[KVCacheBlock]], seq_ids: list[int], *,
                     swapped: bool) -> list[tuple[KVCacheBlock, int]]:
        """Validate a swap group (its sequences all device-resident, or all swapped when
        `swapped`); return its distinct blocks (first-seen order) with the number of the
        group's tables holding each. Unknown ids are a KeyError, like the manager's."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in swap group {seq_ids}")
        counts: dict[int, list] = {}  # id(block) -> [block, tables holding it]
        for seq_id in seq_ids:
            table = tables.get(seq_id)
            if table is None:
                raise KeyError(f"unknown sequence id {seq_id!r}")
            if (seq_id in self.swapped) != swapped:
                where = "device-resident" if swapped else "swapped out"
                raise ValueError(f"sequence {seq_id} is {where}; cannot swap it that way")
            for block in table:
                counts.setdefault(id(block), [block, 0])[1] += 1
        return [(block, refs) for block, refs in counts.values()]

    def move(self, tables: dict[int, list[KVCacheBlock]], seq_ids: list[int], device: BlockPool, *,
             to_host: bool) -> list[tuple[int, int]]:
        """Move a group's tables (entries of `tables`, replaced in place) from the device
        pool to this host pool (`to_host`) or back; return the `(src_id, dst_id)` copy
        orders, one per distinct block. A block also held outside the group keeps the
        outsiders' references where it is. Raises ValueError, changing nothing, when the
        destination has fewer free blocks than the group's distinct blocks."""
        src, dst = (device, self.pool) if to_host else (self.pool, device)
        group = self.group_blocks(tables, seq_ids, swapped=not to_host)
        if len(group) > dst.num_free_blocks:
            side = "host" if to_host else "device"
            raise ValueError(f"swapping {len(group)} blocks needs as many free {side} blocks; "
                             f"{dst.num_free_blocks} are free")
        mapping: dict[int, KVCacheBlock] = {}  # id(old block) -> its copy
        for (block, refs), copy in zip(group, dst.get_new_blocks(len(group))):
            dst.incr_ref([copy] * (refs - 1))  # one reference per table, as before
            mapping[id(block)] = copy
        for seq_id in seq_ids:
            old = tables[seq_id]
            tables[seq_id] = [mapping[id(b)] for b in old]
            src.free_blocks(reversed(old))
            if to_host:
                self.swapped.add(seq_id)
            else:
                self.swapped.discard(seq_id)
        return [(block.block_id, mapping[id(block)].block_id) for block, _ in group]
