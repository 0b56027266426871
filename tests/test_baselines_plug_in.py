"""The serving path carries no experiment hooks: nothing in paged_jax/core/ or
paged_jax/engine/ imports the paper's baselines (paged_jax/baselines/) or the simulator
(experiments/), not even lazily inside a function.

Why: the baselines plug in behind the allocator interface (EngineCore's
`allocator_factory`; the names of `EngineConfig.kv_allocator` become allocators in
paged_jax/entrypoints/allocators.py, above the engine) and their waste through the
allocator's own `kv_waste` (core/kv_waste.py); the simulator drives the engine through
its public pieces. An import from either would make the engine depend on what it is
measured against.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUARDED = ("paged_jax/core", "paged_jax/engine")
FORBIDDEN = ("paged_jax.baselines", "experiments")


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an import statement in the file names (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from paged_jax import baselines`
    return found


def _violations() -> list[str]:
    bad = []
    for folder in GUARDED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in _imported_modules(path):
                if any(module == f or module.startswith(f + ".") for f in FORBIDDEN):
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    return sorted(bad)


def test_core_and_engine_import_neither_baselines_nor_the_simulator():
    assert not _violations(), "\n".join(_violations())


def test_the_guarded_folders_are_walked():
    """Not vacuous: the walk reads the engine core and the scheduler, and sees their imports."""
    engine_core = _imported_modules(ROOT / "paged_jax/engine/engine_core.py")
    assert "paged_jax.core.scheduler" in engine_core
    assert sum(1 for folder in GUARDED for _ in (ROOT / folder).rglob("*.py")) > 20


@pytest.mark.parametrize("folder, statement", [
    ("core", "def f():\n    import paged_jax.baselines.contiguous_allocator\n"),
    ("engine", "from paged_jax.baselines.contiguous_allocator import ContiguousAllocator\n"),
    ("engine", "from paged_jax import baselines\n"),
    ("engine", "def f():\n    from experiments.simulator.fast_forward import FastForward\n"),
    ("core", "from ..baselines import contiguous_allocator\n"),
])
def test_the_rule_catches_an_injected_import(folder, statement):
    path = ROOT / "paged_jax" / folder / "_probe_plug_in.py"
    path.write_text(statement)
    try:
        assert any("_probe_plug_in" in v for v in _violations())
    finally:
        path.unlink()
