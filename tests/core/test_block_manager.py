"""Block pool and block manager: hand-checked cases (the random walk is in
test_block_manager_stateful.py).

Most hand cases use a 5-block device pool: block 0 is the null block, so blocks 1..4
are usable and come out of the free queue in that order; block_size 4.
"""

import pytest

from paged_jax.core.block_manager import BlockManager
from paged_jax.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from paged_jax.core.block_swapping import SwapSpace


def ref_counts(bm, seq_id):
    """Device-side (or host-side, if swapped) ref_count of each block in the table."""
    pool = bm._swap.pool if bm.is_swapped(seq_id) else bm._device
    return [pool.blocks[i].ref_count for i in bm.block_table(seq_id)]


# --------------------------------------------------------------------------- pool


def test_pool_hands_out_blocks_in_order_and_never_the_null_block():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]  # block 0 is reserved
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)


def test_pool_without_null_block_uses_every_block():
    pool = BlockPool(3, reserve_null_block=False)  # host swap pool
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)  # a failed request takes nothing
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert BlockPool(0, reserve_null_block=False).num_free_blocks == 0
    with pytest.raises(ValueError):
        BlockPool(1)  # only the null block


def test_pool_free_errors_change_nothing():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="more times than its ref_count"):
        pool.free_blocks([b, a, a])  # a: ref_count 1, two drops; b's drop is undone too
    assert a.ref_count == 1 and b.ref_count == 1 and pool.num_free_blocks == 2
    with pytest.raises(ValueError, match="does not belong"):
        pool.free_blocks([b, KVCacheBlock(block_id=3, ref_count=1)])
    assert b.ref_count == 1 and pool.num_free_blocks == 2
    pool.free_blocks([a, b])
    assert [blk.block_id for blk in pool.free_queue][-2:] == [a.block_id, b.block_id]  # freed in list order
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="more times than its ref_count"):
        pool.free_blocks([a])  # already free
    with pytest.raises(ValueError, match="null block"):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError, match="does not belong"):
        pool.free_blocks([KVCacheBlock(block_id=2, ref_count=1)])
    assert pool.check_invariants() == []


def test_free_queue_order_tail_append_and_middle_remove():
    pool = BlockPool(5)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    # Freed blocks go to the tail in the order freed: 2, 4, 1.
    pool.free_blocks([b2])
    pool.free_blocks([b4])
    pool.free_blocks([b1])
    assert [b.block_id for b in pool.free_queue] == [2, 4, 1]
    # A reference to a free block (a future prefix-cache hit) unlinks it from the middle.
    pool.incr_ref([b4])
    assert b4.ref_count == 1 and not b4.in_free_queue
    assert [b.block_id for b in pool.free_queue] == [2, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]  # head first
    assert pool.check_invariants() == []


def test_free_queue_rejects_double_append_and_foreign_remove():
    q = FreeBlockQueue()
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    q.append(a)
    with pytest.raises(ValueError, match="already in a free queue"):
        q.append(a)
    with pytest.raises(ValueError, match="not in a free queue"):
        q.remove(b)
    q.append(b)
    q.remove(a)  # head, leaving just b
    assert list(q) == [b] and len(q) == 1
    assert q.popleft() is b and len(q) == 0
    with pytest.raises(ValueError, match="empty"):
        q.popleft()


# --------------------------------------------------------------------------- manager


def test_bad_arguments():
    for kwargs in (dict(num_blocks=1, block_size=4), dict(num_blocks=5, block_size=0),
                   dict(num_blocks=5, block_size=4, watermark=1.0),
                   dict(num_blocks=5, block_size=4, watermark=-0.1),
                   dict(num_blocks=5, block_size=4, num_host_blocks=-1),
                   dict(num_blocks=5.0, block_size=4)):
        with pytest.raises(ValueError):
            BlockManager(**kwargs)
    bm = BlockManager(5, 4)
    with pytest.raises(ValueError):
        bm.allocate_slots(1, -1)
    with pytest.raises(KeyError):
        bm.block_table(7)
    with pytest.raises(KeyError):
        bm.free(7)


def test_allocate_on_demand():
    bm = BlockManager(5, 4, watermark=0.0)
    assert bm.num_usable_blocks == 4
    assert bm.allocate_slots(1, 6) == []  # ceil(6 / 4) = 2 blocks
    assert bm.block_table(1) == [1, 2] and bm.num_free_blocks == 2
    assert bm.allocate_slots(1, 8) == []  # 8 tokens still fit in 2 blocks
    assert bm.block_table(1) == [1, 2] and bm.num_free_blocks == 2
    assert bm.allocate_slots(1, 9) == []  # token 9 starts a 3rd block
    assert bm.block_table(1) == [1, 2, 3] and bm.num_free_blocks == 1
    assert bm.num_tokens(1) == 9 and bm.usage() == 3 / 4
    with pytest.raises(ValueError, match="cannot shrink"):
        bm.allocate_slots(1, 8)
    bm.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(5, 4, watermark=0.0)
    bm.allocate_slots(1, 9)  # 3 blocks, 1 free
    assert bm.allocate_slots(2, 5) is None  # new seq needs 2 blocks
    assert not bm.has_seq(2)
    assert bm.allocate_slots(1, 17) is None  # 5 blocks total: 2 more, 1 free
    assert bm.block_table(1) == [1, 2, 3] and bm.num_tokens(1) == 9
    assert bm.num_free_blocks == 1
    assert bm.allocate_slots(1, 16) == []  # 4 blocks: exactly the last free one
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_watermark_applies_to_admission_only():
    bm = BlockManager(5, 4, watermark=0.25)  # int(0.25 * 4) = 1 block kept free
    assert bm.watermark_blocks == 1
    assert bm.can_allocate(12)  # 3 blocks: 4 - 3 = 1 >= 1
    assert not bm.can_allocate(13)  # 4 blocks: 4 - 4 = 0 < 1
    assert bm.allocate_slots(1, 16) == []  # a running sequence may use the watermark
    assert BlockManager(5, 4).watermark_blocks == 0  # default 1% of 4 blocks rounds to 0


def test_free_returns_everything():
    bm = BlockManager(5, 4)
    bm.allocate_slots(1, 6)
    bm.allocate_slots(2, 5)
    assert bm.num_free_blocks == 0
    bm.free(2)
    bm.free(1)
    assert bm.num_free_blocks == 4 and bm.usage() == 0.0
    assert not bm.has_seq(1) and not bm.has_seq(2)
    # Seq 1 freed its tail block first: queue is 3, 4 (seq 2, reversed), then 2, 1.
    assert [b.block_id for b in bm._device.free_queue] == [4, 3, 2, 1]
    bm.check_invariants()


def test_copy_on_write_after_fork_when_last_block_is_partial():
    bm = BlockManager(5, 4, watermark=0.0)
    bm.allocate_slots(1, 6)  # [1, 2], block 2 holds 2 of 4 tokens
    bm.fork(1, 2)
    assert bm.block_table(2) == [1, 2] and bm.num_tokens(2) == 6
    assert ref_counts(bm, 1) == [2, 2]
    # Held: 6 tokens in 2 distinct blocks (8 slots); unshared it would be 4 blocks.
    assert (bm.num_tokens_held(), bm.num_slots_allocated()) == (6, 8)
    assert bm.num_blocks_without_sharing() == 4
    # Seq 2 writes token 7 into shared block 2: copy it into fresh block 3 first.
    assert bm.allocate_slots(2, 7) == [(2, 3)]
    assert bm.block_table(2) == [1, 3] and bm.block_table(1) == [1, 2]
    assert ref_counts(bm, 1) == [2, 1] and ref_counts(bm, 2) == [2, 1]
    assert bm.allocate_slots(1, 7) == []  # block 2 is now seq 1's alone: no copy
    assert (bm.num_tokens_held(), bm.num_slots_allocated()) == (4 + 3 + 3, 12)
    bm.check_invariants()


def test_no_copy_when_shared_last_block_is_full():
    bm = BlockManager(5, 4, watermark=0.0)
    bm.allocate_slots(1, 8)  # [1, 2], both full
    bm.fork(1, 2)
    assert bm.allocate_slots(2, 9) == []  # token 9 goes to a new block 3
    assert bm.block_table(2) == [1, 2, 3]
    assert ref_counts(bm, 2) == [2, 2, 1]
    bm.check_invariants()


def test_copy_on_write_without_room_changes_nothing():
    bm = BlockManager(3, 4, watermark=0.0)  # 2 usable blocks
    bm.allocate_slots(1, 6)  # [1, 2]: no block left
    bm.fork(1, 2)
    assert bm.allocate_slots(2, 7) is None  # needs a copy of block 2
    assert bm.block_table(2) == [1, 2] and bm.num_tokens(2) == 6
    assert ref_counts(bm, 2) == [2, 2]
    bm.check_invariants()


def test_fork_errors():
    bm = BlockManager(5, 4, num_host_blocks=4)
    bm.allocate_slots(1, 6)
    bm.fork(1, 2)
    with pytest.raises(ValueError, match="already exists"):
        bm.fork(1, 2)
    with pytest.raises(KeyError):
        bm.fork(9, 3)
    bm.swap_out([1, 2])
    with pytest.raises(ValueError, match="swapped out"):
        bm.fork(1, 3)
    with pytest.raises(ValueError, match="swapped out"):
        bm.allocate_slots(1, 7)


def test_swap_round_trip_keeps_sharing_and_frees_device_blocks():
    bm = BlockManager(5, 4, num_host_blocks=4, watermark=0.0)
    bm.allocate_slots(1, 6)  # [1, 2]
    bm.fork(1, 2)
    bm.allocate_slots(2, 7)  # copy-on-write: seq 2 is [1, 3]
    before = {s: ref_counts(bm, s) for s in (1, 2)}  # {1: [2, 1], 2: [2, 1]}
    assert bm.can_swap_out([1, 2])
    # 3 distinct device blocks -> host blocks 0, 1, 2 (first seen order: 1, 2, 3).
    assert bm.swap_out([1, 2]) == [(1, 0), (2, 1), (3, 2)]
    assert bm.is_swapped(1) and bm.is_swapped(2)
    assert bm.block_table(1) == [0, 1] and bm.block_table(2) == [0, 2]
    assert bm.num_free_blocks == 4 and bm.num_free_host_blocks == 1
    assert (bm.num_tokens_held(), bm.num_slots_allocated()) == (0, 0)
    bm.check_invariants()
    # Device free queue: 4 (never used), then freed 2 (seq 1's tail), 3, 1.
    assert bm.can_swap_in([1, 2])
    assert bm.swap_in([1, 2]) == [(0, 4), (1, 2), (2, 3)]
    assert bm.block_table(1) == [4, 2] and bm.block_table(2) == [4, 3]
    assert {s: ref_counts(bm, s) for s in (1, 2)} == before
    assert not bm.is_swapped(1) and bm.num_free_host_blocks == 4
    assert bm.num_tokens(2) == 7
    bm.check_invariants()


def test_swap_checks():
    bm = BlockManager(5, 4, num_host_blocks=1, watermark=0.25)  # keep 1 block free
    bm.allocate_slots(1, 6)  # 2 blocks, host holds only 1
    assert not bm.can_swap_out([1])
    with pytest.raises(ValueError, match="free host blocks"):
        bm.swap_out([1])
    assert not bm.is_swapped(1) and bm.block_table(1) == [1, 2]
    with pytest.raises(ValueError, match="duplicate"):
        bm.can_swap_out([1, 1])
    with pytest.raises(ValueError, match="device-resident"):
        bm.swap_in([1])
    bm.allocate_slots(2, 1)  # block 3; swapping it out puts 3 back: free queue 4, 3
    bm.swap_out([2])
    bm.allocate_slots(3, 4)  # block 4: 4 - 2 - 1 = 1 free, the watermark
    assert not bm.can_swap_in([2])  # would leave 0 < 1 free
    assert bm.swap_in([2]) == [(0, 3)]  # allowed without the watermark
    assert bm.num_free_blocks == 0 and bm.num_free_host_blocks == 1
    bm.allocate_slots(4, 0)  # an empty sequence holds no block
    assert bm.block_table(4) == []
    bm.swap_out([3])  # block 4 -> host 0; device has 1 free again
    bm.allocate_slots(5, 1)  # takes it
    with pytest.raises(ValueError, match="1 blocks needs as many free device blocks; 0"):
        bm.swap_in([3])
    assert bm.is_swapped(3) and bm.num_free_host_blocks == 0
    bm.check_invariants()


def test_free_swapped_sequence_releases_host_blocks():
    bm = BlockManager(5, 4, num_host_blocks=4)
    bm.allocate_slots(1, 6)
    bm.swap_out([1])
    bm.free(1)
    assert bm.num_free_host_blocks == 4 and bm.num_free_blocks == 4
    bm.check_invariants()


def test_swap_of_part_of_a_sharing_group_keeps_outsiders_blocks():
    bm = BlockManager(5, 4, num_host_blocks=4)
    bm.allocate_slots(1, 8)  # [1, 2]
    bm.fork(1, 2)
    assert bm.swap_out([2]) == [(1, 0), (2, 1)]
    assert ref_counts(bm, 1) == [1, 1] and bm.num_free_blocks == 2  # seq 1 keeps them
    bm.swap_in([2])
    assert bm.block_table(2) == [3, 4]  # correct contents, no longer shared
    bm.check_invariants()


def test_a_swap_space_works_alone_on_tables_and_a_device_pool_it_is_handed():
    """SwapSpace (the part BlockManager holds) owns only the host pool and the swapped ids:
    given a device pool and tables, it moves a group that shares a block to the host and
    back, one copy per distinct block, the shared one keeping its two references."""
    device, swap = BlockPool(5), SwapSpace(3)
    a, b, c = device.get_new_blocks(3)  # ids 1, 2, 3
    device.incr_ref([a])
    tables = {7: [a, b], 8: [a, c]}  # block 1 shared by both
    assert swap.move(tables, [7, 8], device, to_host=True) == [(1, 0), (2, 1), (3, 2)]
    assert swap.swapped == {7, 8} and device.num_free_blocks == 4 and swap.num_free_blocks == 0
    assert [[blk.block_id for blk in tables[s]] for s in (7, 8)] == [[0, 1], [0, 2]]
    assert tables[7][0] is tables[8][0] and tables[7][0].ref_count == 2
    with pytest.raises(ValueError, match="swapped out; cannot swap it that way"):
        swap.group_blocks(tables, [7], swapped=False)
    orders = swap.move(tables, [7, 8], device, to_host=False)
    assert [src for src, _ in orders] == [0, 1, 2] and not swap.swapped and swap.num_free_blocks == 3
    assert tables[7][0] is tables[8][0] and tables[7][0].ref_count == 2 and device.num_free_blocks == 1
    with pytest.raises(KeyError, match="unknown sequence id 9"):
        swap.group_blocks(tables, [9], swapped=False)


# --------------------------------------------------------------------------- check_invariants


def _corrupt_ref_count(bm):
    bm._device.blocks[1].ref_count += 1


def _corrupt_host_ref_count(bm):
    bm.swap_out([1, 2])
    bm._swap.pool.blocks[0].ref_count = 1  # two swapped tables hold it


def _corrupt_cycle(bm):  # free queue 3, 4 becomes 3 -> 4 -> 3 ...
    bm._device.blocks[4].next_free = bm._device.blocks[3]


def _corrupt_null_in_table(bm):
    bm._tables[1][1] = bm._device.null_block


def _corrupt_num_tokens(bm):
    bm._num_tokens[2] = 9  # 9 tokens need 3 blocks, the table has 2


@pytest.mark.parametrize("corrupt, message", [
    (_corrupt_ref_count, "device block 1: ref_count 3 but 2 tables"),
    (_corrupt_host_ref_count, "host block 0: ref_count 1 but 2 tables"),
    (lambda bm: bm._device.free_queue.append(bm._device.blocks[2]),
     "block 2 is in the free queue with ref_count 2"),
    (_corrupt_cycle, "block 3 appears twice in the free queue"),
    (lambda bm: bm._device.free_queue.remove(bm._device.blocks[4]),
     "block 4 is neither free nor referenced"),
    (_corrupt_null_in_table, "sequence 1 holds the null block"),
    (_corrupt_num_tokens, "sequence 2: 2 blocks for 9 tokens, expected 3"),
])
def test_check_invariants_catches_corruption(corrupt, message):
    bm = BlockManager(5, 4, num_host_blocks=4)
    bm.allocate_slots(1, 6)  # [1, 2]
    bm.fork(1, 2)  # both blocks ref_count 2; free queue 3, 4
    bm.check_invariants()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.check_invariants()
