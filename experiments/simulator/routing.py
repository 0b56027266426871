"""Request routing across replicas: round-robin, least-loaded and prefix-aware.

A router sees what a real one sees: the prompt's token ids and how many requests each
replica has in flight (sent, not yet finished); it does not read the replicas' caches.
The prefix-aware policy is SGLang's cache-aware router (sgl-router's `cache_aware`
policy), on token blocks instead of characters: the router keeps, per replica, an
approximate tree of the prompts it sent there (here: the set of block-chain keys of
their full blocks, least recently used dropped past `tree_blocks`), and

- if the load is imbalanced (max in flight - min > `balance_abs` and max >
  `balance_rel` * min), it sends to the least-loaded replica (shortest queue);
- else to the replica whose tree shares the longest prefix with the prompt, when that
  prefix is more than `cache_threshold` of the prompt;
- else to the replica with the smallest tree (the most room for a new prefix).

The chosen replica's tree then holds the prompt's blocks. Keys are Python hashes of
(parent key, block tokens): this is a routing heuristic, never a source of K/V, so a
collision costs at most a worse choice. Pure Python.
"""

from __future__ import annotations

import collections

POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def block_chain(prompt, block_size: int) -> list[int]:
    """Keys of the prompt's full blocks, each naming its whole prefix."""
    keys, parent = [], 0
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt[start:start + block_size])))
        keys.append(parent)
    return keys


class RoundRobin:
    name = "round-robin"

    def __init__(self, num_replicas: int):
        self._n, self._next = num_replicas, 0

    def choose(self, prompt, in_flight: list[int]) -> int:
        del prompt, in_flight
        choice, self._next = self._next, (self._next + 1) % self._n
        return choice


class LeastLoaded:
    """Fewest requests in flight; ties go round-robin, so an idle fleet is spread."""

    name = "least-loaded"

    def __init__(self, num_replicas: int):
        self._n, self._next = num_replicas, 0

    def choose(self, prompt, in_flight: list[int]) -> int:
        del prompt
        low = min(in_flight)
        for offset in range(self._n):
            i = (self._next + offset) % self._n
            if in_flight[i] == low:
                self._next = (i + 1) % self._n
                return i
        raise AssertionError("unreachable")


class PrefixAware:
    name = "prefix-aware"

    def __init__(self, num_replicas: int, block_size: int, *, cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.0001, tree_blocks: int = 1 << 20):
        """Defaults are sgl-router's (cache_threshold 0.5, balance_abs_threshold 32,
        balance_rel_threshold 1.0001); `tree_blocks` bounds each replica's tree, as its
        max_tree_size does."""
        self._block_size, self._threshold = block_size, cache_threshold
        self._abs, self._rel, self._capacity = balance_abs, balance_rel, tree_blocks
        self._trees = [collections.OrderedDict() for _ in range(num_replicas)]  # key -> None, LRU first
        self._least_loaded = LeastLoaded(num_replicas)
        self.num_cache_routed = self.num_balance_routed = self.num_spread_routed = 0

    def choose(self, prompt, in_flight: list[int]) -> int:
        keys = block_chain(prompt, self._block_size)
        high, low = max(in_flight), min(in_flight)
        if high - low > self._abs and high > self._rel * low:
            choice = self._least_loaded.choose(prompt, in_flight)
            self.num_balance_routed += 1
        else:
            matches = [self._match(tree, keys) for tree in self._trees]
            best = max(range(len(matches)), key=lambda i: (matches[i], -in_flight[i]))
            if keys and matches[best] * self._block_size > self._threshold * len(prompt):
                choice = best
                self.num_cache_routed += 1
            else:
                choice = min(range(len(self._trees)), key=lambda i: (len(self._trees[i]), in_flight[i], i))
                self.num_spread_routed += 1
        self._insert(self._trees[choice], keys)
        return choice

    @staticmethod
    def _match(tree, keys) -> int:
        n = 0
        for key in keys:
            if key not in tree:
                break
            n += 1
        return n

    def _insert(self, tree, keys) -> None:
        for key in keys:
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) > self._capacity:
            tree.popitem(last=False)

    def stats(self) -> dict:
        return {"cache_routed": self.num_cache_routed, "balance_routed": self.num_balance_routed,
                "spread_routed": self.num_spread_routed}


def make_router(policy: str, num_replicas: int, block_size: int, **options):
    if policy == "round-robin":
        return RoundRobin(num_replicas)
    if policy == "least-loaded":
        return LeastLoaded(num_replicas)
    if policy == "prefix-aware":
        return PrefixAware(num_replicas, block_size, **options)
    raise ValueError(f"unknown routing policy {policy!r}; available: {list(POLICIES)}")
