"""The fast-forward's main loop: steps whose decoding rows are advanced lazily.

Why: a saturated engine spends most steps decoding 20-30 sequences while a few of them
are admitted, prefill, finish or are preempted; applying such a step row by row costs
O(rows) Python, and a simulation runs over a million of them. Here a step costs O(1)
plus its events, whatever else happens in it:

- a decoding row (its last token sampled, all before it computed) takes one token every
  step, so its progress is a line, `computed = c0 + step - k0`. Its Sequence and its
  block-manager count are brought up to date (`_sync`) only where something reads them:
  a block it adds or fills (allocate_slots, in running order: block ids and prefix-cache
  registrations are the engine's), its preemption, its finish (known in advance: the
  step that samples its last token) and the end of the run;
- at most one row prefills: the last in `running`. An admission takes what budget the
  running rows leave, so a chunked prefill is the latest admission and nothing is
  admitted behind it until it completes. Under priority an admission may be inserted
  before the tail; the run ends after that step (if that prefill is chunked, the real
  scheduler steps it). The prefilling row and the admitted ones are stepped eagerly,
  through the scheduler's own pieces (`num_new_tokens`, `admit_waiting`);
- the stats' KV figures are sums kept incrementally with kv_waste's formulas (per row:
  slots s = its table's slots, count h, final length f; internal = sum max(s - f, 0),
  reservation = sum min(f, s) - sum h, held = slots allocated - (sum s - sum h)) and the
  step time's context is sum h.

Exact (tests/experiments/test_fast_forward.py): the block manager sees the same calls in
the same order as a step-by-step run, except the no-op count updates of decoding rows
between their events; a decoding row's count is set at every block it adds or fills, so
its table always has `num_blocks_needed(count)` blocks and a copy-on-write check sees a
full last block. The caller (`FastForward.advance`) checked the preconditions: plain
requests, nothing swapped, every running row decoding but the last.
"""

from __future__ import annotations

import itertools

from paged_jax.core.step_plan import StepPlan
from paged_jax.worker.batch_inputs import batch_shape


class _Row:
    """A running sequence's lazily kept state (`c0`, `k0`: computed = c0 + step - k0
    while `decoding`)."""

    __slots__ = ("seq", "ticket", "c0", "k0", "decoding", "slots", "final", "alive")

    def __init__(self, seq, ticket: int, slots: int):
        self.seq, self.ticket, self.slots, self.final = seq, ticket, slots, seq.final_num_tokens
        self.c0, self.k0, self.decoding, self.alive = seq.num_computed_tokens, 0, False, True


class LazyRun:
    def __init__(self, ff):
        """`ff`: the FastForward whose engine, clock, model, counters and pending tokens
        this run uses."""
        self.ff = ff
        core = ff._engine.core
        self.core, self.sched, self.bm, self.stats = core, core.scheduler, core.block_manager, core.stats_tracker
        self.config = core.config
        self.bs = self.bm.block_size
        self.caching = self.bm.enable_prefix_caching
        self.step = 0  # steps applied by this run; decoding rows' lines are in these units
        self.rows: dict[int, _Row] = {}  # seq id -> row, for every running sequence
        self.tickets = itertools.count()  # running order
        self.grow: dict[int, set] = {}  # step % bs -> decoding rows that add a block at such a step
        self.fill: dict[int, set] = {}  # step % bs -> decoding rows that fill a block (prefix caching)
        self.finish_at: dict[int, list] = {}  # step -> decoding rows that sample their last token in it
        self.num_decoding = 0
        self.tail = None  # the prefilling row, if any (the last in running)
        self.S = self.H = self.R = self.I = 0  # sums of slots, counts, min(f, s), max(s - f, 0)
        self._no_admit = None  # (head, rows, tokens, free blocks) of the last admission that failed
        self._shapes: dict = {}  # (rows, tokens) -> batch_shape
        for seq in self.sched.running:
            row = self._add(seq, self.bm.num_tokens(seq.seq_id))
            if ff._decoding(seq):
                self.tail = None
                self._decode(row, 0)

    # ---- rows -------------------------------------------------------------------------
    def _add(self, seq, count: int) -> _Row:
        """A row for running `seq` whose block-manager count is `count` (at this point of
        the step), stepped eagerly (the prefilling tail, an admission) until `_decode`."""
        row = _Row(seq, next(self.tickets), -(-count // self.bs) * self.bs)
        self.rows[seq.seq_id] = row
        self.S += row.slots
        self.H += count
        self.R += min(row.final, row.slots)
        self.I += max(row.slots - row.final, 0)
        self.tail = row
        return row

    def _decode(self, row: _Row, step: int) -> None:
        """Start `row`'s line at `step` (its sequence's state at that step's start)."""
        seq, bs = row.seq, self.bs
        row.decoding, row.c0, row.k0 = True, seq.num_computed_tokens, step
        self.num_decoding += 1
        self.grow.setdefault((step - row.c0) % bs, set()).add(row)
        if self.caching and bs > 1:
            self.fill.setdefault((step - row.c0 - 1) % bs, set()).add(row)
        remaining = self.ff._remaining(seq)
        if remaining < 1:
            raise AssertionError("a decoding sequence that should have finished")
        self.finish_at.setdefault(step + remaining - 1, []).append(row)

    def _grown(self, row: _Row, slots: int) -> None:
        f = row.final
        self.S += slots - row.slots
        self.R += min(f, slots) - min(f, row.slots)
        self.I += max(slots - f, 0) - max(row.slots - f, 0)
        row.slots = slots

    def _remove(self, row: _Row, count: int) -> None:
        """Forget `row` (finished or preempted), whose block-manager count is `count`."""
        f = row.final
        row.alive = False
        del self.rows[row.seq.seq_id]
        self.S -= row.slots
        self.H -= count
        self.R -= min(f, row.slots)
        self.I -= max(row.slots - f, 0)
        if row.decoding:
            self.num_decoding -= 1
            self.grow[(row.k0 - row.c0) % self.bs].discard(row)
            if self.caching and self.bs > 1:
                self.fill[(row.k0 - row.c0 - 1) % self.bs].discard(row)
        elif row is self.tail:
            self.tail = None

    def _sync(self, row: _Row, step: int) -> int:
        """Bring a decoding row's Sequence to `step`'s start (its sampled tokens join the
        pending deltas); returns its computed tokens."""
        seq = row.seq
        c = row.c0 + step - row.k0
        d = c - seq.num_computed_tokens
        if d:
            seq.num_computed_tokens = c
            seq.output_token_ids.extend([self.ff._token] * d)
            pending = self.ff._pending
            pending[seq] = pending.get(seq, 0) + d
        return c

    def finish_run(self) -> None:
        """Leave every sequence and block-manager count as the steps applied left them."""
        bm = self.bm
        for row in self.rows.values():
            if row.decoding:
                c = self._sync(row, self.step)
                if bm.allocate_slots(row.seq.seq_id, c, tokens=row.seq.token_ids) != []:
                    raise AssertionError("a decoding row's count update allocated")

    # ---- one step ---------------------------------------------------------------------
    def _preempt(self, row: _Row) -> bool:
        """The scheduler preempts its choice because `row` cannot grow; returns whether
        `row` itself was preempted."""
        running = self.sched.running
        i = next(j for j in range(len(running) - 1, -1, -1) if running[j] is row.seq)
        victim = self.rows[running[-1].seq_id]  # a plain request is one sequence: the tail
        count = self._sync(victim, self.step) if victim.decoding else victim.seq.num_computed_tokens
        victims, _ = self.sched.preempt_last(i)
        if victims != [victim.seq]:
            raise AssertionError("the scheduler preempted other than the last plain sequence")
        self._remove(victim, count)
        return victim is row

    def apply(self) -> str | None:
        """Apply one step; returns None, or why the run must end before it (nothing
        changed then) or after it."""
        ff, sched, bm, config = self.ff, self.sched, self.bm, self.config
        if not sched.running:
            return "idle"
        step, bs = self.step, self.bs
        sched.take_finished_ids()  # what this step's schedule() would report (the runner keeps no tables)
        preempted, phase = False, step % bs
        events = self.grow.get(phase)
        if self.caching:
            filled = self.fill.get(phase)
            if filled:
                events = (events or set()) | filled
        if events:
            grown = []
            for row in sorted(events, key=_ticket) if len(events) > 1 else tuple(events):
                if not row.alive:
                    continue  # preempted for an earlier row of this step
                seq = row.seq
                c = self._sync(row, step) if self.caching else row.c0 + step - row.k0
                orders = bm.allocate_slots(seq.seq_id, c + 1, tokens=seq.token_ids)
                while orders is None:
                    preempted = True
                    if self._preempt(row):
                        break
                    orders = bm.allocate_slots(seq.seq_id, c + 1, tokens=seq.token_ids)
                if not row.alive:
                    break  # it was the last: nothing after it runs
                if orders:
                    raise AssertionError("a decoding row's allocation copied a block")
                if c % bs == 0:
                    grown.append(row)
            for row in grown:  # _grown(row, row.slots + bs), inline: a decoding row adds a block every bs steps
                s, f = row.slots, row.final
                self.S += bs
                self.R += min(f, s + bs) - min(f, s)
                self.I += max(s + bs - f, 0) - max(s - f, 0)
                row.slots = s + bs
                bm.table_update(row.seq.seq_id)  # the runner's table update, as _add_chunk takes it
        num_rows = num_tokens = self.num_decoding
        self.H += num_tokens
        chunks = []  # (row, tokens) of the rows that prefill in this step
        tail = self.tail
        if tail is not None:
            seq = tail.seq
            budget = config.max_num_batched_tokens - num_tokens
            n = sched.num_new_tokens(seq, budget) if budget > 0 else 0
            if n:
                orders = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + n, tokens=seq.token_ids)
                if orders is None:
                    preempted = True
                    if not self._preempt(tail):
                        raise AssertionError("the prefilling row is the last")
                else:
                    if orders:
                        raise AssertionError("a prefill's allocation copied a block")
                    bm.table_update(seq.seq_id)
                    self._grown(tail, bm.num_blocks_needed(seq.num_computed_tokens + n) * bs)
                    self.H += n
                    chunks.append((tail, n))
                    num_rows += 1
                    num_tokens += n
            else:  # running rows <= the budget (eligible) and a tail has tokens to compute (chunked)
                raise AssertionError("the prefilling row got no tokens")
        end = None
        if not preempted and num_rows < config.max_num_seqs and num_tokens < config.max_num_batched_tokens:
            admitted, end = self._admit(num_rows, num_tokens)
            for row, n in admitted:
                chunks.append((row, n))
                num_rows += 1
                num_tokens += n
        elif preempted and not num_rows:
            raise AssertionError("a step preempted every running sequence")  # a lone sequence fits its pool
        if config.preemption_mode == "swap" and sched.swapped:
            end = "swapped"
        # the step's KV figures after its allocations, its shape and its time: what record_schedule and
        # record_step add for a step, from the sums kept here (a paged cache has no external waste)
        stats, slots = self.stats, bm.num_slots_allocated()
        sampled = self.num_decoding + sum(row.seq.num_computed_tokens + n == row.seq.num_tokens for row, n in chunks)
        if stats.paper_metrics:
            stats.add_paper_figures(slots, slots - (self.S - self.H),
                                    {"internal": self.I, "reservation": self.R - self.H, "external": 0}, self.S // bs)
        stats.add_allocation(slots)
        stats.add_step(num_rows, num_tokens, sampled, 0.0, 0.0)
        num_seqs, shaped_tokens = num_rows, num_tokens
        if ff._buckets:
            shape = self._shapes.get((num_rows, num_tokens))
            if shape is None:
                shape = self._shapes[num_rows, num_tokens] = batch_shape(*ff._buckets, num_rows, num_tokens)
            num_seqs, shaped_tokens = shape
        ff._clock.now += ff._model.seconds(shaped_tokens, num_seqs, self.H)
        # progress: the prefilling rows' chunks, then who sampled their last token (in
        # running order: the decoding rows, in ticket order in their finish_at list, then
        # the chunks' rows, the tail and the admissions)
        now, done_chunks = ff._clock.now, []
        limit = config.max_model_len
        for row, n in chunks:
            seq = row.seq
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:  # its chunk reached the end: it sampled
                if seq.first_token_time is None:  # (its request's first token time is its first sequence's)
                    seq.first_token_time = now
                seq.output_token_ids.append(ff._token)
                ff._pending[seq] = ff._pending.get(seq, 0) + 1
                if len(seq.output_token_ids) >= seq.sampling_params.max_tokens or seq.num_tokens >= limit:
                    done_chunks.append(row)
                else:
                    if row is self.tail:
                        self.tail = None
                    self._decode(row, step + 1)
            elif row is not self.tail:
                raise AssertionError("only the last row may still prefill")
        done = [row for row in self.finish_at.pop(step, ()) if row.alive] + done_chunks
        self.step = step + 1
        ff.num_steps += 1
        ff.num_prefill_steps += any(n > 1 for _, n in chunks)
        ff.num_preempting_steps += preempted
        if done:
            if end == "inserted":  # an admission went before the tail: order by position
                order = {id(seq): j for j, seq in enumerate(sched.running)}
                done.sort(key=lambda row: order[id(row.seq)])
            for row in done:
                count = self._sync(row, step + 1) if row.decoding else row.seq.num_computed_tokens
                self._remove(row, count)
            ff._finish([row.seq for row in done])
        return end

    def _admit_waiting(self, num_rows: int, num_tokens: int) -> list:
        """schedule()'s third phase (Scheduler.admit_waiting) on a step plan of what the
        running rows left (`num_rows` rows and `num_tokens` tokens taken; their slots
        allocated, nothing preempted); returns the admitted chunks (none while swapped
        groups wait: they return first)."""
        if self.sched.swapped:
            return []
        plan = StepPlan(self.config.max_num_batched_tokens - num_tokens, self.config.max_num_seqs,
                        rows_before=num_rows)
        self.sched.admit_waiting(plan)
        if plan.copies:
            raise AssertionError("an admission copied a block")
        return plan.chunks

    def _admit(self, num_rows: int, num_tokens: int):
        """schedule()'s third phase (Scheduler.admit_waiting) after the running rows took
        `num_rows` rows and `num_tokens` tokens; returns the admitted rows with their
        chunks, and why the run must end after this step, if it must."""
        sched, bm = self.sched, self.bm
        if not sched.waiting:
            return [], None
        key = (sched.waiting[0], num_rows, num_tokens)
        if not self.caching and self._no_admit is not None and self._no_admit[:3] == key \
                and bm.num_free_blocks <= self._no_admit[3]:
            return [], None  # as before with fewer free blocks: the same test fails (no cache to hit)
        num_before = len(sched.running)
        chunks = self._admit_waiting(num_rows, num_tokens)
        if not chunks:
            self._no_admit = (*key, bm.num_free_blocks)
            return [], None
        self._no_admit = None
        self.ff.num_admitting_steps += 1
        running, ids, end = sched.running, [c.seq_id for c in chunks], None
        if len(running) != num_before + len(chunks):
            raise AssertionError("an admitted sequence got no chunk")
        seqs = running[-len(chunks):]
        if [s.seq_id for s in seqs] != ids:  # under priority an admission went before the tail
            by_id = {s.seq_id: s for s in running}
            seqs, end = [by_id[i] for i in ids], "inserted"  # the run ends after this step
        admitted = [(self._add(seq, c.start_position + c.num_tokens), c.num_tokens) for seq, c in zip(seqs, chunks)]
        # the window of waiting sequences a step may admit gained the len(chunks) after it (the
        # rest was checked before: preemptions only push plain victims into it)
        window = self.config.max_num_seqs
        if not all(self.ff._plain(seq) for seq in itertools.islice(sched.waiting, max(window - len(chunks), 0), window)):
            end = "not_plain"
        return admitted, end

def _ticket(row: _Row) -> int:
    return row.ticket
