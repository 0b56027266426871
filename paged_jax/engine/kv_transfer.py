"""A prompt's K/V blocks out of one engine and into another (disaggregated prefill / decode).

A prefill engine computes a prompt once (a request with max_tokens=1 leaves the
prompt's full blocks in its prefix cache); `export_prompt_kv` reads those blocks' K/V
to host memory as a PromptKV. A decode engine's `import_prompt_kv` takes new physical
blocks from its own pool, writes the K/V into them and registers them in its prefix
cache under the prompt's block keys, then lets them go as cached free blocks: the
request, added next, is admitted like any other and its prefix-cache lookup finds every
imported block, so only the last partial block and the last token are computed there
(the logits of the last token are needed to sample, as with any cache hit). Adoption is
therefore the engine's own machinery (new blocks, ref counts, prefix-cache entries):
nothing else in the scheduler or runner knows where the K/V came from.

Until the request is admitted the imported blocks are evictable like any cached free
block; under pressure the decode engine may recompute some of them, which costs time,
never correctness. Moving a PromptKV between processes is a connector's job
(paged_jax/engine/kv_connector.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptKV:
    """The K/V of a prompt's leading full blocks, in block order."""

    token_ids: tuple[int, ...]  # the tokens the blocks hold: num_blocks * block_size of them
    block_size: int
    k: np.ndarray  # [layers, num_blocks, block_size, kv_heads, head_dim]
    v: np.ndarray
    cache_salt: str | None = None

    def __post_init__(self):
        if self.k.shape != self.v.shape or self.k.dtype != self.v.dtype or self.k.ndim != 5:
            raise ValueError(f"k and v must be equal-shaped [layers, blocks, block_size, kv_heads, head_dim]; got "
                             f"{self.k.dtype}{list(self.k.shape)} and {self.v.dtype}{list(self.v.shape)}")
        if self.k.shape[2] != self.block_size or len(self.token_ids) != self.k.shape[1] * self.block_size:
            raise ValueError(f"{len(self.token_ids)} tokens do not fill {self.k.shape[1]} blocks of {self.block_size}")

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _tokens(token_ids):
    return lambda start, end: list(token_ids[start:end])


def export_prompt_kv(block_manager, runner, prompt_token_ids, *, cache_salt: str | None = None) -> PromptKV | None:
    """The K/V of the prompt's leading blocks this engine has cached (all of its full
    blocks but the one holding the last token, as a lookup finds them), or None if it
    has none cached."""
    prompt = [int(t) for t in prompt_token_ids]
    hits = block_manager.find_cached_prefix(_tokens(prompt), len(prompt), cache_salt=cache_salt)
    if not hits:
        return None
    k, v = runner.read_blocks([b.block_id for b in hits])
    bs = block_manager.block_size
    return PromptKV(tuple(prompt[: len(hits) * bs]), bs, k, v, cache_salt)


def import_prompt_kv(block_manager, runner, kv: PromptKV, scratch_seq_id: int) -> int:
    """Write `kv`'s blocks into new blocks of this engine and register them in its prefix
    cache; returns how many blocks were written (0: all were cached here already, or the
    pool cannot spare them above its watermark). `scratch_seq_id`: an unused sequence id,
    held only during the call."""
    bm = block_manager
    if kv.block_size != bm.block_size:
        raise ValueError(f"the K/V come in blocks of {kv.block_size} tokens; this engine's are {bm.block_size}")
    if not bm.enable_prefix_caching:
        raise ValueError("importing K/V needs prefix caching (the blocks enter the prefix cache)")
    runner.check_block_arrays(kv.num_blocks, kv.k, kv.v)  # before any block is registered under these keys
    num_tokens = len(kv.token_ids)
    tokens = _tokens(kv.token_ids)
    # +1: a lookup leaves a sequence's last token uncached; here every block is full
    hits = bm.find_cached_prefix(tokens, num_tokens + 1, cache_salt=kv.cache_salt)
    if len(hits) >= kv.num_blocks or not bm.can_allocate(num_tokens, hits):
        return 0
    bm.allocate_slots(scratch_seq_id, num_tokens, tokens=tokens, cached_blocks=hits, cache_salt=kv.cache_salt)
    try:
        new = bm.block_table(scratch_seq_id)[len(hits):]
        runner.write_blocks(new, np.ascontiguousarray(kv.k[:, len(hits):]), np.ascontiguousarray(kv.v[:, len(hits):]))
    finally:
        bm.free(scratch_seq_id)  # its blocks stay registered: cached free blocks until admitted or evicted
    return len(new)
