"""What padding and block copies cost a step: the jitted step per padded shape, and the
copy-on-write call on a padded copy list.

    python -m experiments.step_shape_costs          # SmolLM2, the benchmark_throughput engine settings

Why: two engine choices rest on these figures. Default buckets add 1.5x midpoints
(engine_config.default_buckets) because a big step's cost grows about linearly with its
padded size; block copies run as their own call, only in steps that have any (runner.py),
because copying the padded list (max_num_seqs entries) inside every step cost most of a
small decode step. Steps run on padding-only batches (every row is padding: this times
the model's matmuls, logits and sampling at that shape, not attention over a context).
Times are medians of --iters calls after one untimed call (benchmarks/step_batches.median_ms,
as roofline.py and helper_threads.py time their steps).
"""

from __future__ import annotations

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset.")
_SHAPES = flags.DEFINE_list("shapes", ["8", "64", "96", "128"], "Decode shapes S (S rows, S tokens) to time.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 513, "KV blocks incl. the null block.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 128, "max_num_seqs (also the padded copy list's length).")
_ITERS = flags.DEFINE_integer("iters", 9, "Timed calls per shape (median reported).")
_OUTPUT = flags.DEFINE_string("output", "step_shape_costs", "Result name: experiments/results/<output>.json.")


def _median_ms(fn, iters: int) -> float:
    from experiments.benchmarks.step_batches import median_ms
    return round(median_ms(fn, iters), 2)


def main(argv):
    del argv
    import jax
    import numpy as np

    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import write_result
    from paged_jax.worker.batch_inputs import empty_batch
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.entrypoints.llm import LLM
    enable_compilation_cache()
    model = load_for_benchmark(_MODEL.value, 1024)
    shapes = [int(s) for s in _SHAPES.value]
    llm = LLM(model, max_model_len=1024, max_num_seqs=_MAX_NUM_SEQS.value, max_num_batched_tokens=256,
              num_blocks=_NUM_BLOCKS.value, enable_prefix_caching=False, seq_buckets=tuple(shapes),
              token_buckets=tuple(sorted(set(shapes) | {256})))
    runner = llm.engine.runner

    def step(batch):
        runner.run_batch(batch)  # the model step and its head, results fetched to the host

    rows = []
    for s in shapes:
        batch = empty_batch(s, s, runner.max_blocks_per_seq, runner.max_copies, runner.num_blocks * 16)
        rows.append({"rows": s, "step_ms": _median_ms(lambda: step(batch), _ITERS.value)})
        print(f"step of {s} padded rows: {rows[-1]['step_ms']:.1f} ms", flush=True)
    no_copies = np.zeros(runner.max_copies, np.int32)

    def copy():
        runner.kv_cache = jax.block_until_ready(runner._copy_blocks(runner.kv_cache, no_copies, no_copies))
    copy_ms = _median_ms(copy, _ITERS.value)
    print(f"copy call on {runner.max_copies} padded entries: {copy_ms:.1f} ms")
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, seed=0, figures={
        "model": model.source, "num_blocks": _NUM_BLOCKS.value, "steps": rows,
        "copy_padded_entries": runner.max_copies, "copy_ms": copy_ms}))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
