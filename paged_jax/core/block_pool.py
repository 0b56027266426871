"""Physical KV-cache blocks, their free queue, and the pool that hands them out.

A pool owns a fixed set of `KVCacheBlock`s (one per physical block of the KV cache, or of
the host swap space) and knows only reference counts: which sequence holds which block is
the block manager's business. Pure Python, no jax or numpy: this runs on the host every
scheduler step and must stay cheap.

The free queue is a doubly linked list threaded through the blocks themselves (as vLLM
v1's `FreeKVCacheBlockQueue`) rather than a `deque`, because prefix caching needs to pull
a freed-but-still-cached block out of the *middle* of the queue in O(1) when a new request
hits it. Freed blocks go to the tail and new blocks come from the head, so the queue is
also the LRU eviction order for cached blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from paged_jax.core.prefix_cache import BlockKey


def check_int(name: str, value, minimum: int) -> None:
    """Allocator arguments are plain ints (not bools) of at least `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

NULL_BLOCK_ID = 0

# A block's state in a picture of the pool (BlockPool.block_states): the ASCII digit of its
# index here, so that a pool of thousands of blocks is one short string. Contiguous
# baselines (baselines/contiguous_allocator.py) add "reserved" (in a reservation, not yet
# written) and "fragment" (free, in a gap too short for the next waiting request's
# reservation: external fragmentation; engine/pool_snapshot.py marks it).
BLOCK_STATES = ("free", "used", "shared", "cached", "null", "reserved", "fragment")
FREE, USED, SHARED, CACHED, NULL, RESERVED, FRAGMENT = b"0123456"


@dataclass(eq=False, slots=True)  # identity semantics; slots: the scheduler reads these every step
class KVCacheBlock:
    """One physical block of `block_size` token slots."""

    # Index of the block in the KV-cache array (or the host swap array); never changes.
    block_id: int
    # Number of block tables holding this block; 0 means the block is in the free queue.
    ref_count: int = 0
    # The block's prefix-cache key, set once the block is full and registered in the
    # pool's prefix cache; None otherwise. Survives the block being freed (a freed cached
    # block can still be hit) and is cleared when the block is handed out anew. A hit
    # compares it in full, so a digest collision can never serve wrong K/V.
    block_key: BlockKey | None = field(default=None, repr=False)
    # Free-queue neighbours; both None exactly when the block is not in a free queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def block_hash(self) -> bytes | None:
        """The key's sha256 digest (the cache index), or None when not registered."""
        return self.block_key.digest if self.block_key is not None else None

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Doubly linked FIFO of free blocks with O(1) `popleft`, `append` and `remove`.

    Two sentinel nodes (block_id -1) bracket the list so no operation special-cases an
    empty queue or an end of the list. Invariant: a block is in the queue iff its
    `prev_free` is set; a block is in at most one queue at a time.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head (next to be handed out) to tail (most recently freed).

        Walks at most `len(self)` links, so a corrupted (cyclic) list cannot hang it.
        """
        node = self._head.next_free
        for _ in range(self._len):
            if node is None or node is self._tail:
                return
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (least recently freed)."""
        if self._len == 0:
            raise ValueError("popleft from an empty free block queue")
        block = self._head.next_free
        assert block is not None and block is not self._tail
        self.remove(block)
        return block

    def pop_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks (least recently freed first), unlinking
        them in one walk: what popleft `n` times does, without a call per block."""
        if n > self._len:
            raise ValueError(f"pop_n({n}) from a free block queue of {self._len}")
        out = []
        head = self._head
        node = head.next_free
        for _ in range(n):
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        head.next_free = node
        node.prev_free = head
        self._len -= n
        return out

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (most recently freed)."""
        if block.in_free_queue or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in a free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the tail in their order: append for each, in one call."""
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None:
                raise ValueError(f"block {block.block_id} is already in a free queue")
        last = self._tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self._len += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it sits in the queue, in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in a free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def walk(self) -> tuple[list[KVCacheBlock], list[str]]:
        """Follow the links from head to tail for invariant checks.

        Returns the blocks met and a list of problems (broken back links, a block met
        twice, a length that disagrees with the counter). Stops at the first repeat, so
        a cycle cannot hang it.
        """
        problems: list[str] = []
        seen: set[int] = set()  # id() of nodes met
        met: list[KVCacheBlock] = []
        prev, node = self._head, self._head.next_free
        while node is not self._tail:
            if node is None:
                problems.append("free queue link is None before the tail sentinel")
                break
            if node.prev_free is not prev:
                problems.append(f"block {node.block_id}: prev_free does not point back")
            if id(node) in seen:
                problems.append(f"block {node.block_id} appears twice in the free queue")
                break
            seen.add(id(node))
            met.append(node)
            prev, node = node, node.next_free
        else:
            if self._tail.prev_free is not prev:
                problems.append("tail sentinel's prev_free does not point at the last block")
        if not problems and len(met) != self._len:
            problems.append(f"free queue holds {len(met)} blocks but counts {self._len}")
        return met, problems


class BlockPool:
    """A fixed set of physical blocks with reference counts and a free queue.

    With `reserve_null_block` (the device KV cache), block 0 is the null block: padded
    block-table entries and padded slots point at it, so it is never handed out, never
    freed and never in the free queue. The host swap pool has no padding and uses every
    block (`reserve_null_block=False`).

    Invariant: every non-null block either has `ref_count == 0` and sits in the free
    queue, or has `ref_count > 0` and does not.
    """

    def __init__(self, num_blocks: int, *, reserve_null_block: bool = True) -> None:
        min_blocks = 2 if reserve_null_block else 0
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < min_blocks:
            raise ValueError(
                f"num_blocks must be an int >= {min_blocks} "
                f"(reserve_null_block={reserve_null_block}), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID] if reserve_null_block else None
        first_usable = 1 if reserve_null_block else 0
        self.free_queue = FreeBlockQueue(self.blocks[first_usable:])
        self._num_usable = num_blocks - first_usable
        # Prefix cache: key digest -> the one block registered under it. Entries live
        # while the block is referenced or free-but-not-reused; `get_new_blocks` evicts.
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0  # cached blocks reused for new contents

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self._num_usable

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue._len  # its length, without a call to __len__: read every step, many times

    def block_states(self) -> str:
        """One character per block, by block id: BLOCK_STATES' codes (free, used by one
        table, shared by several, free but still in the prefix cache, the null block).
        For pictures of the pool (engine/pool_snapshot.py); O(num_blocks), no allocation
        beyond the string."""
        out = bytearray([FREE]) * self.num_blocks
        for block in self.blocks:
            refs = block.ref_count
            if refs:
                out[block.block_id] = USED if refs == 1 else SHARED
            elif block.block_key is not None:
                out[block.block_id] = CACHED
        if self.null_block is not None:
            out[NULL_BLOCK_ID] = NULL
        return out.decode("ascii")

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref_count 1.

        Raises ValueError (and takes nothing) if fewer are free: callers check first.
        A block handed out is empty, so its stale prefix-cache key is cleared.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        out = self.free_queue.pop_n(num_blocks)
        for block in out:
            assert block.ref_count == 0, f"free block {block.block_id} has refs"
            block.ref_count = 1
            if block.block_key is not None:  # LRU eviction from the prefix cache
                self._uncache(block)
                self.num_evictions += 1
        return out

    # ---- prefix cache -------------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_key: BlockKey) -> bool:
        """Register a full, referenced block under `block_key`; True if it was registered.

        If another block already holds that digest (the same key, or a colliding one),
        the cache keeps the older block and this one stays unregistered: still a valid
        block of its sequence, just not findable. The caller's chain goes on from its own
        key either way, never from whatever holds the digest.
        """
        self._check_owned(block)
        if block.ref_count == 0 or block.block_key is not None:
            raise ValueError(f"block {block.block_id} must be referenced and not yet cached")
        if not isinstance(block_key, BlockKey):
            raise ValueError(f"block_key must be a BlockKey, got {type(block_key).__name__}")
        if block_key.digest in self.cached:
            return False
        block.block_key = block_key
        self.cached[block_key.digest] = block
        return True

    def lookup(self, block_key: BlockKey) -> KVCacheBlock | None:
        """The cached block for this key's digest, if its key matches in full (else None)."""
        block = self.cached.get(block_key.digest)
        return block if block is not None and block.block_key == block_key else None

    def reset_cache(self) -> int:
        """Forget every cached block (their contents stay until reused); returns how many."""
        num = len(self.cached)
        for block in list(self.cached.values()):
            self._uncache(block)
        return num

    def _uncache(self, block: KVCacheBlock) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_key = None

    def incr_ref(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (a new table holds it).

        A block with ref_count 0 is taken out of the free queue first (a prefix-cache hit
        on a freed block keeps its contents), so the free xor referenced invariant holds.
        """
        blocks = list(blocks)
        for block in blocks:
            self._check_owned(block)
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the queue's tail.

        Validates the whole list before changing anything: dropping more references than
        a block has (including freeing a free block) raises ValueError and frees nothing.
        Pass the blocks in the order they should be evicted (first in, first reused).
        """
        # One pass that drops the references and undoes them on the first bad block (a
        # block listed twice meets its own first drop), then the queue appends.
        owned, null, num_owned, dropped, zeros = self.blocks, self.null_block, self.num_blocks, [], []
        for block in blocks:
            refs, block_id = block.ref_count, block.block_id
            if not refs or block is null or not 0 <= block_id < num_owned or owned[block_id] is not block:
                for undo in dropped:
                    undo.ref_count += 1
                self._check_owned(block)  # its message, if it is not this pool's
                raise ValueError(f"freeing block {block_id} more times than its ref_count {block.ref_count}")
            block.ref_count = refs - 1
            dropped.append(block)
            if refs == 1:
                zeros.append(block)
        self.free_queue.extend(zeros)

    def _check_owned(self, block: KVCacheBlock) -> None:
        if block is self.null_block:
            raise ValueError("the null block is never referenced nor freed")
        if not 0 <= block.block_id < self.num_blocks or self.blocks[block.block_id] is not block:
            raise ValueError(f"block {block.block_id} does not belong to this pool")

    def check_invariants(self) -> list[str]:
        """Problems with the free queue and the free xor referenced rule (empty if none).

        Reference counts against block tables are the block manager's to check.
        """
        met, problems = self.free_queue.walk()
        in_queue = {id(b) for b in met}
        if self.null_block is not None:
            if id(self.null_block) in in_queue or self.null_block.in_free_queue:
                problems.append("the null block is in the free queue")
            if self.null_block.ref_count != 0:
                problems.append(f"the null block has ref_count {self.null_block.ref_count}")
        for block in met:
            if not (0 <= block.block_id < self.num_blocks) or self.blocks[block.block_id] is not block:
                problems.append(f"free queue holds foreign block {block.block_id}")
        for block in self.blocks:
            if block is self.null_block:
                continue
            free = id(block) in in_queue
            if block.ref_count < 0:
                problems.append(f"block {block.block_id} has ref_count {block.ref_count} < 0")
            if free and block.ref_count != 0:
                problems.append(
                    f"block {block.block_id} is in the free queue with ref_count {block.ref_count}")
            if not free and block.ref_count == 0:
                problems.append(f"block {block.block_id} is neither free nor referenced")
        for digest, block in self.cached.items():
            key = block.block_key
            if key is None or key.digest != digest or not key.digest_is_consistent():
                problems.append(f"cached block {block.block_id} does not match its hash entry")
        for block in self.blocks:
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                problems.append(f"block {block.block_id} has a hash but is not in the cache")
        return problems
