"""The jit boundary: a decoder class as a static GraphDef plus its parameter pytree.

Jitted code never holds a live module. A caller splits the class once, abstractly
(`split_model`: no weights allocated), keeps the GraphDef, and inside its jitted
function rebuilds the module from the params it was passed:
`nnx.merge(graphdef, params)(...)`. The step is then a pure function of
(params, KV cache, batch): nothing is captured, nothing written back, and the
GraphDef (hashable, fixed per class and config) never causes a retrace.

`nnx.merge` checks only the number of leaves and assigns them in sorted-name order, so
a dict whose names differ but count the same would load silently into the wrong
places: `check_params` compares names and shapes first.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.config.model_config import ModelConfig
from paged_jax.model.llama import Params


def split_model(model_class: type[nnx.Module], cfg: ModelConfig) -> tuple[nnx.GraphDef, Params]:
    """(GraphDef, params as ShapeDtypeStructs) of `model_class(cfg, rngs=..., dtype=...)`, built
    abstractly. Refuses a module with state other than nnx.Param: the step carries only
    params and the explicit KV cache, so any other variable would silently never update."""
    abstract = nnx.eval_shape(lambda: model_class(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, other = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(other):
        names = sorted("/".join(map(str, path)) for path, _ in nnx.to_flat_state(other))
        raise ValueError(f"{model_class.__name__} holds state other than nnx.Param ({names}); a served model's "
                         "only state is its params (the KV cache is an explicit argument)")
    return graphdef, nnx.to_pure_dict(params)


def params_of(model: nnx.Module) -> Params:
    """A live module's Params as the plain nested dict the runner and reference take."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def check_params(expected: Params, params: Any, what: str = "params") -> None:
    """ValueError unless `params` has exactly `expected`'s names and shapes (dtypes free)."""
    want = {_name(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(expected)[0]}
    got = {_name(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    if want == got:
        return
    missing, unexpected = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    shapes = [f"{n}: {got[n]} (model: {want[n]})" for n in sorted(want.keys() & got.keys()) if want[n] != got[n]]
    raise ValueError(f"{what} do not fit the model: missing {missing}, unexpected {unexpected}, "
                     f"wrong shapes {shapes}")


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def unstack_layers(params: Params) -> Params:
    """params with `layers` as a tuple of per-layer dicts (one array per layer and name):
    the serving layout of an unrolled step (`LlamaDecoder(..., unroll_layers=True)`)."""
    layers = params["layers"]
    num_layers = len(next(iter(jax.tree.leaves(layers))))
    return {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(num_layers))}


def restack_layers(params: Params) -> Params:
    """unstack_layers undone, inside jit: the module takes stacked layers. XLA folds each
    static slice of the stack back into the per-layer array, so nothing is copied."""
    return {**params, "layers": jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *params["layers"])}


LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # what DecoderLayer reads through `linear`


def layer_matrices_as(params: Params, pack: Callable[[jnp.ndarray], jnp.ndarray]) -> Params:
    """Every layer's projection matrices converted by `pack` (a `Linear.pack`: the layout its
    `dense` takes, paged_jax/model/linear.py), the other params as they are. Works on stacked
    layers and on unstack_layers' per-layer dicts; `pack` gets [in, out] or [layers, in, out]."""

    def convert(layer: dict) -> dict:
        return {name: pack(a) if name in LAYER_MATRICES else a for name, a in layer.items()}

    layers = params["layers"]
    return {**params, "layers": tuple(map(convert, layers)) if isinstance(layers, tuple) else convert(layers)}
