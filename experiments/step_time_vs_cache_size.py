"""Decode step time against the KV cache's size, at a fixed batch.

    python -m experiments.step_time_vs_cache_size                  # SmolLM2, 8 sequences, 100 vs 3000 blocks

Why: a step's work should depend on the tokens it attends, not on how many blocks the
pool has. Before commit "Attention reads the cache as one pool..." the attention sliced
each layer out of the cache (a copy of the whole cache per step); this script measured
it (120 ms with 100 blocks, 360 ms with 3000, the same code run at that commit's parent)
and now guards the fix: the same batch should take about the same time at any pool size.
Per --num_blocks: a fresh engine, --num_seqs prompts of --prompt_len tokens decoding
--max_tokens tokens; the median device time of the steps that decode all of them.
"""

from __future__ import annotations

import statistics

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset.")
_NUM_BLOCKS = flags.DEFINE_list("num_blocks", ["100", "3000"], "KV pool sizes (blocks incl. the null block).")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 8, "Sequences decoding together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 40, "Output tokens per sequence.")
_OUTPUT = flags.DEFINE_string("output", "step_time_vs_cache_size", "Result name: experiments/results/<output>.json.")


def main(argv):
    del argv
    import numpy as np

    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import write_result
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.core.sampling_params import SamplingParams
    enable_compilation_cache()
    max_len = 512
    model = load_for_benchmark(_MODEL.value, max_len)
    n = _NUM_SEQS.value
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, model.config.vocab_size, _PROMPT_LEN.value).tolist()}
               for _ in range(n)]
    rows = []
    for num_blocks in (int(b) for b in _NUM_BLOCKS.value):
        llm = LLM(model, max_model_len=max_len, max_num_seqs=n, max_num_batched_tokens=64, seq_buckets=(n,),
                  token_buckets=(8, 64), num_blocks=num_blocks, enable_prefix_caching=False)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=_MAX_TOKENS.value, ignore_eos=True),
                     use_tqdm=False)
        decode = [d for s, k, _, d in llm.engine.stats_tracker.step_log if s == n and k == n]
        rows.append({"num_blocks": num_blocks, "decode_steps": len(decode),
                     "device_ms_median": round(1e3 * statistics.median(decode), 2)})
        print(f"num_blocks {num_blocks}: median decode step {rows[-1]['device_ms_median']:.1f} ms "
              f"over {len(decode)} steps", flush=True)
        del llm
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, seed=0,
                                figures={"model": model.source, "num_seqs": n, "rows": rows}))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
