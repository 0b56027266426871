"""Time each way of loading the default model: GGUF, Hugging Face directory, orbax checkpoint.

    python -m experiments.load_times

The HF directory is written by `transformers.save_pretrained` from the same GGUF (so this
script needs the test extra's torch); the orbax checkpoint by `save_checkpoint`. Each
path is loaded --repeats times in this process and the minimum and median are reported:
the first load of a path also pays imports and file-cache misses.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import jax
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Registered model to time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Loads per path.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the converted copies (default: a temp dir).")


def _time_loads(path: str, repeats: int) -> dict:
    from paged_jax.loading import load_model
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        loaded = load_model(path)
        jax.block_until_ready(loaded.params)
        seconds.append(time.perf_counter() - start)
    return {"min_s": round(min(seconds), 3), "median_s": round(statistics.median(seconds), 3),
            "all_s": [round(s, 3) for s in seconds]}


def _write_hf_directory(gguf_path: str, out_dir: str) -> None:
    import torch  # noqa: F401  (transformers needs it to read and write the model)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(gguf_path)
    AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32").save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def main(argv):
    del argv
    from experiments.results_io import write_result
    from paged_jax.loading import load_model, registry, save_checkpoint

    gguf_path = registry.resolve(_MODEL.value)
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="paged_jax_load_times_")
    loaded = load_model(gguf_path)
    ckpt_dir = os.path.join(workdir, "orbax")
    if not os.path.exists(ckpt_dir):
        save_checkpoint(ckpt_dir, loaded.config, loaded.params, loaded.tokenizer)
    hf_dir = os.path.join(workdir, "hf")
    if not os.path.exists(hf_dir):
        _write_hf_directory(gguf_path, hf_dir)

    figures = {}
    for kind, path in (("gguf", gguf_path), ("hf", hf_dir), ("checkpoint", ckpt_dir)):
        figures[kind] = _time_loads(path, _REPEATS.value)
        print(f"{kind:>10}: min {figures[kind]['min_s']:.2f}s  median {figures[kind]['median_s']:.2f}s  "
              f"({figures[kind]['all_s']})")
    figures["params"] = loaded.config.num_params()
    figures["gguf_size_bytes"] = os.path.getsize(gguf_path)
    path = write_result("load_times", flags={"model": _MODEL.value, "repeats": _REPEATS.value}, figures=figures)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
