"""Prefix caching in the block manager: chained hashes, verified hits, LRU eviction.

Hand cases on a pool of 7 blocks (6 usable) with block_size 2; keys that name the whole
prefix (sha256 chain, stable across processes, safe under a deliberately colliding hash
function); cache_salt and num_cached_tokens at the block-manager and scheduler level;
then a hypothesis walk that models the device: every block's contents are tracked as
slots get written and copy-on-write copies happen, and every cache hit must hand out
blocks holding K/V of exactly the salt and prefix asked for.
"""

import pathlib
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core import prefix_cache
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.prefix_cache import BlockKey
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def test_blocks_are_keyed_only_over_known_tokens():
    """Async scheduling allocates a slot for a token still on the device (its id unknown): the
    block it fills is not registered (its key would name a placeholder) until the id is read."""
    bm = _bm()
    ids = [5, 6, 7, -1]  # the last is pending: its id reads as a placeholder
    bm.allocate_slots(1, 3, tokens=_tokens(ids))
    bm.allocate_slots(1, 4, tokens=_tokens(ids), num_known_tokens=3)  # fills block [7, ?]
    assert bm.num_blocks_cached == 1
    assert len(bm.find_cached_prefix(_tokens([5, 6, 7, -1, 0]), 5)) == 1
    ids[3] = 8  # read back
    bm.cache_known_blocks(1, _tokens(ids), 4)
    assert bm.num_blocks_cached == 2
    assert [h.block_id for h in bm.find_cached_prefix(_tokens([5, 6, 7, 8, 0]), 5)] == bm.block_table(1)[:2]
    assert bm.find_cached_prefix(_tokens([5, 6, 7, -1, 0]), 5)[1:] == []  # no block under the placeholder


def test_hash_is_chained_and_key_verified():
    bm = _bm()
    bm.allocate_slots(1, 4, tokens=_tokens([5, 6, 7, 8]))
    # Same second block, different first block: the chain breaks at block 0.
    assert bm.find_cached_prefix(_tokens([1, 1, 7, 8, 0]), 5) == []
    # A forged entry whose digest matches but whose tokens differ is not served.
    block = bm.find_cached_prefix(_tokens([5, 6, 0]), 3)[0]
    block.block_key = BlockKey(None, (9, 9), (), block.block_key.digest)
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


# --------------------------------------------------------------------------- whole-prefix keys


def _sum_hash(parent_digest, token_ids, extra_keys):
    """A deliberately weak digest: the sum of the block's tokens, parent ignored, so
    [1 2] and [0 3] collide, and so does every block of equal sum under any prefix."""
    return sum(token_ids).to_bytes(8, "little")


def test_a_lookup_memo_hashes_each_block_once_and_finds_what_a_fresh_lookup_finds(monkeypatch):
    """A sequence waiting at the head of the queue is looked up every step: with its memo
    (Sequence.prefix_keys) its blocks are hashed once, and every lookup, after the cache
    changed too (a registration, an eviction), finds what a lookup without it finds."""
    bm = _bm()
    cached = [5, 6, 7, 8, 9, 10]
    bm.allocate_slots(0, 6, tokens=_tokens(cached))  # 3 full blocks registered
    calls = []
    real = prefix_cache.hash_block
    monkeypatch.setattr(prefix_cache, "hash_block", lambda *a: calls.append(a) or real(*a))
    waiting, memo = [5, 6, 7, 8, 1, 2, 3], []  # 3 full blocks to look up: 2 hit, the third misses

    def lookups():
        with_memo = bm.find_cached_prefix(_tokens(waiting), len(waiting), memo=memo)
        assert with_memo == bm.find_cached_prefix(_tokens(waiting), len(waiting))
        return [b.block_id for b in with_memo]

    assert lookups() == bm.block_table(0)[:2]
    calls.clear()
    for _ in range(3):
        assert len(bm.find_cached_prefix(_tokens(waiting), len(waiting), memo=memo)) == 2
    assert calls == [], "the memo's keys are reused"
    bm.allocate_slots(1, 6, tokens=_tokens([5, 6, 7, 8, 1, 2]))  # registers the missing third block
    assert lookups() == bm.block_table(0)[:2] + bm.block_table(1)[2:3]
    bm.free(0), bm.free(1)
    bm.allocate_slots(2, 12, tokens=_tokens(list(range(20, 32))))  # takes all 6 blocks: evicts every cached one
    assert lookups() == []


def test_colliding_digest_never_serves_kv_of_another_prefix(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", _sum_hash)
    bm = _bm()
    bm.allocate_slots(1, 3, tokens=_tokens([1, 2, 9]))  # caches [1 2]
    bm.allocate_slots(2, 5, tokens=_tokens([0, 3, 5, 6, 9]))  # [0 3] collides: not cached; [5 6] is
    assert bm.num_blocks_cached == 2
    # [1 2] is a correct hit; [5 6] was computed after [0 3], so it must not follow it.
    hits = bm.find_cached_prefix(_tokens([1, 2, 5, 6, 9]), 5)
    assert [h.block_id for h in hits] == bm.block_table(1)[:1]
    bm.check_invariants()


def test_unregistered_block_lends_no_key_to_its_children(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", _sum_hash)
    bm = _bm()
    bm.allocate_slots(1, 3, tokens=_tokens([1, 2, 9]))
    bm.allocate_slots(2, 5, tokens=_tokens([0, 3, 5, 6, 9]))
    first, second = bm._keys[2]
    # seq 2's chain is its own: [0 3] -> [5 6], not the cached [1 2]'s key
    assert first.token_ids == (0, 3) and second.parent is first
    assert first != bm._keys[1][0] and first.digest == bm._keys[1][0].digest
    # a block whose parent was never registered is unreachable: the walk stops at [0 3]
    assert bm.find_cached_prefix(_tokens([0, 3, 5, 6, 9]), 5) == []


def test_keys_are_a_sha256_chain_stable_across_processes():
    key = BlockKey.chain(BlockKey.chain(None, (1, 2, 3)), (4, 5, 6), ("lora", 7))
    assert len(key.digest) == 32 and key.digest_is_consistent()
    assert key != BlockKey.chain(BlockKey.chain(None, (1, 2, 4)), (4, 5, 6), ("lora", 7))  # parent differs
    assert BlockKey.chain(None, (1,), ("a",)).digest != BlockKey.chain(None, (1,), (("a",),)).digest
    assert BlockKey.chain(None, (1, 2)).digest != BlockKey.chain(None, (1,), (2,)).digest  # tokens vs extras
    code = ("from paged_jax.core.prefix_cache import BlockKey; "
            "print(BlockKey.chain(BlockKey.chain(None, (1, 2, 3)), (4, 5, 6), ('lora', 7)).digest.hex())")
    for seed in ("1", "2"):  # Python's str hash() differs between these; the digest must not
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed}, cwd=REPO_ROOT)
        assert out.stdout.strip() == key.digest.hex()
    with pytest.raises(ValueError, match="extra keys"):
        BlockKey.chain(None, (1,), (1.5,))


# --------------------------------------------------------------------------- cache_salt


def test_cache_salt_separates_prefixes_in_the_block_manager():
    bm = _bm(num_blocks=20)
    prompt = [5, 6, 7, 8, 9]
    for seq_id, salt in ((1, "a"), (2, "b"), (3, None)):
        assert bm.find_cached_prefix(_tokens(prompt), 5, cache_salt=salt) == []  # nothing of this salt yet
        bm.allocate_slots(seq_id, 5, tokens=_tokens(prompt), cache_salt=salt)
    for seq_id, salt in ((1, "a"), (2, "b"), (3, None)):  # each salt finds exactly its own blocks
        hits = bm.find_cached_prefix(_tokens(prompt), 5, cache_salt=salt)
        assert [h.block_id for h in hits] == bm.block_table(seq_id)[:2]
    assert len({bm.block_table(s)[0] for s in (1, 2, 3)}) == 3
    assert bm.find_cached_prefix(_tokens(prompt), 5, cache_salt="c") == []
    with pytest.raises(ValueError, match="cache_salt"):
        bm.allocate_slots(4, 5, cache_salt=1)


def _scheduler(num_blocks=20, **kw):
    config = EngineConfig(block_size=2, max_model_len=16, max_num_seqs=8, max_num_batched_tokens=32,
                          watermark=0.0, attention_backend="reference", **kw)
    bm = BlockManager(num_blocks, 2, watermark=0.0, enable_prefix_caching=True)
    return Scheduler(config, bm), bm


def _seq(seq_id, prompt, salt=None):
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, prompt_token_ids=list(prompt),
                    sampling_params=SamplingParams(max_tokens=8), arrival_time=0.0, seed=0, cache_salt=salt)


def _run_step(sched, seqs):
    out = sched.schedule()
    for _, seq in sched.update(out, {s.seq_id: s for s in seqs}):
        seq.output_token_ids.append(3)
    return out


def test_scheduler_shares_prefix_blocks_only_within_a_salt():
    sched, bm = _scheduler()
    prompt = [5, 6, 7, 8, 9]
    first = [_seq(0, prompt, "a"), _seq(1, prompt, "b"), _seq(2, prompt)]
    for seq in first:
        sched.add(seq)
    _run_step(sched, first)
    assert len({bm.block_table(s.seq_id)[0] for s in first}) == 3  # no sharing across salts
    again = [_seq(3, prompt, "a"), _seq(4, prompt, "b"), _seq(5, prompt)]
    for seq in again:
        sched.add(seq)
    out = _run_step(sched, first + again)
    for old, new in zip(first, again):  # ... and full sharing within one
        assert bm.block_table(new.seq_id)[:2] == bm.block_table(old.seq_id)[:2]
        assert new.num_cached_tokens == 4 and old.num_cached_tokens == 0
    assert {c.seq_id: c.start_position for c in out.chunks if c.seq_id >= 3} == {3: 4, 4: 4, 5: 4}


def test_num_cached_tokens_is_kept_from_the_first_admission():
    sched, bm = _scheduler(num_blocks=5)  # 4 usable blocks of 2
    warm = _seq(0, [5, 6, 7, 8, 9])
    sched.add(warm)
    _run_step(sched, [warm])
    sched.finish(warm, warm.status.FINISHED_ABORTED)  # its full blocks stay cached
    early, late = _seq(1, [1, 2]), _seq(2, [5, 6, 7, 8, 9])
    sched.add(early)
    sched.add(late)
    seqs = [early, late]
    _run_step(sched, seqs)
    assert late.num_cached_tokens == 4 and late.num_computed_tokens == 5
    for _ in range(10):  # both grow until the later one is preempted (recompute)
        _run_step(sched, seqs)
        if late.num_preemptions:
            break
    assert late.num_preemptions == 1 and late.status is late.status.WAITING
    sched.finish(early, early.status.FINISHED_LENGTH)
    _run_step(sched, seqs)  # re-admitted: its own blocks, registered as it grew, are hits now
    assert late.status is late.status.RUNNING
    assert late.num_computed_tokens > 4  # re-admitted with more than its first cached blocks...
    assert late.num_cached_tokens == 4  # ... but the request still reports the first admission's


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admit (with lookup) / grow / fork / free / reset on a 9-block pool.

    Tokens come from a 3-letter alphabet, salts from {None, "a", "b"}, and new sequences
    often reuse an earlier sequence's prefix, so hits, shared partial blocks, duplicate
    keys and evictions are all frequent. `contents` models the device: block id -> per
    slot, (salt, prefix) of the sequence that wrote it (K/V depend on the whole prefix),
    so a hit computed under another prefix or salt is caught, not just wrong tokens.
    """

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(9, 2, watermark=0.0, enable_prefix_caching=True)
        self.contents: dict[int, list] = {}
        self.tokens: dict[int, list[int]] = {}  # seq id -> its tokens (all have slots)
        self.salts: dict[int, str | None] = {}
        self.next_id = 0
        self.num_hits = 0

    def _want(self, seq, toks, pos):
        return (self.salts[seq], tuple(toks[: pos + 1]))

    def _write(self, seq, orders, old_n):
        for src, dst in orders:
            self.contents[dst] = list(self.contents[src])
        table, toks = self.bm.block_table(seq), self.tokens[seq]
        for pos in range(old_n, len(toks)):
            block = self.contents.setdefault(table[pos // 2], [None, None])
            if pos % 2 == 0:  # a fresh block's stale second slot is never read
                block[1] = None
            block[pos % 2] = self._want(seq, toks, pos)

    @rule(data=st.data(), n=st.integers(1, 7), salt=st.sampled_from([None, None, "a", "b"]))
    def admit(self, data, n, salt):
        donors = sorted(self.tokens)
        base = self.tokens[data.draw(st.sampled_from(donors))] if donors and data.draw(st.booleans()) else []
        toks = (base + data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))[: max(n, 1)]
        hits = self.bm.find_cached_prefix(_tokens(toks), len(toks), cache_salt=salt)
        for i, block in enumerate(hits):  # a hit holds K/V of exactly this salt and prefix
            assert self.contents[block.block_id] == [(salt, tuple(toks[: p + 1])) for p in (2 * i, 2 * i + 1)]
        seq, self.next_id = self.next_id, self.next_id + 1
        num_total = data.draw(st.integers(len(hits) * 2, len(toks)))
        out = self.bm.allocate_slots(seq, num_total, tokens=_tokens(toks), cached_blocks=hits, cache_salt=salt)
        if out is None:
            assert not self.bm.has_seq(seq)
            return
        self.num_hits += len(hits)
        assert out == []
        self.tokens[seq], self.salts[seq] = toks[:num_total], salt
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
        self.tokens[child], self.salts[child] = list(self.tokens[parent]), self.salts[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq], self.salts[seq]

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
            for pos in range(len(toks)):
                assert self.contents[table[pos // 2]][pos % 2] == self._want(seq, toks, pos), (seq, pos)
        for block in bm._device.cached.values():  # a cached block holds its key's tokens
            assert tuple(slot[1][-1] for slot in self.contents[block.block_id]) == block.block_key.token_ids

    def teardown(self):
        for seq in sorted(self.tokens):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks  # every block free or cached


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
