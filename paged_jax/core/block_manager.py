"""Block tables: which physical blocks hold each sequence's KV cache.

The block manager maps sequence ids to block tables (logical block i holds tokens
`[i*block_size, (i+1)*block_size)`), grows them on demand, shares blocks between forked
sequences with reference counts and copy-on-write, and moves whole groups of sequences
to a host pool and back (swap preemption). It decides nothing: the scheduler asks
`can_*` questions and then issues orders. Pure Python, no jax or numpy.

Prefix caching (`enable_prefix_caching`). When a caller passes a sequence's tokens to
`allocate_slots`, every block that becomes full is registered in the device pool under
its `BlockKey`, a sha256 chain that names the block's whole prefix (prefix_cache.py); the
first block's key holds the sequence's `cache_salt`, so different salts never share.
`find_cached_prefix` walks a new sequence's full blocks through that map, verifying each
hit in full, and `allocate_slots(..., cached_blocks=hits)` makes them the head of its
table; those tokens need no compute. Cached blocks whose last holder is gone stay in the
free queue with their key (LRU) and are evicted only when handed out for new contents.

Copy orders. `allocate_slots`, `swap_out` and `swap_in` return `(src, dst)` block-id
pairs for the runner to execute before the next forward pass, in the order returned, or
batched (swap-out, swap-in, copy-on-write) when no step swaps out a sequence it grew or
swaps in and out at once. `table_update` says what changed in a table since last asked.
"""

from __future__ import annotations

from paged_jax.core.block_manager_invariants import broken_invariants
from paged_jax.core.block_pool import BlockPool, KVCacheBlock, check_int
from paged_jax.core.block_swapping import SwapSpace
from paged_jax.core.prefix_cache import BlockKey, check_salt, find_prefix, register_full_blocks


class BlockManager:
    """Per-sequence block tables over a device pool (with a null block 0) and a host pool.

    Invariants (see `check_invariants`): each sequence's table has exactly
    `num_blocks_needed(num_tokens)` blocks, all on the device unless the sequence is
    swapped, in which case all on the host; each block's ref_count equals the number of
    tables holding it; every non-null block is free xor referenced; the null block is in
    no table. Only a table's last block may be partly full, and a partly full block is
    written only by a sequence that holds it alone (copy-on-write).

    Swapping is done by the SwapSpace it holds (`_swap`, block_swapping.py: the host pool
    and the swapped ids); the swap methods hand it the tables and the device pool.
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_host_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        check_int("num_blocks", num_blocks, 2)  # the null block plus at least one usable
        check_int("block_size", block_size, 1)
        check_int("num_host_blocks", num_host_blocks, 0)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) \
                or not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.watermark = watermark
        self.enable_prefix_caching = enable_prefix_caching
        self._device = BlockPool(num_blocks, reserve_null_block=True)
        self._swap = SwapSpace(num_host_blocks)
        # Blocks to keep free when admitting new sequences or swapping in, so that the
        # running ones can keep growing for a while without preemption (vLLM's watermark).
        self.watermark_blocks = int(watermark * self.num_usable_blocks)
        self._tables: dict[int, list[KVCacheBlock]] = {}  # seq id -> block table
        self._num_tokens: dict[int, int] = {}  # seq id -> tokens with a slot
        # seq id -> prefix-cache keys of its full blocks, in logical order (prefix caching)
        self._keys: dict[int, list[BlockKey]] = {}
        self._extra_keys: dict[int, tuple] = {}  # seq id -> extra keys of every block (e.g. an adapter)
        self._salts: dict[int, str] = {}  # seq id -> cache_salt, in its first block's key
        self._changed: dict[int, int] = {}  # seq id -> first table entry changed since table_update

    # ------------------------------------------------------------------ queries

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks that can ever be handed out: num_blocks - 1 (the null block)."""
        return self._device.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._device.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self._swap.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable device blocks held by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        check_int("num_tokens", num_tokens, 0)
        return -(-num_tokens // self.block_size)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def block_states(self) -> tuple[str, str]:
        """(device, host) pools' block states (BlockPool.block_states), for pictures."""
        return self._device.block_states(), self._swap.pool.block_states()

    @property
    def num_seqs_held(self) -> int:  # sequences with a block table (device or swapped)
        return len(self._tables)

    def is_swapped(self, seq_id: int) -> bool:
        self._require(seq_id)
        return seq_id in self._swap.swapped

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of the sequence, in logical order (host ids if swapped)."""
        return [b.block_id for b in self._require(seq_id)]

    def table_update(self, seq_id: int) -> tuple[int, tuple[int, ...]]:
        """`(k, ids)`: the table is its first k entries at this sequence's last call, then
        `ids` (k = 0 at the first call and after a swap rebuilt it). A runner keeping
        tables between steps needs only this: mostly `(len(table), ())`, O(1)."""
        table = self._tables.get(seq_id)
        if table is None:
            self._require(seq_id)  # its KeyError
        k = self._changed.pop(seq_id, None)
        if k is None:  # unchanged since the last call: most decode steps
            return len(table), ()
        return k, tuple([b.block_id for b in table[k:]])

    def _mark(self, seq_id: int, index: int) -> None:
        self._changed[seq_id] = min(self._changed.get(seq_id, index), index)

    def num_tokens(self, seq_id: int) -> int:
        self._require(seq_id)
        return self._num_tokens[seq_id]

    def num_tokens_held(self) -> int:
        """Tokens stored in device blocks, counting each physical block once: every held
        block is full except a table's last one (shared only by forks, at the same fill)."""
        bs, counts, swapped = self.block_size, self._num_tokens, self._swap.swapped
        fill: dict[int, int] = {}  # block id -> tokens in a partly full last block (the stats sample it every step)
        for seq_id, table in self._tables.items():
            r = counts[seq_id] % bs
            if r and seq_id not in swapped:
                fill[table[-1].block_id] = r
        return self.num_slots_allocated() - sum(bs - f for f in fill.values())

    def num_slots_allocated(self) -> int:
        """Token slots in device blocks held by some sequence (each block once): O(1), as
        every usable block is free xor held. num_tokens_held() / num_slots_allocated() is
        the KV-cache utilization metric (waste: < block_size slots per last block)."""
        device = self._device
        return (device.num_usable_blocks - device.num_free_blocks) * self.block_size

    def num_blocks_without_sharing(self) -> int:
        """Device blocks the device-resident tables would need if nothing were shared."""
        return sum(len(table) for _, table in self._device_tables())

    @property
    def num_blocks_cached(self) -> int:
        """Device blocks registered in the prefix cache (held or free-but-reusable)."""
        return len(self._device.cached)

    @property
    def num_evictions(self) -> int:
        return self._device.num_evictions

    # ------------------------------------------------------------------ prefix cache

    def find_cached_prefix(self, tokens, num_tokens: int, extra_keys: tuple = (), *,
                           cache_salt: str | None = None, memo: list | None = None) -> list[KVCacheBlock]:
        """The longest run of cached blocks equal to the sequence's leading full blocks.

        `tokens(start, end)` returns the sequence's token ids; only tokens before the last
        one are looked up, so at least one token is left to compute (its logits are
        needed). `extra_keys` and `cache_salt` must be what the sequence will be
        allocated with; `memo`, a list the caller keeps per sequence, spares re-hashing its
        blocks on later calls (prefix_cache.find_prefix). Returns [] when prefix caching
        is off.
        """
        if not self.enable_prefix_caching:
            return []
        return find_prefix(self._device, tokens, num_tokens, self.block_size, tuple(extra_keys), cache_salt, memo)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (running sequences keep theirs); returns how many."""
        return self._device.reset_cache()

    def _cache_full_blocks(self, seq_id: int, tokens, num_known_tokens: int | None) -> None:
        """Register the sequence's newly full blocks (prefix_cache.register_full_blocks), of
        its first `num_known_tokens` tokens (None: all)."""
        num_tokens = self._num_tokens[seq_id]
        if num_known_tokens is not None:
            num_tokens = min(num_tokens, num_known_tokens)
        register_full_blocks(self._device, self._tables[seq_id], self._keys.setdefault(seq_id, []),
                             num_tokens // self.block_size, tokens, self.block_size,
                             self._extra_keys.get(seq_id, ()), self._salts.get(seq_id))

    def cache_known_blocks(self, seq_id: int, tokens, num_known_tokens: int) -> None:
        """Register the full blocks of a resident sequence's first `num_known_tokens` tokens
        that `allocate_slots` could not (async scheduling: their last ids were still on the
        device then), so a block filled by a sequence's last computed token is cached before
        the sequence finishes, as without async scheduling."""
        if self.enable_prefix_caching and seq_id in self._tables and seq_id not in self._swap.swapped:
            self._cache_full_blocks(seq_id, tokens, num_known_tokens)

    # ------------------------------------------------------------------ admission and growth

    def can_allocate(self, num_tokens: int, cached_blocks: list[KVCacheBlock] = (), *, final_num_tokens=None) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits, leaving the watermark free
        (`final_num_tokens` is for contiguous allocators; ignored here).

        Cache hits need no new block, but a hit on a free cached block takes it out of
        the free queue, so it counts against the free blocks like a new one.
        """
        needed = self.num_blocks_needed(num_tokens) - len(cached_blocks)
        needed += sum(1 for b in cached_blocks if b.ref_count == 0)
        return self.num_free_blocks - needed >= self.watermark_blocks

    def num_growth_blocks(self, targets: dict[int, int]) -> int:
        """Device blocks that growing each sequence `s` to `targets[s]` tokens takes, exactly:
        new blocks, plus a copy of a shared partly full last block per writer but the last
        holder (r tables sharing it, w writing: min(w, r - 1)). For a swapped group: what
        it takes beyond `num_swap_in_blocks` once back (its host ref counts are its own)."""
        new, writers = 0, {}  # id(shared partly full block) -> [block, tables writing into it]
        for seq_id, target in targets.items():
            table, current = self._require(seq_id), self._num_tokens[seq_id]
            check_int(f"target of sequence {seq_id}", target, current)
            new += self.num_blocks_needed(target) - len(table)
            if target > current and current % self.block_size and table[-1].ref_count > 1:
                writers.setdefault(id(table[-1]), [table[-1], 0])[1] += 1
        return new + sum(min(w, block.ref_count - 1) for block, w in writers.values())

    def allocate_slots(self, seq_id: int, num_total_tokens: int, *, tokens=None,
                       cached_blocks: list[KVCacheBlock] = (), extra_keys: tuple = (),
                       cache_salt: str | None = None, final_num_tokens=None,
                       num_known_tokens: int | None = None) -> list[tuple[int, int]] | None:
        """Make `seq_id` hold slots for `num_total_tokens` tokens; create it if new.

        A new sequence may start from `cached_blocks` (from `find_cached_prefix`); with
        prefix caching on and `tokens` given (`tokens(start, end)` -> token ids), the
        blocks this call makes full are registered in the cache, as far as the first
        `num_known_tokens` tokens (None: all; async scheduling allocates slots for tokens
        still on the device, whose ids `tokens` cannot give yet). `extra_keys` (in every
        block's key) and `cache_salt` (in the first block's, so in the whole chain) are
        taken from new sequences only, and must match the lookup that found the hits.

        Blocks are added on demand. A partly full last block that another table shares is
        replaced by a private copy before the sequence writes into it (the returned list
        holds the order `(src_block_id, dst_block_id)`; full shared blocks are never
        copied). Returns None and changes nothing when the device lacks free blocks (no
        watermark here: running sequences may use it). Shrinking, or growing a swapped
        sequence, is a ValueError.
        """
        table = self._tables.get(seq_id)
        if table is not None and not cached_blocks and type(num_total_tokens) is int \
                and seq_id not in self._swap.swapped:
            # Fast path, most decode steps (the simulator runs millions): the tokens fit the
            # blocks the table has, and no copy-on-write is due (nothing new is written, or
            # the last block is full, or it is private). Same effect as the general path.
            current = self._num_tokens[seq_id]
            if current <= num_total_tokens <= len(table) * self.block_size and (
                    num_total_tokens == current or current % self.block_size == 0 or table[-1].ref_count == 1):
                self._num_tokens[seq_id] = num_total_tokens
                if self.enable_prefix_caching and tokens is not None:
                    keys = self._keys.get(seq_id)
                    known = num_total_tokens if num_known_tokens is None else min(num_total_tokens, num_known_tokens)
                    if keys is None or len(keys) < known // self.block_size:
                        self._cache_full_blocks(seq_id, tokens, num_known_tokens)
                return []
            # Growth without copy-on-write (the last block is full or private): new blocks
            # at the end, the general path's effect without its validation of a new call
            if current <= num_total_tokens and (current % self.block_size == 0 or table[-1].ref_count == 1):
                num_new = -(-num_total_tokens // self.block_size) - len(table)
                if num_new > self._device.num_free_blocks:
                    return None
                changed = self._changed.get(seq_id)  # _mark, inline: this runs at every block a decode adds
                if changed is None or changed > len(table):
                    self._changed[seq_id] = len(table)
                table.extend(self._device.get_new_blocks(num_new))
                self._num_tokens[seq_id] = num_total_tokens
                if self.enable_prefix_caching and tokens is not None:
                    self._cache_full_blocks(seq_id, tokens, num_known_tokens)
                return []
        check_int("num_total_tokens", num_total_tokens, 0)
        check_salt(cache_salt)
        is_new = seq_id not in self._tables
        if cached_blocks:
            if seq_id in self._tables:
                raise ValueError(f"cached blocks can only start a new sequence; {seq_id} exists")
            if len(cached_blocks) * self.block_size > num_total_tokens:
                raise ValueError("cached blocks cover more tokens than asked for")
            needed = self.num_blocks_needed(num_total_tokens) - len(cached_blocks)
            if needed + sum(1 for b in cached_blocks if b.ref_count == 0) > self.num_free_blocks:
                return None
            self._device.incr_ref(cached_blocks)
            self._tables[seq_id] = list(cached_blocks)
            self._num_tokens[seq_id] = len(cached_blocks) * self.block_size
            self._keys[seq_id] = [b.block_key for b in cached_blocks]
        if seq_id not in self._tables or cached_blocks:
            if extra_keys:
                self._extra_keys[seq_id] = tuple(extra_keys)
            if cache_salt is not None:
                self._salts[seq_id] = cache_salt
        table = self._tables.get(seq_id, [])
        if seq_id in self._swap.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in before growing it")
        current = self._num_tokens.get(seq_id, 0)
        if num_total_tokens < current:
            raise ValueError(
                f"sequence {seq_id} holds {current} tokens; cannot shrink to {num_total_tokens}")
        num_new = self.num_blocks_needed(num_total_tokens) - len(table)
        copy_on_write = (num_total_tokens > current and current % self.block_size != 0
                         and table[-1].ref_count > 1)
        if num_new + copy_on_write > self.num_free_blocks:
            return None
        copies: list[tuple[int, int]] = []
        if is_new or copy_on_write or num_new:
            self._mark(seq_id, 0 if is_new else len(table) - copy_on_write)
        if copy_on_write:
            shared = table[-1]
            (private,) = self._device.get_new_blocks(1)
            table[-1] = private
            self._device.free_blocks([shared])  # ref_count > 1, so it stays referenced
            copies.append((shared.block_id, private.block_id))
        table.extend(self._device.get_new_blocks(num_new))
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = num_total_tokens
        if self.enable_prefix_caching and tokens is not None:
            self._cache_full_blocks(seq_id, tokens, num_known_tokens)
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's table (every block gains a reference) and token count.

        Used for parallel sampling and beam search; the children diverge later through
        copy-on-write in `allocate_slots`. The parent must be device-resident.
        """
        parent = self._require(parent_id)
        if parent_id in self._swap.swapped:
            raise ValueError(f"cannot fork sequence {parent_id}: it is swapped out")
        if child_id in self._tables:
            raise ValueError(f"cannot fork into sequence {child_id}: it already exists")
        self._device.incr_ref(parent)
        self._tables[child_id] = list(parent)
        self._mark(child_id, 0)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        if parent_id in self._keys:
            self._keys[child_id] = list(self._keys[parent_id])
        if parent_id in self._extra_keys:
            self._extra_keys[child_id] = self._extra_keys[parent_id]
        if parent_id in self._salts:
            self._salts[child_id] = self._salts[parent_id]

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references (device or host side) and forget it. Blocks go to the free queue
        last block first: tail blocks, the least likely to be shared as a prefix, are reused first."""
        table = self._require(seq_id)
        pool = self._swap.pool if seq_id in self._swap.swapped else self._device
        pool.free_blocks(reversed(table))
        del self._tables[seq_id], self._num_tokens[seq_id]
        self._swap.swapped.discard(seq_id)
        for per_seq in (self._keys, self._extra_keys, self._salts, self._changed):
            per_seq.pop(seq_id, None)

    # ------------------------------------------------------------------ swapping

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Whether the host pool can take a copy of every distinct block of the group."""
        return len(self._swap.group_blocks(self._tables, seq_ids, swapped=False)) <= self._swap.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move a group's tables to host blocks; return `(device_id, host_id)` copy orders.

        Each distinct device block gets one host block, so sharing inside the group
        survives. A device block also held outside the group stays on the device with
        the outsiders' references; otherwise it becomes free. Raises ValueError (and
        changes nothing) if the host pool is too small: check `can_swap_out` first.
        """
        return self._moved(seq_ids, self._swap.move(self._tables, seq_ids, self._device, to_host=True))

    def num_swap_in_blocks(self, seq_ids: list[int]) -> int:
        """Device blocks a swapped group takes back: its distinct host blocks."""
        return len(self._swap.group_blocks(self._tables, seq_ids, swapped=True))

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        """Whether the device can take the group back, leaving the watermark free."""
        return self.num_free_blocks - self.num_swap_in_blocks(seq_ids) >= self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move a swapped group back to device blocks; return `(host_id, device_id)` orders:
        the inverse of `swap_out`. Raises ValueError, changing nothing, if fewer device
        blocks are free than the group's distinct blocks (the watermark is can_swap_in's)."""
        return self._moved(seq_ids, self._swap.move(self._tables, seq_ids, self._device, to_host=False))

    def _moved(self, seq_ids: list[int], orders: list[tuple[int, int]]) -> list[tuple[int, int]]:
        for seq_id in seq_ids:  # rebuilt tables: a runner takes them whole (table_update's k = 0)
            self._mark(seq_id, 0)
        return orders

    # ------------------------------------------------------------------ checks

    def _require(self, seq_id: int) -> list[KVCacheBlock]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}") from None

    def _device_tables(self):
        swapped = self._swap.swapped
        return ((s, t) for s, t in self._tables.items() if s not in swapped)

    def check_invariants(self) -> None:
        """Raise AssertionError listing every broken invariant (see the class docstring)."""
        problems = broken_invariants(self)
        if problems:
            raise AssertionError("block manager invariants broken:\n  " + "\n  ".join(problems))
