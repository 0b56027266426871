"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as Flax NNX modules (decoder.py),
its parameter layout (llama.py), rotary embeddings (rope.py) and the jit boundary between
module and parameter pytree (functional.py)."""
