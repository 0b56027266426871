"""Collectives in a compiled tensor-parallel step, read from its HLO text (for
tests/distributed/test_tensor_parallel.py): which collective ops run inside the layer loop's
while body and which outside it, by result shape."""

from __future__ import annotations

import re

_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (all-reduce|all-gather|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_CALLS = re.compile(r"(?:body|condition|calls|branch_computations)=\{?([^,}]+(?:, %[^,}]+)*)\}?")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps


def _collectives(lines) -> list[tuple[str, str]]:
    """(kind, result shape without layout) of every collective among `lines`."""
    out = []
    for line in lines:
        m = _COLLECTIVE.match(line)
        if m:
            out.append((m.group(2), re.sub(r"\{[\d,]*\}", "", m.group(1))))
    return out


def _layer_loop(hlo: str, local_cache_shape: str) -> tuple[list[str], list[str]]:
    """(instructions inside the layer scan's while body, everything else): the layer loop
    is the while that carries this device's cache shard."""
    comps = _computations(hlo)
    [while_line] = [line for c in comps.values() for line in c
                    if " while(" in line and local_cache_shape in line.split("while(")[0]]
    body = re.search(r"body=%(\S+?),", while_line).group(1)
    inside, todo = set(), [body]
    while todo:
        name = todo.pop()
        if name in inside or name not in comps:
            continue
        inside.add(name)
        for line in comps[name]:
            for m in _CALLS.finditer(line):
                todo += [n.strip().lstrip("%") for n in m.group(1).split(",")]
    return ([line for n in inside for line in comps[n]],
            [line for n, c in comps.items() if n not in inside for line in c])


def check_collectives(step, *, layers, num_blocks, block_size, kv_heads, head_dim, tp, num_seqs, num_tokens,
                      hidden, vocab):
    """Assert the tensor-parallel step's collectives: Megatron's two all-reduces per layer inside the
    layer loop, the embedding's all-reduce and the logits' all-gather outside, no gathered KV cache."""
    # attention runs per shard (shard_map): only there does the program see the cache at its
    # local shape (the SPMD partitioner alone would show global shapes before compiling)
    local = f"tensor<{layers}x{num_blocks}x{block_size}x{kv_heads // tp}x{head_dim}xf32>"
    assert local in step["lowered"], f"no {local} in the lowered step: attention is not run per shard"
    local_cache = f"f32[{layers},{num_blocks},{block_size},{kv_heads // tp},{head_dim}]"
    inside, outside = _layer_loop(step["compiled"], local_cache)
    residual = f"f32[{num_tokens},{hidden}]"
    # Megatron: per layer one all-reduce after wo and one after w_down, of the residual stream
    assert _collectives(inside) == [("all-reduce", residual)] * 2, _collectives(inside)
    # outside the loop: the vocab-sharded embedding lookup's all-reduce, the logits' all-gather
    assert sorted(_collectives(outside)) == [("all-gather", f"f32[{num_seqs},{vocab}]"),
                                             ("all-reduce", residual)], _collectives(outside)
    full_cache = [f"f32[{layers},{num_blocks},{block_size},{kv_heads},{head_dim}]",
                  f"f32[{num_blocks},{block_size},{kv_heads},{head_dim}]"]
    assert not [c for c in _collectives(inside + outside) if c[1] in full_cache]  # no gathered KV cache
