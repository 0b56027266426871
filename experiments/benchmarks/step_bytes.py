"""The bytes a model step reads from memory, as roofline.py (CPU) and gpu_bench.py (accelerators)
count them: the weights as served, and every sequence's K/V once per layer. One definition, so
the CPU's and the GPU's rooflines divide the same bytes by their bandwidths."""

from __future__ import annotations


def kv_read_bytes(cfg, contexts, itemsize: int) -> int:
    """K and V of every sequence's context (each token read once per layer)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * sum(contexts)


def served_weight_bytes(runner) -> int:
    """What one step reads of the weights: every layer array as served (packed, transposed or
    as stored) and the LM head (the packed copy where there is one); the embedding lookup's
    few rows are left out."""
    import jax
    params = runner.params
    layers = sum(a.nbytes for a in jax.tree.leaves(params["layers"]))
    if runner.packed_head is not None:
        head = runner.packed_head.nbytes
    else:
        head = (params["lm_head"] if params.get("lm_head") is not None else params["embed"]).nbytes
    return int(layers + head + params["final_norm"].nbytes)
