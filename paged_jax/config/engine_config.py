"""EngineConfig: every setting of the paged engine, frozen and validated.

`LLM(model, **settings)` takes these fields as keywords. Fields left None are resolved
against the model when the engine starts (`resolve`), so the resolved config records
exactly what ran.
"""

from __future__ import annotations

import dataclasses

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_ALLOCATORS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
ATTENTION_BACKENDS = ("auto", "native", "pallas", "xla", "reference")
LAYER_LOOPS = ("auto", "unroll", "scan")
POOL_CHECKS = ("off", "idle", "step")
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 2**20  # the KV budget of a platform that sets none of its own
DEFAULT_MAX_MODEL_LEN = 2048  # cap on the model's own limit when none is given (CPU-friendly)


MIDPOINT_BUCKETS_FROM = 32  # from this size on, default buckets add the 1.5x midpoints


def default_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo, with 1.5x midpoints from MIDPOINT_BUCKETS_FROM on, and hi.

    Why the midpoints: a batch pads up to its bucket, and on a CPU a big step costs about
    linearly in its padded size (SmolLM2: 194 ms at 64 rows, 254 at 96, 308 at 128;
    `python -m experiments.step_shape_costs`), so
    65 sequences in a 128 bucket nearly double the step. Midpoints keep the padding of
    big batches under half (65 -> 96) and cost only a few more shapes to compile (none
    below 32). At the GPU/TPU defaults (256 sequences, 8192 tokens per step) that is 12
    row and 19 token buckets and 22 step shapes (a decode shape per row bucket, a mixed one
    per token bucket above 256: worker/batch_inputs.all_batch_shapes), 8 more than powers of
    two alone; at the CPU's (64 / 1024), 16. On a GPU warm-up compiles 46 step programs for
    them (the 256-row shape also serves mixed steps, and the fused head has a greedy and a
    sampling variant: ModelRunner.step_kinds); on the CPU, 16 steps and their heads.
    """
    out, n = [], 1
    while n < hi:
        if n >= lo:
            out.append(n)
        if n >= MIDPOINT_BUCKETS_FROM and n * 3 // 2 < hi:
            out.append(n * 3 // 2)
        n *= 2
    return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # device KV blocks incl. the null block; None: from the byte budget
    kv_cache_memory_bytes: int | None = None  # KV budget per device; None: CPU 512 MiB, GPU/TPU gpu_memory_utilization
    max_model_len: int | None = None  # prompt + output cap; None: min(model limit, 2048)
    max_num_seqs: int | None = None  # sequences per step; None: the platform's (CPU 64, GPU/TPU 256)
    max_num_batched_tokens: int | None = None  # tokens per step (prefills + decodes); None: CPU 1024, GPU/TPU 8192
    # the share of a device's memory free at start (weights loaded) the KV cache may take; on GPU/TPU, with
    # neither num_blocks nor kv_cache_memory_bytes given, the cache takes all of it (vLLM's
    # gpu_memory_utilization, there a share of the whole device). The rest is for the step's activations,
    # the head's packed copy and the compiled programs. On CPU the default budget stays the platform's
    # bytes and this only caps what the host's free memory may give the cache (engine/kv_sizing.py)
    gpu_memory_utilization: float = 0.9  # share of free device memory the KV cache may take (GPU/TPU: takes)
    enable_chunked_prefill: bool = True  # False: a prompt's prefill is never split across steps
    preemption_mode: str = "recompute"  # or "swap" (to host memory)
    scheduling_policy: str = "fcfs"  # "fcfs" (arrival order) | "priority" (lower request priority first; vLLM's rule)
    swap_space_bytes: int = 256 * 2**20  # host memory for swapped blocks
    attention_backend: str = "auto"  # "native" CPU kernel | "pallas" kernel | "xla" chunked | "reference" jnp | "auto"
    layer_loop: str = "auto"  # "unroll" (per-layer weights, a Python loop) | "scan" | "auto": the platform's (CPU unroll)
    dtype: str = "float32"  # weights ("bfloat16": bf16 weights, f32 accumulation and residual stream)
    kv_cache_dtype: str = "auto"  # "float32" | "bfloat16" | "auto": dtype's (f32 on CPU unless attention is native)
    seed: int = 0  # seeds requests that give none
    watermark: float = 0.01  # fraction of blocks kept free when admitting new sequences
    enable_prefix_caching: bool = True  # reuse cached full blocks of equal prefixes across requests
    max_logprobs: int = 20  # top-k logprobs each step returns (API logprobs; beam candidates)
    seq_buckets: tuple[int, ...] | None = None  # padded batch sizes; None: default_buckets to max_num_seqs
    token_buckets: tuple[int, ...] | None = None  # padded token counts; None: default_buckets (>= 8) to max_num_batched_tokens
    # "paged": blocks on demand (BlockManager). "contiguous-max" / "-pow2" / "-oracle": the
    # paper's Orca-style baselines (contiguous_allocator.py): one first-fit contiguous run
    # per request reserved at admission for max_model_len tokens / the next power of two
    # >= its final length / exactly its final length; no sharing, swap or prefix caching.
    kv_allocator: str = "paged"  # "paged" | baselines "contiguous-max" | "contiguous-pow2" | "contiguous-oracle"
    # > 1: shard attention heads, MLP and KV cache over a mesh of this many devices
    # (paged_jax/distributed/tensor_parallel.py); the KV budget (kv_cache_memory_bytes) is then per device
    tensor_parallel_size: int = 1  # devices in the tensor-parallel mesh axis; must divide num_heads and num_kv_heads
    # the KV pool's self-check (engine/pool_check.py): a leaked block, table or request is reported (an error
    # log, stats num_pool_check_failures, a metric), never served on silently
    pool_check: str = "idle"  # "idle": counts whenever the engine falls idle | "step": full walk after every step | "off"
    # disaggregated prefill / decode (engine/kv_transfer.py): prompt K/V blocks leave one engine and enter
    # another's prefix cache; needs paged blocks with prefix caching
    kv_transfer: bool = False  # this engine exports / imports prompt K/V blocks; warm-up compiles the block moves
    # the paper's per-step figures in stats() (kv_utilization, waste_*_slots, mean_blocks_without_sharing,
    # sharing_savings; engine/stats.py): each costs a Python pass over the sequences every step, so servers and
    # notebooks leave them off (their keys are None); the experiments that record them turn them on
    paper_metrics: bool = False  # keep the paper's KV utilization, waste and sharing figures (a pass per step)
    # schedule and dispatch step N+1 while step N runs on the device; N's tokens feed N+1 on the device
    # and the host reads them while N+1 runs (vLLM v1's async scheduling; engine/engine_core.py). Outputs
    # then lag one step. None: the platform's (on for GPU/TPU, off on CPU); False: strictly in sequence
    async_scheduling: bool | None = None  # step N+1 scheduled while N runs; None: the platform's (GPU/TPU on, CPU off)

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if name in ("max_num_seqs", "max_num_batched_tokens") and getattr(self, name) is None:
                continue  # the platform's default, filled when the engine starts (engine/kv_sizing.py)
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), got {self.num_blocks}")
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] of the device's free memory, "
                             f"got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.kv_allocator not in KV_ALLOCATORS:
            raise ValueError(f"kv_allocator must be one of {KV_ALLOCATORS}, got {self.kv_allocator!r}")
        if self.kv_allocator != "paged":
            if self.preemption_mode != "recompute":
                raise ValueError(f"kv_allocator={self.kv_allocator!r} has no swap: use preemption_mode='recompute'")
            object.__setattr__(self, "enable_prefix_caching", False)  # contiguous baselines share nothing
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.kv_transfer and (self.kv_allocator != "paged" or not self.enable_prefix_caching):
            raise ValueError("kv_transfer needs kv_allocator='paged' with enable_prefix_caching=True: imported blocks "
                             "enter the prefix cache")
        if not isinstance(self.paper_metrics, bool):
            raise ValueError(f"paper_metrics must be True or False, got {self.paper_metrics!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if self.pool_check not in POOL_CHECKS:
            raise ValueError(f"pool_check must be one of {POOL_CHECKS}, got {self.pool_check!r}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {self.layer_loop!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32' or 'bfloat16', got {self.kv_cache_dtype!r}")
        if self.swap_space_bytes < 0 or not 0 <= self.watermark < 1:
            raise ValueError("swap_space_bytes must be >= 0 and watermark in [0, 1)")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 1:
            raise ValueError(f"max_logprobs must be an int >= 1, got {self.max_logprobs!r}")
        for name in ("seq_buckets", "token_buckets"):
            if getattr(self, name) is not None:
                buckets = tuple(sorted(set(getattr(self, name))))
                if not buckets or not all(isinstance(b, int) and b >= 1 for b in buckets):
                    raise ValueError(f"{name} must be ints >= 1, got {getattr(self, name)!r}")
                object.__setattr__(self, name, buckets)
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            return  # buckets and their checks once the platform's defaults are filled in (`resolved`)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs a token per step")
        if self.seq_buckets is None:
            object.__setattr__(self, "seq_buckets", default_buckets(1, self.max_num_seqs))
        if self.token_buckets is None:
            object.__setattr__(self, "token_buckets", default_buckets(8, self.max_num_batched_tokens))
        if self.seq_buckets[-1] < self.max_num_seqs or self.token_buckets[-1] < self.max_num_batched_tokens:
            raise ValueError("the largest seq/token bucket must cover max_num_seqs/max_num_batched_tokens")
