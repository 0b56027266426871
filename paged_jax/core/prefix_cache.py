"""Prefix-cache keys: what a full KV block's contents depend on, as a sha256 chain.

A block's K/V depend on its tokens and on every token before it, so its key must name
the whole prefix, not just the block. `BlockKey.chain` builds the key of a block from its
parent's key: the digest is sha256 over (parent's digest, the block's token ids, extra
keys) in a fixed byte encoding, so it is the same in every process and collisions are
infeasible to craft. (Python's `hash()` of ints is neither seeded nor collision-resistant:
crafted prompts could collide and be served another prompt's K/V; vLLM's CVE-2025-25183
is this class, and vLLM now chains sha256 too.)

The digest only indexes the cache. A hit must also equal the key in full, parent chain
included (`BlockKey.__eq__`), so even a colliding digest (a weak hash swapped in, say)
never serves K/V computed under another prefix. Pure Python, no jax or numpy.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass, field


def _encode(value) -> bytes:
    """A canonical, type-tagged, length-prefixed encoding of an extra key: no two values
    share one, and it does not depend on the process (unlike `hash()`)."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"B1" if value else b"B0"
    if isinstance(value, int):
        raw = str(value).encode()
        return b"I" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        return b"S" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, bytes):
        return b"Y" + struct.pack("<I", len(value)) + value
    if isinstance(value, (tuple, list)):
        return b"T" + struct.pack("<I", len(value)) + b"".join(_encode(v) for v in value)
    raise ValueError("prefix-cache extra keys must be None, bool, int, str, bytes or tuples of them; "
                     f"got {type(value).__name__}")


_NO_EXTRA_KEYS = _encode(())


@functools.cache
def _packer(n: int) -> struct.Struct:
    """The Struct of a block of n tokens ("<I{n}q"), compiled once per n."""
    return struct.Struct(f"<I{n}q")


def hash_block(parent_digest: bytes | None, token_ids: tuple[int, ...], extra_keys: tuple) -> bytes:
    """sha256 of (parent digest, token ids, extra keys): a block's prefix-cache digest.

    Token ids are little-endian int64 behind their count and the parent digest has a
    fixed length, so the byte string is unambiguous. One sha256 call over the whole
    string (each prompt block of each admitted request is hashed: it is the prefix
    cache's main host cost). Module level, and looked up at each call, so tests can swap
    in a deliberately colliding function.
    """
    n = len(token_ids)
    return hashlib.sha256((b"P" + parent_digest if parent_digest is not None else b"R") + _packer(n).pack(n, *token_ids)
                          + (_encode(tuple(extra_keys)) if extra_keys else _NO_EXTRA_KEYS)).digest()


@dataclass(frozen=True, eq=False, slots=True)
class BlockKey:
    """A full block's tokens, extra keys and (through `parent`) every block before it.

    `digest` indexes the cache; equality compares everything, link by link."""

    parent: BlockKey | None
    token_ids: tuple[int, ...]
    extra_keys: tuple
    digest: bytes = field(repr=False)

    @classmethod
    def chain(cls, parent: BlockKey | None, token_ids, extra_keys: tuple = ()) -> BlockKey:
        """The key of a block holding `token_ids` after the block keyed `parent`."""
        token_ids, extra_keys = tuple(token_ids), tuple(extra_keys)
        return cls(parent, token_ids, extra_keys,
                   hash_block(parent.digest if parent is not None else None, token_ids, extra_keys))

    def digest_is_consistent(self) -> bool:
        """Whether `digest` is what hash_block gives for this link (invariant checks)."""
        return self.digest == hash_block(self.parent.digest if self.parent is not None else None,
                                         self.token_ids, self.extra_keys)

    def __eq__(self, other) -> bool:
        """Equal digests, tokens and extra keys at every link up the parent chain. A loop,
        not recursion (a chain is as long as a prompt's blocks); chains that meet at one
        key object stop there, so comparing with a key built on the hit parent's own key
        object costs one link."""
        if not isinstance(other, BlockKey):
            return NotImplemented
        a, b = self, other
        while a is not b:
            if a is None or b is None or a.digest != b.digest or a.token_ids != b.token_ids \
                    or a.extra_keys != b.extra_keys:
                return False
            a, b = a.parent, b.parent
        return True

    def __hash__(self) -> int:
        return hash(self.digest)


def check_salt(cache_salt) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")


def block_extra_keys(extra_keys: tuple, cache_salt: str | None, index: int) -> tuple:
    """Extra keys of logical block `index`: the salt goes into the first block's only (as
    in vLLM); the chain carries it into every later key, so different salts never meet."""
    if index == 0 and cache_salt is not None:
        return extra_keys + (("cache_salt", cache_salt),)
    return extra_keys


def find_prefix(pool, tokens, num_tokens: int, block_size: int, extra_keys: tuple,
                cache_salt: str | None, memo: list | None = None) -> list:
    """The longest run of `pool`'s cached blocks equal to a sequence's leading full blocks
    (all but its last token: that one's logits are needed), each verified in full.

    `memo`: the sequence's own list of its leading blocks' keys, filled here as they are
    computed and reused by later calls (a waiting sequence is looked up at every step
    it waits at the head of the queue; its keys depend only on its tokens, extra keys and
    salt, so hashing them once is enough, as vLLM keeps a request's block hashes)."""
    check_salt(cache_salt)
    hits, parent = [], None
    for i in range((num_tokens - 1) // block_size):
        if memo is not None and i < len(memo):
            key = memo[i]
        else:
            key = BlockKey.chain(parent, tokens(i * block_size, (i + 1) * block_size),
                                 block_extra_keys(extra_keys, cache_salt, i))
            if memo is not None:
                memo.append(key)
        block = pool.lookup(key)
        if block is None:
            break
        hits.append(block)
        parent = block.block_key  # equal to `key`; sharing the object keeps later compares O(1)
        if memo is not None:
            memo[i] = parent
    return hits


def register_full_blocks(pool, table: list, keys: list, num_full: int, tokens, block_size: int,
                         extra_keys: tuple, cache_salt: str | None) -> None:
    """Register a sequence's full blocks `table[len(keys):num_full]` in `pool`, appending
    their keys to `keys` (the sequence's chain so far).

    Each child chains to the key computed from this sequence's own tokens (or to the equal
    key object already cached), never to whatever block holds a digest: a block left
    unregistered (its digest taken) lends no other prefix's identity to its children.
    """
    for i in range(len(keys), num_full):
        block = table[i]
        if block.block_key is not None:  # registered already only if shared: then with this very key
            keys.append(block.block_key)
            continue
        key = BlockKey.chain(keys[-1] if keys else None, tokens(i * block_size, (i + 1) * block_size),
                             block_extra_keys(extra_keys, cache_salt, i))
        if not pool.cache_block(block, key):
            holder = pool.lookup(key)  # an equal key elsewhere: chain on from its object
            key = holder.block_key if holder is not None else key
        keys.append(key)
