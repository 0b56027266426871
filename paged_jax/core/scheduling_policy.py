"""Priority scheduling's queue order (EngineConfig.scheduling_policy="priority").

vLLM's rule: a request's key is (priority, arrival_time, admission counter), lower first
(a lower priority value runs earlier); the counter, drawn when the request first reaches
the scheduler, breaks ties, so every request has its own key. The scheduler keeps each of
its queues sorted by that key: waiting sequences are admitted, swapped groups return and
running sequences are served best key first, and the running tail, the victim under
memory pressure, is the request vLLM v1 preempts, `max(running, key=(priority,
arrival_time))`. Every sequence of a request shares the request's key and an insertion
goes after all equal keys, so a request's sequences stay adjacent (and in their order) in
every queue, as the scheduler's group preemption needs.

Pure Python. Under "fcfs" the scheduler uses none of this.
"""

from __future__ import annotations

import itertools
from typing import Callable, MutableSequence, TypeVar

from paged_jax.core.sequence import Sequence

T = TypeVar("T")


def insert_sorted(queue: MutableSequence[T], item: T, key: Callable[[T], tuple]) -> None:
    """Insert `item` after every element whose key is <= its own (the queue is sorted by
    `key`; equal keys keep their insertion order). Scans from the tail: new requests, the
    common case, arrive last."""
    k, i = key(item), len(queue)
    while i and key(queue[i - 1]) > k:
        i -= 1
    queue.insert(i, item)


class PriorityOrder:
    """Each request's key, for as long as any of its sequences is in a queue."""

    def __init__(self):
        self._counter = itertools.count()
        self._admission: dict[str, int] = {}  # request id -> admission counter
        self._members: dict[str, set[int]] = {}  # request id -> ids of its sequences in the queues

    def join(self, seq: Sequence) -> None:
        """`seq` enters the scheduler (a new request's first sequence, or a fork of it)."""
        if seq.request_id not in self._admission:
            self._admission[seq.request_id] = next(self._counter)
        self._members.setdefault(seq.request_id, set()).add(seq.seq_id)

    def leave(self, seq: Sequence) -> None:
        """`seq` finished; its request's key is forgotten with its last sequence."""
        members = self._members.get(seq.request_id)
        if members is None:
            return
        members.discard(seq.seq_id)
        if not members:
            del self._members[seq.request_id], self._admission[seq.request_id]

    def key(self, seq: Sequence) -> tuple:
        return seq.priority, seq.arrival_time, self._admission[seq.request_id]

    def group_key(self, group: list[Sequence]) -> tuple:
        return self.key(group[0])  # a swap group is one request's sequences

    def insert(self, queue: MutableSequence[Sequence], seq: Sequence) -> None:
        insert_sorted(queue, seq, self.key)

    def insert_group(self, queue: MutableSequence[list[Sequence]], group: list[Sequence]) -> None:
        insert_sorted(queue, group, self.group_key)
