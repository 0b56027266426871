"""TritonTuning: the launch choices of the Pallas kernels' Triton (GPU) tilings.

Both paged-attention kernels walk a sequence's block table a chunk of blocks at a time
inside one program, and each Triton program runs on `num_warps` warps with
`num_stages`-deep software pipelining of its loop's loads. These numbers change speed,
never results, so they are a separate, hashable static argument
(`paged_attention(..., tuning=TritonTuning(...))`) that a sweep can vary
(`python -m experiments.bench_kernel --tunings=...`). Each kernel's default is the choice
measured fastest on the GPU named beside it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TritonTuning:
    # keys gathered per loop step of a program, rounded down to whole blocks (at least one):
    # more keys per step put more loads in flight; Triton's dot needs >= 16 of them
    chunk_tokens: int = 64
    # ragged kernel only: query rows (tokens x the GQA group) per program; rows past a
    # sequence's tokens are wasted, so decode wants few, long prefill chunks many (each
    # program reads all the blocks its rows can see)
    query_rows: int = 16
    num_warps: int = 4  # warps per program
    num_stages: int = 2  # software-pipelining depth of the loop's loads
    # decode kernel only: programs per (sequence, kv head), each over a share of its blocks,
    # merged afterwards; 0 = enough to give the GPU about TARGET_PROGRAMS programs (a power of two)
    kv_splits: int = 0

    def __post_init__(self):
        for name in ("chunk_tokens", "query_rows", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TritonTuning.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.kv_splits, int) or self.kv_splits < 0:
            raise ValueError(f"TritonTuning.kv_splits must be an int >= 0 (0: auto), got {self.kv_splits!r}")
        for name in ("query_rows", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"TritonTuning.{name} must be a power of two (Triton's tensors are), got {value}")
        if self.query_rows < 16:
            raise ValueError(f"TritonTuning.query_rows must be >= 16 (Triton's dot), got {self.query_rows}")

    def pages_per_chunk(self, block_size: int, head_dim: int | None = None, itemsize: int | None = None) -> int:
        """Whole blocks gathered per loop step (at least one); given the padded head_dim
        and the cache's itemsize, chunk_tokens is first capped to what fits in shared memory."""
        tokens = self.chunk_tokens
        if head_dim is not None and itemsize is not None:
            tokens = min(tokens, max_chunk_tokens(head_dim, itemsize, self.num_stages))
        return max(1, tokens // block_size)

    def num_splits(self, num_seqs: int, num_kv_heads: int, max_chunks: int) -> int:
        """Decode programs per (sequence, kv head): kv_splits, or (auto) the power of two
        that gives at least TARGET_PROGRAMS programs, at most MAX_AUTO_SPLITS and one per
        chunk a sequence can have."""
        if self.kv_splits:
            return self.kv_splits
        wanted = -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
        return max(1, min(1 << (wanted - 1).bit_length(), MAX_AUTO_SPLITS, max_chunks))

    def label(self) -> str:
        return (f"c{self.chunk_tokens}-r{self.query_rows}-w{self.num_warps}-s{self.num_stages}"
                + (f"-k{self.kv_splits}" if self.kv_splits else ""))

    @classmethod
    def parse(cls, text: str) -> "TritonTuning":
        """The inverse of label(): 'c64-r16-w4-s2[-k4]' (any subset, in any order)."""
        fields = {"c": "chunk_tokens", "r": "query_rows", "w": "num_warps", "s": "num_stages", "k": "kv_splits"}
        values = {}
        for part in text.split("-"):
            if not part or part[0] not in fields or not part[1:].isdigit():
                raise ValueError(f"bad TritonTuning label {text!r}: parts are c<chunk_tokens>, r<query_rows>, "
                                 f"w<num_warps>, s<num_stages>, k<kv_splits>, joined by '-'")
            values[fields[part[0]]] = int(part[1:])
        return cls(**values)


# Triton stages a loop step's K and V chunks in shared memory, num_stages - 1 steps ahead.
# What it asked for on an H200 (its errors, 232,448 bytes available): bf16 chunks about
# chunk x head_dim x 2 bytes each, f32 chunks twice their bytes (e.g. 520 KB for 128 f32
# keys x 128 dims at 3 stages). SMEM_BUDGET is an A100's 163 KB, so a default tuning never
# fails to compile on a data-center GPU; a larger chunk is cut down, not refused.
SMEM_BUDGET = 160 * 1024


def max_chunk_tokens(head_dim: int, itemsize: int, num_stages: int) -> int:
    """The most keys per step (a power of two, at least 16) whose staged K and V fit SMEM_BUDGET."""
    per_token = 2 * head_dim * itemsize * (2 if itemsize >= 4 else 1) * max(1, num_stages - 1)
    tokens = 16
    while 2 * tokens * per_token <= SMEM_BUDGET:
        tokens *= 2
    return tokens


# a few programs per multiprocessor of a large GPU (an H100 / H200 has 132): the decode
# kernel's auto split aims at this many programs, one split per chunk at most
TARGET_PROGRAMS = 256
MAX_AUTO_SPLITS = 16

# Measured on an NVIDIA H200, bf16, blocks of 16, Llama-8B's 32/8 x 128 and SmolLM2's 9/3 x
# 64 heads, 16 and 64 sequences x 1024 and 4096 tokens, the decode kernel alone, ms, calls
# chained on the device one per loop trip (`STAGES=2c bash experiments/gpu_check.sh h200`, record
# bench_kernel_h200_decode_sweep; one config timed twice differed by 0.2% at 0.37 ms and
# by up to 3.5% under 0.1 ms). 128 keys per step beat 64 on 7 of 8 batches (64 x 4096 x
# 32/8: 0.368 vs 0.539; 64 x 1024 x 9/3: 0.033 vs 0.037; not 16 x 1024 x 9/3: 0.021 vs
# 0.017) and 32 (at 4 stages) on 7 of 8. A third pipelining stage took 128-key chunks
# faster on 6 of 8 (64 x 4096 x 32/8 0.368 -> 0.345, 74% of the 4.2 TB/s copy bandwidth;
# 64 x 1024 x 32/8 0.111 -> 0.105; 16 x 1024 x 9/3 0.021 -> 0.017), 2% slower on the
# other two; 8 warps did not help (0.375). Splits: where the batch gives 128 or 192
# programs (16 x 8 or 64 x 3 kv heads) 2 splits beat 1 and 4 (16 x 4096 x 32/8: 0.137 /
# 0.106 / 0.109; 64 x 1024 x 9/3: 0.043 / 0.033 / 0.037); at 48 programs (16 x 3) the
# auto split's 6 lost to 8 (16 x 4096: 0.038 vs 0.036; 16 x 1024: 0.021 vs 0.017, where 6
# splits of 8 chunks leave 2 empty and 4 took 0.018), so auto rounds up to a power of two.
# The rerun with these defaults (`bash experiments/gpu_check.sh h200`, calls 10 per loop
# trip): 64 x 4096 x 32/8 0.350 ms, 72% of 4.24 TB/s (record bench_kernel_h200); at 16 x
# 2048 (bench_kernel_h200_tunings) 3 stages with 8 splits 0.0214 ms at 9/3 against 0.0215
# with 2 stages and 0.0224 for the former default's 6 splits, and at 32/8 3 stages 0.0671
# against 2 stages' 0.0644-0.0653 (2 splits).
DEFAULT_DECODE_TUNING = TritonTuning(chunk_tokens=128, num_stages=3)


def default_decode_tuning(head_dim: int, itemsize: int) -> TritonTuning:
    """DEFAULT_DECODE_TUNING where its 3 stages fit its chunk in SMEM_BUDGET (bf16 up to
    128 dims), else the same with 2 stages (f32; 256 dims): a third stage is not worth a
    chunk cut down (unmeasured; 64-key chunks lost to 128 at 2 stages above)."""
    tuning = DEFAULT_DECODE_TUNING
    if max_chunk_tokens(head_dim, itemsize, tuning.num_stages) < tuning.chunk_tokens:
        tuning = dataclasses.replace(tuning, num_stages=2)
    return tuning


# Prefill chunks of 4 x 512 tokens at context 2048 on the H200 (`bash experiments/gpu_check.sh
# h200`, record bench_kernel_h200_tunings, 2 of its batches): 64-row query tiles read each
# block 4x less often than 16-row ones (0.516 vs 1.360 ms at 32/8 heads, 0.142 vs 0.301 ms
# at 9/3); a third stage changed nothing (0.516, 0.142). 128-row tiles: 0.444 ms at 32/8,
# 0.153 at 9/3; not the default, since a mixed step's decode rows fill tiles of their own
# (one token each) in the same launch.
DEFAULT_RAGGED_TUNING = TritonTuning(chunk_tokens=64, query_rows=64)
