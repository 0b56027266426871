"""Block manager: a hypothesis random walk of allocate / grow / fork / free / swap,
checking every invariant after each step."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.core.block_manager import BlockManager

from test_block_manager import ref_counts


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / fork / free / swap walks on a small pool.

    9 device blocks (8 usable), block_size 2, 10 host blocks, watermark 1 block: small
    enough that allocations fail and swap limits are hit often. Swap groups are either
    random subsets or whole sharing families (closed groups, whose device ref counts
    must come back equal).
    """

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(9, 2, num_host_blocks=10, watermark=0.125)
        self.next_id = 0
        self.groups = []  # swapped groups: [seq_ids, structure, ref counts or None]
        self.mirror = {}  # seq id -> its table as rebuilt from table_update() alone (a runner's copy)

    def _snapshot(self):
        bm = self.bm
        return (bm.num_free_blocks, bm.num_free_host_blocks,
                {s: (bm.block_table(s), bm.num_tokens(s), ref_counts(bm, s))
                 for s in sorted(bm._tables)})

    def _device_seqs(self):
        return [s for s in sorted(self.bm._tables) if not self.bm.is_swapped(s)]

    def _structure(self, seq_ids):
        """Tables with block ids renamed by first appearance: the sharing pattern."""
        names = {}
        return [[names.setdefault(b, len(names)) for b in self.bm.block_table(s)]
                for s in seq_ids]

    @rule(n=st.integers(0, 7))
    def allocate(self, n):
        seq, self.next_id = self.next_id, self.next_id + 1
        fits = self.bm.can_allocate(n)
        before = self._snapshot()
        out = self.bm.allocate_slots(seq, n)
        if out is None:
            assert not fits and self._snapshot() == before and not self.bm.has_seq(seq)
        else:
            assert out == [] and self.bm.num_tokens(seq) == n
            assert ref_counts(self.bm, seq) == [1] * self.bm.num_blocks_needed(n)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data(), k=st.integers(0, 3))
    def grow(self, data, k):
        self._grow(data.draw(st.sampled_from(self._device_seqs())), k)

    def _grow(self, seq, k):
        old_table, old_n = self.bm.block_table(seq), self.bm.num_tokens(seq)
        before = self._snapshot()
        out = self.bm.allocate_slots(seq, old_n + k)
        if out is None:
            assert self._snapshot() == before
            return
        assert self.bm.num_tokens(seq) == old_n + k
        table = self.bm.block_table(seq)
        partial = old_n % 2 != 0 and k > 0
        if out:  # one copy of the old partial last block into the new private one
            assert partial and len(out) == 1
            src, dst = out[0]
            assert src == old_table[-1] and dst == table[len(old_table) - 1]
            assert src != dst and ref_counts(self.bm, seq)[len(old_table) - 1] == 1
        else:
            assert table[:len(old_table)] == old_table
        if partial:  # whoever writes into the last block holds it alone
            assert ref_counts(self.bm, seq)[len(old_table) - 1] == 1

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data.draw(st.sampled_from(self._device_seqs())))

    def _fork(self, parent):
        child, self.next_id = self.next_id, self.next_id + 1
        counts = ref_counts(self.bm, parent)
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        assert ref_counts(self.bm, child) == [c + 1 for c in counts]
        return child

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data(), k=st.integers(1, 2))
    def fork_and_write(self, data, k):
        """Parallel sampling: a child diverges at once (copy-on-write if partial)."""
        self._grow(self._fork(data.draw(st.sampled_from(self._device_seqs()))), k)

    @precondition(lambda self: self.bm._tables)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.bm._tables)))
        self.bm.free(seq)
        self.mirror.pop(seq, None)
        for group in self.groups:
            if seq in group[0]:
                group[0].remove(seq)
                group[2] = None  # the survivors' ref counts now differ

    @precondition(lambda self: self.bm._tables)
    @rule(data=st.data())
    def runner_reads_update(self, data):
        """A runner that keeps tables between steps and applies only the updates has the
        table, whatever grew, forked, copied on write or swapped since it last looked."""
        seq = data.draw(st.sampled_from(sorted(self.bm._tables)))
        k, ids = self.bm.table_update(seq)
        assert k == 0 or (seq in self.mirror and k <= len(self.mirror[seq]))
        self.mirror[seq] = self.mirror.get(seq, [])[:k] + list(ids)
        assert self.mirror[seq] == self.bm.block_table(seq)
        assert self.bm.table_update(seq) == (len(self.mirror[seq]), ())  # nothing changed since

    def _family(self, seq):
        """`seq` and every device sequence sharing a block with it, transitively."""
        family, blocks, grew = {seq}, set(self.bm.block_table(seq)), True
        while grew:
            grew = False
            for s in self._device_seqs():
                if s not in family and blocks & set(self.bm.block_table(s)):
                    family.add(s)
                    blocks |= set(self.bm.block_table(s))
                    grew = True
        return sorted(family)

    @precondition(lambda self: self._device_seqs())
    @rule(data=st.data(), whole_family=st.booleans())
    def swap_out(self, data, whole_family):
        if whole_family:
            seqs = self._family(data.draw(st.sampled_from(self._device_seqs())))
        else:
            seqs = data.draw(st.lists(st.sampled_from(self._device_seqs()), min_size=1,
                                      unique=True))
        if not self.bm.can_swap_out(seqs):
            before = self._snapshot()
            with pytest.raises(ValueError):
                self.bm.swap_out(seqs)
            assert self._snapshot() == before
            return
        structure = self._structure(seqs)
        refs = [ref_counts(self.bm, s) for s in seqs]
        held = {b for s in seqs for b in self.bm.block_table(s)}
        closed = sum(len(self.bm.block_table(s)) for s in seqs) == sum(
            self.bm._device.blocks[b].ref_count for b in held)
        assert closed or not whole_family
        orders = self.bm.swap_out(seqs)
        assert len(orders) == len(held) and {d for d, _ in orders} == held
        assert self._structure(seqs) == structure
        self.groups.append([seqs, structure, refs if closed else None])

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.groups))
        seqs, structure, refs = group
        if not self.bm.can_swap_in(seqs):
            return
        self.bm.swap_in(seqs)
        self.groups.remove(group)
        if len(seqs) == len(structure):  # no member freed meanwhile
            assert self._structure(seqs) == structure
        if refs is not None:
            assert [ref_counts(self.bm, s) for s in seqs] == refs

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        bm = self.bm
        # Brute force over every table entry: each distinct device block once, holding
        # the most tokens any of its tables puts in it.
        held, distinct = {}, set()
        for seq in self._device_seqs():
            n = bm.num_tokens(seq)
            for i, block in enumerate(bm.block_table(seq)):
                held[block] = max(held.get(block, 0), min(2, n - 2 * i))
                distinct.add(block)
        assert bm.num_slots_allocated() == 2 * len(distinct)
        assert bm.num_tokens_held() == sum(held.values())

    def teardown(self):
        for seq in sorted(self.bm._tables):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks == 8
        assert self.bm.num_free_host_blocks == 10


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_block_manager_state_machine = BlockManagerMachine.TestCase
