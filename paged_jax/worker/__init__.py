"""The device side of a step: the model runner (jitted, fixed-shape steps with the KV cache
donated), host batch preparation, the KV cache and swap space, the sampler, and the persistent
compilation cache."""
