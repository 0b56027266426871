"""Host-side batch preparation: a SchedulerOutput becomes fixed-shape numpy arrays.

numpy only (no jax): every array is padded to a bucket so the jitted step sees a handful
of shapes and never recompiles after warm-up. Padding rows have q_len 0, context 0 and
null-block tables; padding tokens write to an out-of-range slot that the scatter drops.
"""

from __future__ import annotations

import bisect
from typing import Mapping, NamedTuple

import numpy as np

from paged_jax.core.scheduler_output import SchedulerOutput
from paged_jax.core.sequence import PENDING_TOKEN, Sequence
from paged_jax.worker.block_tables import HostBlockTables


class BatchInputs(NamedTuple):
    token_ids: np.ndarray  # i32[T]
    # i32[T]: where a token is still on the device (async scheduling: sampled by the step before,
    # not yet read back; its token_ids entry is PENDING_TOKEN), that step's row, whose token the
    # runner's device-side feed holds; else -1
    feed_rows: np.ndarray
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]; num_blocks * block_size for padding
    block_tables: np.ndarray  # i32[S, max_blocks_per_seq]
    context_lens: np.ndarray  # i32[S]
    query_start_loc: np.ndarray  # i32[S + 1]
    logits_indices: np.ndarray  # i32[S]: each row's last token in the flat token axis
    temperature: np.ndarray  # f32[S]
    top_k: np.ndarray  # i32[S]
    top_p: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    seeds: np.ndarray  # u32[S]
    sample_index: np.ndarray  # i32[S]: index of the token being sampled (keys fold it in)
    copy_src: np.ndarray  # i32[C] copy-on-write sources, padded with 0
    copy_dst: np.ndarray  # i32[C]
    # i32[1]: 2 if a row wants top-K logprobs (API logprobs > 0, beam candidates), 1 if one wants
    # only its token's logprob (logprobs=0), 0 if none does (the head then skips the logsumexp)
    want_top: np.ndarray
    # i32[T]: at a token whose sequence asked for prompt logprobs and whose next token is a
    # prompt token, that token (the runner scores it from this token's logits); else -1
    prompt_targets: np.ndarray
    # i32[S, ceil(vocab / 32)]: each row's allowed next tokens, bit t % 32 of word t // 32 (all ones for
    # rows without a structured-output constraint); read only when use_mask[0] is 1
    token_bitmask: np.ndarray
    use_mask: np.ndarray  # i32[1]


def pick_bucket(buckets, n: int) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def batch_shape(seq_buckets, token_buckets, num_seqs: int, num_tokens: int) -> tuple[int, int]:
    """(S, T) for a batch of num_seqs rows and num_tokens tokens.

    A pure-decode step (one token per row, most steps) gets the smallest S and T >= S.
    A step with any prefill chunk gets the largest S and the smallest T that fits: the
    extra rows only cost a few padded logits rows, and the number of shapes to compile
    stays len(seq_buckets) + len(token_buckets) instead of their product.
    """
    if num_tokens == num_seqs:
        s = pick_bucket(seq_buckets, num_seqs)
        return s, pick_bucket(token_buckets, s)
    return seq_buckets[-1], pick_bucket(token_buckets, max(num_tokens, seq_buckets[-1]))


def all_batch_shapes(seq_buckets, token_buckets) -> list[tuple[int, int]]:
    """Every (S, T) that `batch_shape` can return: what warm-up compiles."""
    decode = {batch_shape(seq_buckets, token_buckets, s, s) for s in seq_buckets}
    mixed = {batch_shape(seq_buckets, token_buckets, 1, t) for t in token_buckets if t > 1}
    return sorted(decode | mixed)


def batch_shape_kinds(seq_buckets, token_buckets) -> dict[tuple[int, int], tuple[str, ...]]:
    """Every (S, T) of `all_batch_shapes` with the step kinds that land on it: "decode" (one
    query token per row) and "mixed" (a prefill chunk). Only the largest decode bucket can
    also hold a mixed step (`batch_shape` gives mixed steps the largest S)."""
    kinds: dict[tuple[int, int], tuple[str, ...]] = {}
    for s in seq_buckets:
        kinds[batch_shape(seq_buckets, token_buckets, s, s)] = ("decode",)
    for t in token_buckets:
        if t > 1:
            shape = batch_shape(seq_buckets, token_buckets, 1, t)
            kinds[shape] = tuple(sorted(set(kinds.get(shape, ())) | {"mixed"}))
    return kinds


def prepare_batch(output: SchedulerOutput, seqs: Mapping[int, Sequence], tables: HostBlockTables, *,
                  block_size: int, num_blocks: int, seq_buckets, token_buckets, max_copies: int,
                  token_bitmask: np.ndarray | None = None, mask_words: int = 1,
                  feed_rows: Mapping[int, int] | None = None) -> BatchInputs:
    """The step's padded arrays; applies the step's block-table updates to `tables`.
    `token_bitmask`: i32[chunks, mask_words], the allowed tokens of each chunk's row (from
    the structured-output constraints), or None when no row has one. `feed_rows`: sequence
    id -> its row in the step dispatched before this one, for sequences whose last token
    that step sampled and the host has not read (async scheduling; the chunk's last token
    is then PENDING_TOKEN)."""
    chunks = output.chunks
    num_seqs, num_tokens = len(chunks), output.num_batched_tokens
    S, T = batch_shape(seq_buckets, token_buckets, num_seqs, num_tokens)
    b = empty_batch(S, T, tables.width, max_copies, pad_slot=num_blocks * block_size, mask_words=mask_words)
    if token_bitmask is not None:
        b.token_bitmask[:num_seqs] = token_bitmask
        b.use_mask[0] = 1
    tables.drop_departed(output)
    cursor = 0
    for row, chunk in enumerate(chunks):
        n, start = chunk.num_tokens, chunk.start_position
        span = slice(cursor, cursor + n)
        table = tables.update(chunk)
        if chunk.token_ids[-1] == PENDING_TOKEN:  # only ever the last: one step is in flight at a time
            b.feed_rows[cursor + n - 1] = _feed_row(feed_rows, chunk.seq_id)
        if n == 1:  # decode: no arrays to build for one token
            b.token_ids[cursor], b.positions[cursor] = chunk.token_ids[0], start
            b.slot_mapping[cursor] = table[start // block_size] * block_size + start % block_size
        else:
            positions = np.arange(start, start + n, dtype=np.int32)
            b.token_ids[span] = chunk.token_ids
            b.positions[span] = positions
            b.slot_mapping[span] = table[positions // block_size] * block_size + positions % block_size
        b.block_tables[row] = table
        b.context_lens[row] = start + n
        cursor += n
        b.query_start_loc[row + 1] = cursor
        b.logits_indices[row] = cursor - 1
        seq = seqs[chunk.seq_id]
        sp = seq.sampling_params
        b.temperature[row], b.top_k[row], b.top_p[row], b.min_p[row] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        b.seeds[row] = seq.seed
        if sp.logprobs:
            b.want_top[0] = 2
        elif sp.logprobs is not None:
            b.want_top[0] = max(b.want_top[0], 1)
        b.sample_index[row] = seq.num_output_tokens  # pending ones count: they were sampled
        if sp.prompt_logprobs is not None and start + 1 < seq.num_prompt_tokens:
            scored = min(n, seq.num_prompt_tokens - 1 - start)  # positions start .. start + scored - 1
            b.prompt_targets[cursor - n:cursor - n + scored] = seq.prompt_token_ids[start + 1:start + 1 + scored]
    b.query_start_loc[num_seqs + 1:] = cursor
    if len(output.block_copies) > max_copies:
        raise ValueError(f"{len(output.block_copies)} block copies exceed the per-step limit {max_copies}")
    for i, (src, dst) in enumerate(output.block_copies):
        b.copy_src[i], b.copy_dst[i] = src, dst
    return b


def _feed_row(feed_rows: Mapping[int, int] | None, seq_id: int) -> int:
    row = None if feed_rows is None else feed_rows.get(seq_id)
    if row is None:
        raise ValueError(f"sequence {seq_id} has a pending token, but the step before did not sample it")
    return row


def step_inputs(batch: BatchInputs) -> BatchInputs:
    """The batch without the fields only the heads read (the token bitmask, prompt targets):
    the model step would otherwise receive (copy) them every step for nothing."""
    return batch._replace(token_bitmask=None, use_mask=None, prompt_targets=None)


def empty_batch(S: int, T: int, width: int, copies: int, pad_slot: int, mask_words: int = 1) -> BatchInputs:
    """An all-padding batch: writes nothing, reads only the null block (also warm-up's input)."""
    return BatchInputs(
        token_ids=np.zeros(T, np.int32), feed_rows=np.full(T, -1, np.int32), positions=np.zeros(T, np.int32),
        slot_mapping=np.full(T, pad_slot, np.int32), block_tables=np.zeros((S, width), np.int32),
        context_lens=np.zeros(S, np.int32), query_start_loc=np.zeros(S + 1, np.int32),
        logits_indices=np.zeros(S, np.int32), temperature=np.zeros(S, np.float32),
        top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32), min_p=np.zeros(S, np.float32),
        seeds=np.zeros(S, np.uint32), sample_index=np.zeros(S, np.int32),
        copy_src=np.zeros(copies, np.int32), copy_dst=np.zeros(copies, np.int32), want_top=np.zeros(1, np.int32),
        prompt_targets=np.full(T, -1, np.int32), token_bitmask=np.full((S, mask_words), -1, np.int32),
        use_mask=np.zeros(1, np.int32))
