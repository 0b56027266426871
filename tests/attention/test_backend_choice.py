"""What attention_backend="auto" picks per platform (paged_jax/attention/backend.py)."""

from paged_jax.attention import backend


def test_gpu_takes_the_pallas_kernels_tpu_the_reference():
    for platform in ("gpu", "cuda", "rocm"):
        assert backend.auto_attention_backend(platform) == "pallas"
    assert backend.auto_attention_backend("tpu") == "reference"
    assert backend.auto_attention_backend("metal") == "reference"  # unknown platforms: the reference


def test_cpu_takes_the_native_kernel_where_it_builds(monkeypatch):
    monkeypatch.setattr(backend, "_native_available", lambda: True)
    assert backend.auto_attention_backend("cpu") == "native"
    monkeypatch.setattr(backend, "_native_available", lambda: False)
    assert backend.auto_attention_backend("cpu") == "pallas"
