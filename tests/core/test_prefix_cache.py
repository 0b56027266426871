"""Prefix caching in the block manager: chained hashes, verified hits, LRU eviction.

Hand cases on a pool of 7 blocks (6 usable) with block_size 2, then a hypothesis walk
that models the device: every block's contents are tracked as slots get written and
copy-on-write copies happen, and every cache hit must hand out blocks whose contents are
exactly the tokens asked for.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.core.block_manager import BlockManager


def _tokens(ids):
    return lambda start, end: ids[start:end]


def _bm(num_blocks=7, **kw):
    return BlockManager(num_blocks, 2, watermark=0.0, enable_prefix_caching=True, **kw)


def test_full_blocks_are_cached_and_hit():
    bm = _bm()
    a = [5, 6, 7, 8, 9]  # blocks [5 6] [7 8] [9 .]: two full
    bm.allocate_slots(1, 5, tokens=_tokens(a))
    assert bm.num_blocks_cached == 2
    hits = bm.find_cached_prefix(_tokens(a + [1]), 6)  # (6-1)//2 = 2 full blocks to look up
    assert [h.block_id for h in hits] == bm.block_table(1)[:2]
    # The last token is never covered: a 5-token prompt looks up (5-1)//2 = 2 blocks,
    # a 4-token one only (4-1)//2 = 1, so its last block's logits get computed.
    assert len(bm.find_cached_prefix(_tokens(a[:4]), 4)) == 1


def test_hash_is_chained_and_key_verified():
    bm = _bm()
    bm.allocate_slots(1, 4, tokens=_tokens([5, 6, 7, 8]))
    # Same second block, different first block: the chain breaks at block 0.
    assert bm.find_cached_prefix(_tokens([1, 1, 7, 8, 0]), 5) == []
    # A forged entry whose hash matches but whose key differs is not served.
    block = bm.find_cached_prefix(_tokens([5, 6, 0]), 3)[0]
    block.block_key = (None, (9, 9), ())
    assert bm.find_cached_prefix(_tokens([5, 6, 0]), 3) == []


def test_extra_keys_separate_caches():
    bm = _bm()
    bm.allocate_slots(1, 2, tokens=_tokens([5, 6]), extra_keys=("adapter-a",))
    assert bm.find_cached_prefix(_tokens([5, 6, 0]), 3) == []
    assert len(bm.find_cached_prefix(_tokens([5, 6, 0]), 3, extra_keys=("adapter-a",))) == 1


def test_hit_shares_blocks_and_freed_blocks_stay_cached():
    bm = _bm()
    a = [5, 6, 7, 8, 9]
    bm.allocate_slots(1, 5, tokens=_tokens(a))
    table_a = bm.block_table(1)
    hits = bm.find_cached_prefix(_tokens(a), 5)
    assert bm.can_allocate(5, hits)
    assert bm.allocate_slots(2, 5, tokens=_tokens(a), cached_blocks=hits) == []
    assert bm.block_table(2)[:2] == table_a[:2] and bm.block_table(2)[2] != table_a[2]
    assert bm.num_free_blocks == 6 - 4  # 3 blocks for seq 1, one more for seq 2
    bm.free(1)
    bm.free(2)
    bm.check_invariants()
    assert bm.num_free_blocks == 6 and bm.num_blocks_cached == 2  # free, still cached
    hits = bm.find_cached_prefix(_tokens(a), 5)
    assert [h.block_id for h in hits] == table_a[:2]
    # Both hits sit in the free queue: taking them costs two free blocks, plus one new.
    assert bm.allocate_slots(3, 5, tokens=_tokens(a), cached_blocks=hits) == []
    assert bm.num_free_blocks == 3


def test_lru_eviction_only_when_a_fresh_block_is_needed():
    bm = _bm()
    bm.allocate_slots(1, 4, tokens=_tokens([5, 6, 7, 8]))  # 2 cached blocks
    bm.free(1)  # freed last block first: [7 8] is evicted before [5 6]
    bm.allocate_slots(2, 8, tokens=_tokens([1, 2, 3, 4, 1, 2, 3, 4]))  # 4 uncached free blocks used
    # Hashes are chained, so the repeated [1 2] [3 4] are new keys: 2 + 4 cached blocks.
    assert bm.num_evictions == 0 and bm.num_blocks_cached == 2 + 4
    bm.allocate_slots(3, 2)  # needs a fresh block: evicts the LRU cached one, [7 8]
    assert bm.num_evictions == 1
    assert len(bm.find_cached_prefix(_tokens([5, 6, 7, 8, 0]), 5)) == 1
    bm.check_invariants()


def test_reset_forgets_everything_but_keeps_tables():
    bm = _bm()
    bm.allocate_slots(1, 4, tokens=_tokens([5, 6, 7, 8]))
    assert bm.reset_prefix_cache() == 2
    assert bm.num_blocks_cached == 0 and bm.num_tokens(1) == 4
    assert bm.find_cached_prefix(_tokens([5, 6, 7, 8, 0]), 5) == []
    bm.check_invariants()


def test_caching_off_finds_nothing():
    bm = BlockManager(7, 2, watermark=0.0)
    bm.allocate_slots(1, 4, tokens=_tokens([5, 6, 7, 8]))
    assert bm.num_blocks_cached == 0 and bm.find_cached_prefix(_tokens([5, 6, 7, 8, 0]), 5) == []


def test_cached_blocks_only_start_a_sequence():
    bm = _bm()
    bm.allocate_slots(1, 4, tokens=_tokens([5, 6, 7, 8]))
    hits = bm.find_cached_prefix(_tokens([5, 6, 7, 8, 0]), 5)
    with pytest.raises(ValueError, match="new sequence"):
        bm.allocate_slots(1, 6, cached_blocks=hits)
    with pytest.raises(ValueError, match="more tokens"):
        bm.allocate_slots(2, 3, cached_blocks=hits)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admit (with lookup) / grow / fork / free / reset on a 9-block pool.

    Tokens come from a 3-letter alphabet and new sequences often reuse an earlier
    sequence's prefix, so hits, shared partial blocks, duplicate keys and evictions are
    all frequent. `contents` models the device: block id -> tokens in its slots.
    """

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(9, 2, watermark=0.0, enable_prefix_caching=True)
        self.contents: dict[int, list] = {}
        self.tokens: dict[int, list[int]] = {}  # seq id -> its tokens (all have slots)
        self.next_id = 0
        self.num_hits = 0

    def _write(self, seq, orders, old_n):
        for src, dst in orders:
            self.contents[dst] = list(self.contents[src])
        table, toks = self.bm.block_table(seq), self.tokens[seq]
        for pos in range(old_n, len(toks)):
            block = self.contents.setdefault(table[pos // 2], [None, None])
            if pos % 2 == 0:  # a fresh block's stale second slot is never read
                block[1] = None
            block[pos % 2] = toks[pos]

    @rule(data=st.data(), n=st.integers(1, 7))
    def admit(self, data, n):
        donors = sorted(self.tokens)
        base = self.tokens[data.draw(st.sampled_from(donors))] if donors and data.draw(st.booleans()) else []
        toks = (base + data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))[: max(n, 1)]
        hits = self.bm.find_cached_prefix(_tokens(toks), len(toks))
        for i, block in enumerate(hits):  # a hit holds exactly the tokens asked for
            assert self.contents[block.block_id] == toks[2 * i: 2 * i + 2]
        seq, self.next_id = self.next_id, self.next_id + 1
        num_total = data.draw(st.integers(len(hits) * 2, len(toks)))
        out = self.bm.allocate_slots(seq, num_total, tokens=_tokens(toks), cached_blocks=hits)
        if out is None:
            assert not self.bm.has_seq(seq)
            return
        self.num_hits += len(hits)
        assert out == []
        self.tokens[seq] = toks[:num_total]
        self._write(seq, out, len(hits) * 2)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 3))
    def grow(self, data, k):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[seq] + data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k))
        old_n = len(self.tokens[seq])
        out = self.bm.allocate_slots(seq, len(toks), tokens=_tokens(toks))
        if out is not None:
            self.tokens[seq] = toks
            self._write(seq, out, old_n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        for seq, toks in self.tokens.items():  # sharing and copy-on-write never corrupt a table
            table = bm.block_table(seq)
            assert bm.num_tokens(seq) == len(toks)
            for i, block in enumerate(table):
                want = toks[2 * i: 2 * i + 2]
                assert self.contents[block][: len(want)] == want, (seq, i)
        for block in bm._device.cached.values():  # a cached block holds its key's tokens
            assert tuple(self.contents[block.block_id]) == block.block_key[1]

    def teardown(self):
        for seq in sorted(self.tokens):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks  # every block free or cached


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
