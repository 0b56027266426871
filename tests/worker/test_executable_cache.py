"""The executable cache (paged_jax/worker/executable_cache.py): a warm-up on a filled cache
traces nothing and serves exactly what a fresh compile serves; a changed key input misses;
an unreadable entry is compiled instead and deleted; a program JAX's persistent cache served is not
stored; with the compilation cache off nothing is written."""

import logging
import os

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.worker import executable_cache
from paged_jax.worker.compilation_cache import enable_compilation_cache
from paged_jax.worker.executable_cache import ExecutableCache

SETTINGS = dict(block_size=8, num_blocks=32, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8,
                seq_buckets=(2,), token_buckets=(8,), enable_prefix_caching=False)
# prompt logprobs run the prompt head; two samples sharing a partly filled block copy it on write
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
SAMPLED = SamplingParams(n=2, temperature=0.9, top_k=7, seed=11, max_tokens=5, ignore_eos=True, logprobs=2)
PROMPTS = ([3, 4, 5], [6, 7, 8, 9, 10, 11])


@pytest.fixture
def cache_dir(tmp_path):
    """Both caches empty, for the test: JAX's persistent cache in `tmp_path/jax` (reopened
    there: JAX opens it once and then keeps it) and so the executable cache in its sibling;
    then tests/conftest.py's restored. Empty, so that a cold runner compiles fresh programs,
    the only ones the executable cache stores (`executable_cache._compile`)."""
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    path = str(tmp_path / "jax")
    jax_cache.reset_cache()
    enable_compilation_cache(path)
    try:
        yield path
    finally:
        jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])


def _serve(model, **settings):
    """(the engine's runner, its outputs: per completion its tokens and logprobs, per request
    its prompt logprobs, of a greedy request and a seeded sampled one with two completions),
    checking that serving traced nothing after warm-up."""
    engine = LLMEngine(model, EngineConfig(**{**SETTINGS, **settings}))
    runner = engine.core.runner
    traced = runner.num_compilations
    for i, (prompt, params) in enumerate(zip(PROMPTS, (GREEDY, SAMPLED))):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                prompt = [sorted((t, x.logprob) for t, x in p.items()) for p in out.prompt_logprobs or [] if p]
                outputs[out.request_id] = [(c.token_ids, c.logprobs) for c in out.outputs] + [([], prompt)]
    assert runner.num_compilations == traced, "serving traced a program warm-up did not provide"
    return runner, [completion for i in range(len(PROMPTS)) for completion in outputs[f"r{i}"]]


def _assert_same(outputs, expected):
    assert any(logprobs and isinstance(logprobs[0], list) for _, logprobs in expected)  # prompt logprobs came
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(outputs, expected, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(np.asarray(logprobs, dtype=float), np.asarray(want_logprobs, dtype=float),
                                   rtol=1e-6)


def _entries(cache_dir):
    directory = executable_cache.executable_cache_dir()
    assert directory == cache_dir + "-executables"
    return sorted(os.path.join(directory, name) for name in os.listdir(directory))


def test_warm_up_on_a_filled_cache_traces_nothing_and_serves_the_same(tiny_llama, cache_dir):
    cold, cold_outputs = _serve(tiny_llama)
    stored = len(_entries(cache_dir))
    # every step bucket, the heads of each row bucket, the prompt head, the block copy
    assert cold.executables.misses == stored >= 4 and cold.executables.hits == cold.executables.not_stored == 0
    assert cold.num_compilations > 0

    warm, warm_outputs = _serve(tiny_llama)
    assert (warm.executables.hits, warm.executables.misses, warm.executables.errors) == (stored, 0, 0)
    assert warm.num_compilations == 0  # neither warm-up nor serving traced anything
    _assert_same(warm_outputs, cold_outputs)


def test_outputs_equal_a_runner_without_the_cache(tiny_llama, cache_dir):
    _serve(tiny_llama)  # fills the cache
    warm, warm_outputs = _serve(tiny_llama)
    assert warm.executables.hits > 0 and warm.num_compilations == 0
    jax.config.update("jax_compilation_cache_dir", None)
    plain, plain_outputs = _serve(tiny_llama)
    assert plain.executables is None and plain.num_compilations > 0
    _assert_same(warm_outputs, plain_outputs)


def test_a_changed_setting_misses(tiny_llama, cache_dir):
    first, _ = _serve(tiny_llama)
    # the same shapes, another top-K width: only the heads' static k differs, and the key's settings
    other, _ = _serve(tiny_llama, max_logprobs=3)
    assert other.executables.hits == 0 and other.executables.misses == first.executables.misses
    # programs that JAX's persistent cache already held (the step: it has no k) are not stored again
    stored = other.executables.misses - other.executables.not_stored
    assert 0 < stored < other.executables.misses and len(_entries(cache_dir)) == first.executables.misses + stored


def test_a_changed_environment_misses(tiny_llama, cache_dir):
    """Another source digest, JAX version, backend or config flag: another context, no hit."""
    runner, _ = _serve(tiny_llama)
    same = ExecutableCache(runner.executables.directory, runner.executables.context)
    other = ExecutableCache(runner.executables.directory, runner.executables.context.replace(
        executable_cache.source_digest(), "0" * 64))
    assert other.context != same.context
    args = (np.zeros(3, np.float32),)
    double = jax.jit(lambda x: 2 * x)
    same.load_or_compile("double", double, args)
    assert (same.hits, same.misses) == (0, 1)
    other.load_or_compile("double", double, args)
    assert (other.hits, other.misses) == (0, 1)
    again = ExecutableCache(runner.executables.directory, runner.executables.context)
    np.testing.assert_array_equal(again.load_or_compile("double", double, (np.ones(4, np.float32),))(
        np.ones(4, np.float32)), [2.0] * 4)
    assert (again.hits, again.misses) == (0, 1)  # another shape: another program
    assert again.load_or_compile("double", double, args) is not None and again.hits == 1


def test_source_digest_covers_every_package_source(tmp_path):
    for package, name in [("paged_jax", "a.py"), ("pallas_kernels", "b.py"), ("cpu_kernels", "c.cc"),
                          ("cpu_kernels", "d.h")]:
        os.makedirs(tmp_path / package, exist_ok=True)
        (tmp_path / package / name).write_text("x = 1\n")
    (tmp_path / "paged_jax" / "notes.txt").write_text("not source")
    digests = {executable_cache.source_digest.__wrapped__(str(tmp_path))}
    (tmp_path / "paged_jax" / "notes.txt").write_text("still not source")
    assert executable_cache.source_digest.__wrapped__(str(tmp_path)) in digests
    for package, name in [("paged_jax", "a.py"), ("pallas_kernels", "b.py"), ("cpu_kernels", "c.cc"),
                          ("cpu_kernels", "d.h")]:
        (tmp_path / package / name).write_text("x = 2\n")
        digest = executable_cache.source_digest.__wrapped__(str(tmp_path))
        assert digest not in digests, f"{package}/{name} is not in the digest"
        digests.add(digest)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "another key"])
def test_an_unreadable_entry_compiles_again(tiny_llama, cache_dir, caplog, damage):
    cold, cold_outputs = _serve(tiny_llama)
    entries = _entries(cache_dir)
    for path in entries:
        with open(path, "rb") as f:
            data = f.read()
        if damage == "truncated":
            data = data[: len(data) // 2]
        elif damage == "garbage":
            data = b"not a pickle" + data[12:]
        else:  # a valid entry under another entry's name: its key text is not this one's
            with open(entries[(entries.index(path) + 1) % len(entries)], "rb") as f:
                data = f.read()
        with open(path, "wb") as f:
            f.write(data)
    with caplog.at_level(logging.WARNING, logger=executable_cache.__name__):
        warm, warm_outputs = _serve(tiny_llama)
    n = len(entries)
    assert (warm.executables.hits, warm.executables.misses, warm.executables.errors) == (0, n, n)
    assert len([r for r in caplog.records if "compiling instead" in r.getMessage()]) == n
    assert warm.num_compilations > 0
    _assert_same(warm_outputs, cold_outputs)
    # the unusable entries are gone; what was compiled fresh is stored again (a program that JAX's
    # persistent cache served is not: `test_a_program_from_jax_persistent_cache_is_not_stored`) ...
    stored = warm.executables.misses - warm.executables.not_stored
    assert len(_entries(cache_dir)) == stored < n
    again, again_outputs = _serve(tiny_llama)  # ... so the next start reads those and warns of nothing
    assert (again.executables.hits, again.executables.misses, again.executables.errors) == (stored, n - stored, 0)
    _assert_same(again_outputs, cold_outputs)


def test_a_program_from_jax_persistent_cache_is_not_stored(tiny_llama, cache_dir):
    """Its executable was deserialized, and serialized again it would load but not run
    (`executable_cache._compile`): the runner uses it, the next start compiles it again."""
    _, cold_outputs = _serve(tiny_llama)  # fills both caches
    for path in _entries(cache_dir):
        os.unlink(path)
    from_jax, outputs = _serve(tiny_llama)  # JAX's persistent cache serves the programs it stored
    not_stored = from_jax.executables.not_stored
    assert 0 < not_stored <= from_jax.executables.misses
    assert len(_entries(cache_dir)) == from_jax.executables.misses - not_stored
    _assert_same(outputs, cold_outputs)
    again, again_outputs = _serve(tiny_llama)  # stored, those would load here and fail when run
    assert again.executables.misses == not_stored and again.executables.errors == 0
    _assert_same(again_outputs, cold_outputs)


def test_only_a_program_compiled_now_is_stored(cache_dir, tmp_path):
    """What JAX's in-memory or persistent cache returns may have been deserialized, and such
    an executable, serialized again, fails when run (`executable_cache._compile`)."""
    def make_cube():  # each call: the same program (name included), from a function JAX's memory does not know
        def cube(x):
            return x * x * x
        return cube
    args = (np.arange(5, dtype=np.float32),)
    jitted = jax.jit(make_cube())
    fresh = ExecutableCache(str(tmp_path / "fresh"), "context")
    fresh.load_or_compile("cube", jitted, args)  # XLA compiles it (and JAX's persistent cache stores it)
    in_memory = ExecutableCache(str(tmp_path / "in_memory"), "context")
    np.testing.assert_array_equal(in_memory.load_or_compile("cube", jitted, args)(*args), args[0] ** 3)
    persistent = ExecutableCache(str(tmp_path / "persistent"), "context")
    np.testing.assert_array_equal(persistent.load_or_compile("cube", jax.jit(make_cube()), args)(*args), args[0] ** 3)
    assert [c.not_stored for c in (fresh, in_memory, persistent)] == [0, 1, 1]
    assert [len(os.listdir(c.directory)) if os.path.isdir(c.directory) else 0
            for c in (fresh, in_memory, persistent)] == [1, 0, 0]


def test_cache_off_writes_nothing(tiny_llama, cache_dir):
    jax_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    assert executable_cache.executable_cache_dir() is None
    runner, _ = _serve(tiny_llama)
    assert runner.executables is None
    assert not os.path.exists(cache_dir + "-executables")


def test_least_recently_used_entries_are_evicted(cache_dir, tmp_path):
    entries = tmp_path / "entries"
    cache = ExecutableCache(str(entries), "context", max_bytes=1)
    square = jax.jit(lambda x: x * x)
    cache.load_or_compile("square", square, (np.zeros(2, np.float32),))
    assert len(os.listdir(entries)) == 1  # over the limit, but the newest entry stays
    cache.load_or_compile("square", square, (np.zeros(3, np.float32),))
    [kept] = os.listdir(entries)
    assert kept == os.path.basename(cache.path(cache.key("square", (np.zeros(3, np.float32),))))
