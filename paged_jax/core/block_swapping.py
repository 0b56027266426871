"""Swap preemption's half of the block manager: whole groups of tables to the host pool and back.

Split from block_manager.py (BlockManager inherits it) so that each file holds one
concern: that one the tables, their growth, sharing and prefix caching; this one the
moves of a group of sequences (a request's forks) between the device pool and the host
pool, keeping the group's sharing intact. It works on BlockManager's state (`_tables`,
`_swapped`, the `_device` and `_host` pools) and nothing else. Pure Python.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool, KVCacheBlock


class SwappingMixin:
    """BlockManager's swap methods (see block_manager.py for the state they use)."""

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Whether the host pool can take a copy of every distinct block of the group."""
        group = self._group_blocks(seq_ids, swapped=False)
        return len(group) <= self.num_free_host_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move a group's tables to host blocks; return `(device_id, host_id)` copy orders.

        Each distinct device block gets one host block, so sharing inside the group
        survives. A device block also held outside the group stays on the device with
        the outsiders' references; otherwise it becomes free. Raises ValueError (and
        changes nothing) if the host pool is too small: check `can_swap_out` first.
        """
        return self._move(seq_ids, src=self._device, dst=self._host, to_host=True)

    def num_swap_in_blocks(self, seq_ids: list[int]) -> int:
        """Device blocks a swapped group takes back: its distinct host blocks."""
        return len(self._group_blocks(seq_ids, swapped=True))

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        """Whether the device can take the group back, leaving the watermark free."""
        return self.num_free_blocks - self.num_swap_in_blocks(seq_ids) >= self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move a swapped group back to device blocks; return `(host_id, device_id)` orders.

        The inverse of `swap_out` (a group that shared no block with outsiders gets its device ref counts
        back equal). Raises ValueError, changing nothing, if fewer device blocks are free than the group's
        distinct blocks (the watermark is can_swap_in's)."""
        return self._move(seq_ids, src=self._host, dst=self._device, to_host=False)

    def _move(self, seq_ids: list[int], *, src: BlockPool, dst: BlockPool, to_host: bool) -> list[tuple[int, int]]:
        group = self._group_blocks(seq_ids, swapped=not to_host)
        if len(group) > dst.num_free_blocks:
            side = "host" if to_host else "device"
            raise ValueError(f"swapping {len(group)} blocks needs as many free {side} blocks; "
                             f"{dst.num_free_blocks} are free")
        mapping: dict[int, KVCacheBlock] = {}  # id(old block) -> its copy
        for (block, refs), copy in zip(group, dst.get_new_blocks(len(group))):
            dst.incr_ref([copy] * (refs - 1))  # one reference per table, as before
            mapping[id(block)] = copy
        for seq_id in seq_ids:
            old = self._tables[seq_id]
            self._tables[seq_id] = [mapping[id(b)] for b in old]
            self._mark(seq_id, 0)
            src.free_blocks(reversed(old))
            if to_host:
                self._swapped.add(seq_id)
            else:
                self._swapped.discard(seq_id)
        return [(block.block_id, mapping[id(block)].block_id) for block, _ in group]

    def _group_blocks(self, seq_ids: list[int], *, swapped: bool) -> list[tuple[KVCacheBlock, int]]:
        """Validate a swap group; return its distinct blocks (first-seen order) with the
        number of the group's tables holding each."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in swap group {seq_ids}")
        counts: dict[int, list] = {}  # id(block) -> [block, tables holding it]
        for seq_id in seq_ids:
            table = self._require(seq_id)
            if (seq_id in self._swapped) != swapped:
                where = "device-resident" if swapped else "swapped out"
                raise ValueError(f"sequence {seq_id} is {where}; cannot swap it that way")
            for block in table:
                counts.setdefault(id(block), [block, 0])[1] += 1
        return [(block, refs) for block, refs in counts.values()]
