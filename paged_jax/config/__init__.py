"""What every layer reads: EngineConfig and ModelConfig, frozen dataclasses in pure Python (no jax, no numpy)."""
