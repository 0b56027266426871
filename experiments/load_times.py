"""Time each way of loading the default model: GGUF, Hugging Face directory, orbax checkpoint.

    python -m experiments.load_times

The HF directory is written by `transformers.save_pretrained` from the same GGUF (so this
script needs the test extra's torch); the orbax checkpoint by `save_checkpoint`. Each
path is loaded --repeats times in this process and the minimum and median are reported
(each load includes the tokenizer; `checkpoint_params_only` leaves it out): the first
load of a path also pays imports and file-cache misses.
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


def _time_loads(load, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(load())
        seconds.append(time.perf_counter() - start)
    return {"min_s": round(min(seconds), 3), "median_s": round(statistics.median(seconds), 3),
            "all_s": [round(s, 3) for s in seconds]}


def _write_hf_directory(gguf_path: str, out_dir: str) -> None:
    import torch  # noqa: F401  (transformers needs it to read and write the model)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(gguf_path)
    from_gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    # transformers refuses to save a GGUF-loaded model; copy its weights into a plain one.
    config = from_gguf.config
    config.quantization_config = None
    plain = AutoModelForCausalLM.from_config(config, dtype="float32")
    plain.load_state_dict(from_gguf.state_dict())
    plain.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    from paged_jax.loading import load_checkpoint, load_model, registry, save_checkpoint

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
    loads = {
        "gguf": lambda: load_model(gguf_path).params,
        "hf": lambda: load_model(hf_dir).params,
        "checkpoint": lambda: load_model(ckpt_dir).params,
        "checkpoint_params_only": lambda: load_checkpoint(ckpt_dir, load_tokenizer=False)[1],
    }
    for kind, load in loads.items():
        figures[kind] = _time_loads(load, _REPEATS.value)
        print(f"{kind:>22}: min {figures[kind]['min_s']:.2f}s  median {figures[kind]['median_s']:.2f}s  "
              f"({figures[kind]['all_s']})")
    figures["params"] = loaded.config.num_params()
    figures["gguf_size_bytes"] = os.path.getsize(gguf_path)
    path = write_result("load_times", flags={"model": _MODEL.value, "repeats": _REPEATS.value}, figures=figures)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
