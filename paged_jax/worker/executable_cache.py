"""Compiled step programs kept on disk, so a warm start neither traces nor lowers anything.

Why: JAX's persistent compilation cache (compilation_cache.py) saves only the backend
compile. Its key is the lowered program, so every start still traces each program to a
jaxpr and lowers it to StableHLO before it can look: for SmolLM2-135M's 34 warm-up programs
on 2 shared cores that was ~5 s of a ~14 s warm start (trace 3.1 s, lower 2.1 s; record
`startup_time`). Here the runner's compiled programs are stored whole
(`jax.experimental.serialize_executable`: the XLA executable with its pytree structure and
argument layout) under a key computed from what the program depends on, without tracing it.

Never stale. A hit must be the program a fresh trace would compile, so the key covers:
every source file of the packages a step traces through (paged_jax, pallas_kernels,
cpu_kernels: .py, and the native kernels' .cc/.h), the versions of Python, jax, jaxlib,
flax and numpy, the backend (platform, platform version, device kinds and count, process
count) and this CPU's model and feature flags (XLA compiles for the host's instruction set),
every JAX config value that is not about caching or logging, the environment variables that
steer XLA or the kernel build, the runner's static settings (`runner_settings`: its configs,
model class, platform, weight layout, head variant), and per program its name, its input
pytree structure and every input's shape, dtype, weak type and sharding. A model class or
platform defined outside those packages (a notebook's, a test's) would escape the source
hash, so such a runner uses no executable cache. What remains unseen is code patched at
runtime (monkeypatching a traced function): JAX's persistent cache, keyed by the lowered
program, sees it; this cache does not. On load, the entry's full key text is
compared with the wanted one (no hash collision is served), its argument shapes and dtypes
with the call's, and any failure (a missing FFI target, a truncated or corrupt file, an
unpickling error, another JAX's format) logs one line and compiles as if there were no
entry; an entry that is not this program's is deleted.

Only programs XLA compiled just now are stored (`_compile`): on jaxlib 0.10.2's CPU backend
an executable that was itself deserialized, as a hit of JAX's persistent cache is (or one
JAX's in-memory cache returns after such a hit), serializes to bytes that load but fail when
run. So where JAX's cache already holds a program -- after an edit of the sources that left
its HLO unchanged, or a JAX cache filled before this cache existed -- JAX's cache serves it,
traced and lowered as before, and this cache gets it only once it is compiled anew.

On and off with the persistent compilation cache (`executable_cache_dir`: the sibling
directory of JAX's cache directory), so `LLM(compilation_cache=...)` and the server switch
both. Single-process, single-device runners only: a tensor-parallel step's shardings are not
covered by this key's tests yet. Entries are written atomically (a temporary file renamed
into place), so concurrent processes never read half a file; the directory is kept under
`max_bytes` by deleting the least recently used entries (a hit refreshes an entry's time).
Like JAX's own cache, loading runs code from the directory: it must be the user's own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import pickle
import platform as host_platform
import sys
import tempfile
import time
from typing import Any, Callable, Hashable

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = 1  # bumped when an entry's layout changes
DEFAULT_MAX_BYTES = 1 << 30  # per directory; one SmolLM2 engine's programs take a few MB
# packages, beside paged_jax, whose code a step traces; their source is part of every key
SOURCE_PACKAGES = ("paged_jax", "pallas_kernels", "cpu_kernels")
SOURCE_SUFFIXES = (".py", ".cc", ".h")
# JAX config values that change where programs are cached or what is logged, never a program
_IGNORED_CONFIG_PREFIXES = ("jax_compilation_cache", "jax_persistent_cache", "jax_log_compiles",
                            "jax_explain_cache_misses", "jax_logging_level", "jax_debug_log_modules",
                            "jax_raise_persistent_cache_errors")
_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "PAGED_JAX_CPU_MARCH", "CXX")  # steer XLA or the kernel build
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # JAX's events (`_compile`)
_PERSISTENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class BucketPrograms:
    """A jitted function plus, per bucket, a Compiled program to run instead of it.

    `name`: the program's name in cache keys. `bucket_of(*args)` names a call's bucket from
    its arguments' shapes (cheap: it runs every step). A call whose bucket has a program runs
    it (nothing is traced; JAX's Compiled still refuses arguments whose avals differ from
    what it was compiled for); any other call goes to the jitted function, as without a
    cache. Warm-up fills `programs`."""

    def __init__(self, name: str, jitted, bucket_of: Callable[..., Hashable]):
        self.name = name
        self.jitted = jitted
        self.bucket_of = bucket_of
        self.programs: dict[Hashable, Callable] = {}

    def __call__(self, *args):
        program = self.programs.get(self.bucket_of(*args))
        return self.jitted(*args) if program is None else program(*args)

    def lower(self, *args):
        return self.jitted.lower(*args)


class Variants:
    """A function's variants, each its own BucketPrograms: `make_jit(**variant)` jits the
    function with the variant's static values bound (functools.partial), and a call
    `variants(*args, **variant)` runs that variant's program. Why not the jit's
    static_argnames: a jit given in_shardings (tensor parallelism's) takes no keyword
    arguments at all, and each variant is a program of its own anyway (its cache name is
    `name[value, ...]`). `variants`: the static values each variant binds, as dicts."""

    def __init__(self, name: str, make_jit: Callable, bucket_of: Callable[..., Hashable], variants: list[dict]):
        self.by_variant = {_variant_key(v): BucketPrograms(f"{name}[{', '.join(map(repr, v.values()))}]",
                                                           make_jit(**v), bucket_of) for v in variants}

    def __call__(self, *args, **variant):
        return self.by_variant[_variant_key(variant)](*args)

    def variant(self, **variant) -> BucketPrograms:
        return self.by_variant[_variant_key(variant)]

    def lower(self, *args, **variant):
        return self.variant(**variant).lower(*args)


def _variant_key(variant: dict) -> tuple:
    return tuple(sorted(variant.items()))


def prepare(program: BucketPrograms, args: tuple, cache: ExecutableCache | None) -> None:
    """Make `program`'s call with `args` (its bucket) ready without running it: from `cache`
    where it is on (that bucket's calls then run the Compiled program), else lowered and
    compiled into the jit's own caches (a call then finds it there)."""
    if cache is None:
        program.lower(*args).compile()
    else:
        program.programs[program.bucket_of(*args)] = cache.load_or_compile(program.name, program.jitted, args)


def one_bucket(*args) -> tuple:
    """The bucket of a program compiled for one shape only."""
    return ()


def executable_cache_dir() -> str | None:
    """The executable cache's directory: the sibling of JAX's compilation cache directory
    (`<dir>-executables`), or None where that cache is off (no directory, or JAX's
    jax_enable_compilation_cache False)."""
    path = jax.config.jax_compilation_cache_dir
    if not path or not jax.config.jax_enable_compilation_cache:
        return None
    path = os.path.normpath(os.path.abspath(os.path.expanduser(path)))
    return f"{path}-executables"


@functools.cache
def source_digest(root: str | None = None) -> str:
    """sha256 over every source file of SOURCE_PACKAGES under `root` (None: where paged_jax
    was imported from), paths and bytes in sorted order. Computed once per process: a
    running process does not see its own edits either."""
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for directory, _, files in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(files):
                if name.endswith(SOURCE_SUFFIXES):
                    path = os.path.join(directory, name)
                    with open(path, "rb") as f:
                        digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def _cpu_identity() -> str:
    """The host CPU's model and feature flags: XLA's CPU backend compiles for them."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln.strip() for ln in f if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return host_platform.processor() + host_platform.machine()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def environment_key() -> str:
    """Everything outside the runner that a compiled program depends on, as text."""
    devices = jax.devices()
    config = {k: repr(v) for k, v in jax.config.values.items() if not k.startswith(_IGNORED_CONFIG_PREFIXES)}
    parts = {
        "format": FORMAT,
        "source": source_digest(),
        "versions": {"python": sys.version, "jax": jax.__version__, "jaxlib": _version("jaxlib"),
                     "flax": _version("flax"), "numpy": _version("numpy")},
        "backend": {"platform": devices[0].platform, "platform_version": devices[0].client.platform_version,
                    "device_kinds": sorted({d.device_kind for d in devices}), "num_devices": len(devices),
                    "process_count": jax.process_count()},
        "cpu": _cpu_identity(),
        "config": sorted(config.items()),
        "environment": {name: os.environ.get(name) for name in _ENVIRONMENT},
    }
    return repr(parts)


def _in_packages(cls: type) -> bool:
    """True if `cls` is defined in a module of SOURCE_PACKAGES (so the source digest covers it)."""
    return cls.__module__.split(".")[0] in SOURCE_PACKAGES


def runner_settings(runner) -> dict[str, Any] | None:
    """What a runner's programs close over besides their arguments: its configs, classes
    and the variants it compiled. None where the key cannot cover the runner (a class
    defined outside SOURCE_PACKAGES, a mesh, several processes): no executable cache then."""
    classes = {"model": runner.model_class, "platform": type(runner.platform), "linear": type(runner.linear)}
    if runner.mesh is not None or jax.process_count() > 1 or not all(map(_in_packages, classes.values())):
        return None
    settings = {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in classes.items()}
    settings.update(
        model_config=repr(runner.model_config), engine_config=repr(runner.config),
        platform_settings=sorted((k, repr(v)) for k, v in inspect.getmembers(type(runner.platform))
                                 if not k.startswith("_") and not inspect.isroutine(v))
        + sorted((k, repr(v)) for k, v in vars(runner.platform).items()),
        weight_layout=runner.weight_layout, fused_head=runner.fused_head, unroll_layers=runner.unroll_layers,
        structured_outputs=runner.structured_outputs, num_top_logprobs=runner.num_top_logprobs,
        mask_words=runner.mask_words, max_copies=runner.max_copies, num_blocks=runner.num_blocks,
        takes_linear=runner.step_model.takes_linear, rope_tables=runner.rope_tables is not None,
        packed_head=runner.packed_head is not None)
    return settings


def _compile(jitted, args: tuple):
    """(the Compiled program of `jitted` for `args`, whether XLA compiled it just now). Only
    such a program can be stored: on this jaxlib (0.10.2, CPU), serializing an executable that
    was itself deserialized -- as every hit of JAX's persistent cache is -- gives bytes that
    load but fail when run ("Function ... not found"). JAX's events tell: a backend compile
    and no persistent-cache hit. Without a backend compile, JAX's in-memory cache returned an
    executable compiled (or read) earlier in this process -- a jit of a module-level
    function is shared by every runner -- which may have been read. A program not compiled
    now is used but not stored; the next start gets it as without this cache."""
    events = set()

    def on_event(event: str, **kwargs) -> None:
        events.add(event)

    def on_duration(event: str, seconds: float, **kwargs) -> None:
        events.add(event)
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        compiled = jitted.lower(*args).compile()
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)
    return compiled, _BACKEND_COMPILE in events and _PERSISTENT_CACHE_HIT not in events


def _leaf_key(leaf) -> str:
    """A call argument as the compiled program sees it: shape, dtype, weak type, sharding."""
    sharding = getattr(leaf, "sharding", None)
    return repr((tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)),
                 None if sharding is None else repr(sharding)))


@dataclasses.dataclass
class ExecutableCache:
    """The runner's view of one cache directory: `load_or_compile` per program, and counts
    of what a warm-up found (`hits`), compiled (`misses`), failed to read (`errors`) and the
    seconds spent reading entries (`load_seconds`)."""

    directory: str
    context: str  # environment_key() + the runner's settings, as text
    max_bytes: int = DEFAULT_MAX_BYTES
    hits: int = 0
    misses: int = 0
    errors: int = 0
    not_stored: int = 0  # misses XLA did not compile just now (`_compile` says why they are not stored)
    load_seconds: float = 0.0

    @classmethod
    def for_runner(cls, runner, directory: str | None = None, **kwargs) -> ExecutableCache | None:
        """The runner's cache in `directory` (None: `executable_cache_dir()`), or None where
        the cache is off or cannot key this runner (`runner_settings`)."""
        directory = directory or executable_cache_dir()
        settings = runner_settings(runner) if directory else None
        if settings is None:
            return None
        return cls(directory, environment_key() + repr(sorted(settings.items())), **kwargs)

    def key(self, name: str, args: tuple) -> str:
        """The full key text of program `name` called with `args`."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        return "\n".join([self.context, name, str(tree), *map(_leaf_key, leaves)])

    def path(self, key: str) -> str:
        return os.path.join(self.directory, hashlib.sha256(key.encode()).hexdigest() + ".exe")

    def load_or_compile(self, name: str, jitted, args: tuple):
        """The Compiled program of `jitted` for `args`: read from the cache, or (on a miss or
        an unreadable entry) traced, lowered and compiled, then stored."""
        key = self.key(name, args)
        path = self.path(key)
        start = time.perf_counter()
        compiled = self._load(path, key, args) if os.path.exists(path) else None
        self.load_seconds += time.perf_counter() - start
        if compiled is not None:
            self.hits += 1
            return compiled
        self.misses += 1
        compiled, fresh = _compile(jitted, args)
        if fresh:
            self._store(path, key, compiled)
        else:
            self.not_stored += 1
        return compiled

    def _load(self, path: str, key: str, args: tuple):
        """The entry at `path` as a Compiled, or None (with one log line) if it cannot serve.
        An entry that is not this program's (damaged, another key, another format) is
        deleted: a program JAX's persistent cache serves is not stored again (`_compile`), so
        it would otherwise be read and refused at every start. One that is this program's but
        does not load here (e.g. its FFI targets are not registered yet) is kept."""
        stage = "read"
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
                raise ValueError("the entry's key differs from the program's")
            if entry["in_tree"] != jax.tree_util.tree_structure((args, {})):
                raise ValueError("the entry's argument structure differs from the call's")
            stage = "load"
            compiled = serialize_executable.deserialize_and_load(entry["payload"], entry["in_tree"],
                                                                 entry["out_tree"])
            wanted = [(tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(args)]
            found = [(tuple(i.shape), str(i.dtype)) for i in jax.tree_util.tree_leaves(compiled.args_info)]
            if wanted != found:
                stage = "read"
                raise ValueError("the entry's argument shapes differ from the call's")
        except Exception as e:  # anything unusable compiles instead
            self.errors += 1
            message = str(e).splitlines()[0][:200] if str(e) else ""
            log.warning("executable cache: %s unusable, compiling instead (%s: %s)", os.path.basename(path),
                        type(e).__name__, message)
            if stage == "read":
                try:
                    os.unlink(path)
                except OSError:
                    pass
            return None
        os.utime(path)  # recently used: the last to be evicted
        return compiled

    def _store(self, path: str, key: str, compiled) -> None:
        """Write `compiled`'s entry atomically; a program that cannot be serialized, or a
        directory that cannot be written, only costs the next start its compile."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            data = pickle.dumps({"format": FORMAT, "key": key, "payload": payload, "in_tree": in_tree,
                                 "out_tree": out_tree}, protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(self.directory, exist_ok=True)
            fd, partial = tempfile.mkstemp(suffix=".partial", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(partial, path)
            except BaseException:
                os.unlink(partial)
                raise
        except Exception as e:
            log.warning("executable cache: not storing %s (%s: %s)", os.path.basename(path), type(e).__name__, e)
            return
        self._evict(keep=path)

    def _evict(self, keep: str) -> None:
        """Delete the least recently used entries, but never `keep` (the one just written),
        until the directory holds at most max_bytes."""
        entries = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".exe") and entry.path != keep:
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another process evicted it
                    continue
                entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries) + os.path.getsize(keep)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
