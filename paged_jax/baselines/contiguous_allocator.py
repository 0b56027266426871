"""Contiguous KV allocators: the baselines the paper compares PagedAttention against.

Orca-style systems give each request one contiguous chunk of KV memory, reserved at
admission for the longest the request may become. Here that memory is the device's
blocks 1..num_blocks-1 taken as one token address space (block 0 stays the null block).
At admission a request reserves a run of consecutive blocks, placed first-fit (the
lowest-addressed free gap that is large enough), of

- ``contiguous-max``: ``max_model_len`` tokens;
- ``contiguous-pow2``: the next power of two >= its final length (capped at
  ``max_model_len``);
- ``contiguous-oracle``: exactly its final length,

rounded up to whole blocks. The final length is prompt + max_tokens capped at
``max_model_len`` (exact for runs with ``ignore_eos``); the scheduler passes it as
``final_num_tokens=`` to ``can_allocate`` / ``allocate_slots``. A sequence's block table
is the prefix of its run that its tokens need so far, so attention reads through the same
block-table machinery as the paged engine; only allocation differs. Growth inside the
reservation never fails; admission fails (the request waits) when no free gap is long
enough, even if the free blocks in total would be: that is external fragmentation,
arising from the first-fit layout. There is no sharing (fork), no swap and no prefix
caching. Pure Python, no jax or numpy.

Waste split (token slots, `ContiguousAllocator.kv_waste`, the interface of
core/kv_waste.py that the engine's stats and pool snapshot call): per sequence, internal
and reservation as there with ``R`` = its reserved run's slots and ``f`` its final length
capped at max_model_len; external (whole cache) = free slots in gaps shorter than the
reservation of the head of the waiting queue (0 when nothing waits): free but unusable
for the next request.

The engine does not import this module: `make_allocator` (allocators.py) builds the
allocator that `EngineConfig.kv_allocator` names, and the entry points above the engine
(`paged_jax.LLM`, the simulator, experiments) hand it to the engine core.
"""

from __future__ import annotations

from paged_jax.core.block_pool import FREE, NULL, RESERVED, USED, check_int

CONTIGUOUS_POLICIES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle")


class ContiguousAllocator:
    """First-fit contiguous reservations over device blocks 1..num_blocks-1.

    The BlockManager interface the scheduler, engine and stats use. Invariants (see
    `check_invariants`): reservations are disjoint runs inside [1, num_blocks); each
    sequence's table is the first `num_blocks_needed(num_tokens)` blocks of its run, and
    never longer than the run; free + reserved blocks = usable blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, *, policy: str, max_model_len: int) -> None:
        check_int("num_blocks", num_blocks, 2)
        check_int("block_size", block_size, 1)
        check_int("max_model_len", max_model_len, 1)
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"policy must be one of {CONTIGUOUS_POLICIES}, got {policy!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.policy, self.max_model_len = policy, max_model_len
        self.watermark_blocks = 0  # growth never fails, so nothing is kept back
        self.enable_prefix_caching = False
        self._runs: dict[int, tuple[int, int]] = {}  # seq id -> (first block, blocks reserved)
        self._num_tokens: dict[int, int] = {}  # seq id -> tokens with a slot
        self._final: dict[int, int] = {}  # seq id -> final length (capped)
        self._reported: dict[int, int] = {}  # seq id -> table length at its last table_update

    # ------------------------------------------------------------------ sizes

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.num_usable_blocks - sum(n for _, n in self._runs.values())

    @property
    def num_free_host_blocks(self) -> int:
        return 0

    def num_blocks_needed(self, num_tokens: int) -> int:
        check_int("num_tokens", num_tokens, 0)
        return -(-num_tokens // self.block_size)

    def final_length(self, final_num_tokens: int) -> int:
        """The final length the reservation is sized for: capped at max_model_len."""
        check_int("final_num_tokens", final_num_tokens, 1)
        return min(final_num_tokens, self.max_model_len)

    def reservation_tokens(self, final_num_tokens: int) -> int:
        """Tokens reserved for a request of this final length (before block rounding)."""
        final = self.final_length(final_num_tokens)
        if self.policy == "contiguous-max":
            return self.max_model_len
        if self.policy == "contiguous-pow2":
            return min(1 << (final - 1).bit_length(), self.max_model_len)
        return final

    def reservation_blocks(self, final_num_tokens: int) -> int:
        return self.num_blocks_needed(self.reservation_tokens(final_num_tokens))

    # ------------------------------------------------------------------ layout

    def free_gaps(self) -> list[tuple[int, int]]:
        """(first block, length) of each maximal free run, by address."""
        gaps, cursor = [], 1
        for start, length in sorted(self._runs.values()):
            if start > cursor:
                gaps.append((cursor, start - cursor))
            cursor = start + length
        if cursor < self.num_blocks:
            gaps.append((cursor, self.num_blocks - cursor))
        return gaps

    def _first_fit(self, num_blocks: int) -> int | None:
        return next((start for start, length in self.free_gaps() if length >= num_blocks), None)

    def block_states(self) -> tuple[str, str]:
        """(device, host) block states as BlockManager.block_states gives them: a run's
        blocks its tokens fill so far are used, the rest of the run reserved; no host pool."""
        out = bytearray([FREE]) * self.num_blocks
        out[0] = NULL
        for seq_id, (start, length) in self._runs.items():
            written = self.num_blocks_needed(self._num_tokens[seq_id])
            out[start:start + length] = bytes([USED]) * written + bytes([RESERVED]) * (length - written)
        return out.decode("ascii"), ""

    def reservation(self, seq_id: int) -> tuple[int, int]:
        """(first block, blocks reserved) of the sequence's run."""
        self._require(seq_id)
        return self._runs[seq_id]

    # ------------------------------------------------------------------ queries

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_seqs_held(self) -> int:
        return len(self._runs)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._runs

    def is_swapped(self, seq_id: int) -> bool:
        self._require(seq_id)
        return False

    def block_table(self, seq_id: int) -> list[int]:
        """The prefix of the sequence's run that its tokens need so far."""
        self._require(seq_id)
        start, _ = self._runs[seq_id]
        return list(range(start, start + self.num_blocks_needed(self._num_tokens[seq_id])))

    def table_update(self, seq_id: int) -> tuple[int, tuple[int, ...]]:
        """BlockManager.table_update: a table only grows along its run, so the update is
        the blocks added since the last call (all of them on the first)."""
        self._require(seq_id)
        start, needed = self._runs[seq_id][0], self.num_blocks_needed(self._num_tokens[seq_id])
        k = self._reported.get(seq_id, 0)
        self._reported[seq_id] = needed
        return k, tuple(range(start + k, start + needed))

    def num_tokens(self, seq_id: int) -> int:
        self._require(seq_id)
        return self._num_tokens[seq_id]

    def num_tokens_held(self) -> int:
        return sum(self._num_tokens.values())

    def num_slots_allocated(self) -> int:
        """Reserved token slots (whole reservations): tokens held / this is utilization."""
        return (self.num_usable_blocks - self.num_free_blocks) * self.block_size

    def num_blocks_without_sharing(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks  # nothing is shared

    num_blocks_cached = 0
    num_evictions = 0

    def find_cached_prefix(self, tokens, num_tokens: int, extra_keys: tuple = (), *,
                           cache_salt: str | None = None, memo: list | None = None) -> list:
        return []  # no prefix caching, so nothing a salt could separate

    def reset_prefix_cache(self) -> int:
        return 0

    # ------------------------------------------------------------------ admission and growth

    def can_allocate(self, num_tokens: int, cached_blocks=(), *, final_num_tokens: int | None = None) -> bool:
        """Whether a free gap holds the reservation of a new request of this final length."""
        if cached_blocks:
            raise ValueError("contiguous allocators have no prefix cache")
        if final_num_tokens is None:
            raise ValueError("a contiguous allocator needs final_num_tokens to admit a sequence")
        if num_tokens > self.reservation_blocks(final_num_tokens) * self.block_size:
            raise ValueError(f"{num_tokens} tokens exceed the reservation for final length {final_num_tokens}")
        return self._first_fit(self.reservation_blocks(final_num_tokens)) is not None

    def allocate_slots(self, seq_id: int, num_total_tokens: int, *, tokens=None, cached_blocks=(),
                       extra_keys: tuple = (), final_num_tokens: int | None = None,
                       cache_salt: str | None = None, num_known_tokens: int | None = None) -> list | None:
        """Admit a new sequence (reserve its run first-fit; None if no gap fits) or grow one
        inside its run. Returns [] (no copy orders). Growing past the reservation, or
        shrinking, is a ValueError. `num_known_tokens` (the paged manager's prefix-cache
        limit) has no use here: no prefix cache."""
        check_int("num_total_tokens", num_total_tokens, 0)
        if cached_blocks:
            raise ValueError("contiguous allocators have no prefix cache")
        if seq_id not in self._runs:
            if final_num_tokens is None:
                raise ValueError("a contiguous allocator needs final_num_tokens to admit a sequence")
            need = self.reservation_blocks(final_num_tokens)
            if self.num_blocks_needed(num_total_tokens) > need:
                raise ValueError(f"{num_total_tokens} tokens exceed the reservation of {need} blocks")
            start = self._first_fit(need)
            if start is None:
                return None
            self._runs[seq_id] = (start, need)
            self._num_tokens[seq_id] = num_total_tokens
            self._final[seq_id] = self.final_length(final_num_tokens)
            return []
        current = self._num_tokens[seq_id]
        if num_total_tokens < current:
            raise ValueError(f"sequence {seq_id} holds {current} tokens; cannot shrink to {num_total_tokens}")
        if self.num_blocks_needed(num_total_tokens) > self._runs[seq_id][1]:
            raise ValueError(f"sequence {seq_id} would grow to {num_total_tokens} tokens, past its reservation "
                             f"of {self._runs[seq_id][1]} blocks")
        self._num_tokens[seq_id] = num_total_tokens
        return []

    def free(self, seq_id: int) -> None:
        self._require(seq_id)
        del self._runs[seq_id], self._num_tokens[seq_id], self._final[seq_id]
        self._reported.pop(seq_id, None)

    def fork(self, parent_id: int, child_id: int) -> None:
        raise ValueError(f"{self.policy} is a baseline without block sharing: no fork (n > 1, beam search)")

    def can_swap_out(self, seq_ids) -> bool:
        return False

    def num_swap_in_blocks(self, seq_ids) -> int:
        raise ValueError(f"{self.policy} is a baseline without swapping")

    def swap_out(self, seq_ids):
        raise ValueError(f"{self.policy} is a baseline without swapping")

    def swap_in(self, seq_ids):
        raise ValueError(f"{self.policy} is a baseline without swapping")

    # ------------------------------------------------------------------ waste and checks

    def external_waste_slots(self, final_num_tokens: int | None) -> int:
        """Free slots in gaps too short for a request of this final length (None: 0)."""
        if final_num_tokens is None:
            return 0
        need = self.reservation_blocks(final_num_tokens)
        return sum(length for _, length in self.free_gaps() if length < need) * self.block_size

    def kv_waste(self, running, waiting_head) -> dict:
        """Waste in token slots now, split as in the module docstring (core/kv_waste.py's
        interface). `running`: the scheduler's running sequences; `waiting_head`: the first
        waiting sequence or None."""
        internal = reservation = 0
        for seq in running:
            seq_id = seq.seq_id
            if seq_id not in self._runs:
                continue
            held = self._num_tokens[seq_id]
            slots = self._runs[seq_id][1] * self.block_size
            final = self.final_length(seq.final_num_tokens)
            if slots > final and slots > held:
                internal += slots - (final if final > held else held)
            if final > held:
                reservation += (final if final < slots else slots) - held
        external = 0 if waiting_head is None else self.external_waste_slots(waiting_head.final_num_tokens)
        return {"internal": internal, "reservation": reservation, "external": external}

    def _require(self, seq_id: int) -> None:
        if seq_id not in self._runs:
            raise KeyError(f"unknown sequence id {seq_id!r}")

    def check_invariants(self) -> None:
        problems = []
        runs = sorted((start, length, seq_id) for seq_id, (start, length) in self._runs.items())
        cursor = 1
        for start, length, seq_id in runs:
            if start < cursor or length < 1:
                problems.append(f"sequence {seq_id}: run ({start}, {length}) overlaps or starts before {cursor}")
            cursor = max(cursor, start + length)
            needed = self.num_blocks_needed(self._num_tokens[seq_id])
            if needed > length:
                problems.append(f"sequence {seq_id}: {needed} blocks needed, {length} reserved")
            if length != self.reservation_blocks(self._final[seq_id]):
                problems.append(f"sequence {seq_id}: {length} blocks reserved, policy says "
                                f"{self.reservation_blocks(self._final[seq_id])}")
        if cursor > self.num_blocks:
            problems.append(f"a run ends at {cursor}, past the last block {self.num_blocks - 1}")
        free = sum(length for _, length in self.free_gaps())
        if free + sum(n for _, n in self._runs.values()) != self.num_usable_blocks:
            problems.append("free + reserved blocks != usable blocks")
        if not self._runs.keys() == self._num_tokens.keys() == self._final.keys():
            problems.append("runs, token counts and final lengths name different sequences")
        if problems:
            raise AssertionError("contiguous allocator invariants broken:\n  " + "\n  ".join(problems))

