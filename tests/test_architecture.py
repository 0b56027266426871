"""The package tree is the architecture: each layer imports only the layers below it.

Layers, bottom to top (paged_jax/<layer>/; pallas_kernels/ sits outside and imports no
paged_jax code at all):

    config < core < attention < model < loading < distributed < platform < worker < baselines < engine
        < entrypoints

So the core (pure-Python bookkeeping) knows neither the device nor the paper's baselines
(they plug in from the entry points, behind the block manager's interface:
tests/test_baselines_plug_in.py), the worker never
reaches into the engine, and nothing below the entry points knows a server exists. What
differs between CPU, GPU and TPU is the platform layer's: the model and attention layers
below it are handed its choices as arguments, and only its CPU modules import the native
CPU kernels (cpu_kernels/), so a GPU or TPU reader never meets AVX-512 code paths.
Imports inside functions count too: a lazy import is still a dependency. The host-side
modules also stay free of jax and numpy, checked in a fresh interpreter.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ["config", "core", "attention", "model", "loading", "distributed", "platform", "worker", "baselines",
          "engine", "entrypoints"]
RANK = {name: i for i, name in enumerate(LAYERS)}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute module names imported anywhere in the file (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "paged_jax" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


def _sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def test_every_paged_jax_module_is_in_a_layer():
    loose = [str(p.relative_to(ROOT)) for p in _sources("paged_jax")
             if p.parent != ROOT / "paged_jax" and _layer(_module_name(p)) is None]
    top = sorted(p.name for p in (ROOT / "paged_jax").glob("*.py"))
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"
    assert top == ["__init__.py"], f"paged_jax/ holds only sub-packages (and its lazy exports), found {top}"


def test_no_layer_imports_a_higher_one():
    upward = []
    for path in _sources("paged_jax"):
        me = _layer(_module_name(path))
        if me is None:  # paged_jax/__init__.py: lazy public names, resolved at attribute access
            continue
        for imported in _imports(path):
            other = _layer(imported)
            if other is not None and RANK[other] > RANK[me]:
                upward.append(f"{path.relative_to(ROOT)} ({me}) imports {imported} ({other})")
    assert not upward, "\n".join(sorted(upward))


def test_pallas_kernels_import_no_engine_code():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _sources("pallas_kernels") for m in _imports(p)
           if m.split(".")[0] in ("paged_jax", "experiments", "configs")]
    assert not bad, bad


@pytest.mark.parametrize("fake, layer", [("paged_jax.engine.llm_engine", "core"), ("paged_jax.baselines", "core"),
                                         ("paged_jax.engine.stats", "worker")])
def test_the_rule_catches_an_upward_import(tmp_path, fake, layer):
    """The checker itself can fail: an upward import written into a layer is reported."""
    path = ROOT / "paged_jax" / layer / "_probe_upward.py"
    path.write_text(f"def f():\n    import {fake}\n")
    try:
        with pytest.raises(AssertionError, match="_probe_upward"):
            test_no_layer_imports_a_higher_one()
    finally:
        path.unlink()


def _cpu_kernel_importers(package: str = "paged_jax") -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in _sources(package)
                  if any(m.split(".")[0] == "cpu_kernels" for m in _imports(p)))


def test_only_the_cpu_platform_imports_the_native_cpu_kernels():
    """Inside the library, cpu_kernels/ is reached only through paged_jax/platform/cpu*.py.
    (Experiments that measure the CPU kernels themselves, and the kernels' own tests, import them.)"""
    outside = [p for p in _cpu_kernel_importers() if not p.startswith("paged_jax/platform/cpu")]
    assert not outside, f"cpu_kernels imported outside the CPU platform: {outside}"
    assert "paged_jax/platform/cpu.py" in _cpu_kernel_importers()  # the check sees the imports it allows


def test_the_cpu_kernel_rule_catches_an_import_elsewhere():
    path = ROOT / "paged_jax" / "model" / "_probe_cpu_kernels.py"
    path.write_text("def f():\n    from cpu_kernels import f32_matmul\n")
    try:
        with pytest.raises(AssertionError, match="_probe_cpu_kernels"):
            test_only_the_cpu_platform_imports_the_native_cpu_kernels()
    finally:
        path.unlink()


def _hidden_switches(path: pathlib.Path) -> list[str]:
    """Ways a module can switch behaviour behind its callers' backs: context variables,
    thread-locals, `global` rebinding, and module-level dicts/lists/sets written from
    inside functions."""
    tree = ast.parse(path.read_text())
    found, module_containers = [], set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Dict, ast.List, ast.Set)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            module_containers.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"global {', '.join(node.names)} (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr in ("ContextVar", "local") and \
                isinstance(node.value, ast.Name) and node.value.id in ("contextvars", "threading"):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id == "ContextVar":
            found.append(f"ContextVar (line {node.lineno})")
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                        target = t.value.id
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.attr in (
                        "append", "update", "add", "pop", "setdefault", "clear", "extend", "remove"):
                target = node.func.value.id
            if target in module_containers:
                found.append(f"module-level {target} written in {func.name} (line {node.lineno})")
    return found


def test_no_module_level_state_switches_behaviour():
    """No kernel or layout is chosen through hidden module state (the platform's choices
    are arguments): no context variables, thread-locals, `global`, or module-level
    containers written at run time anywhere in the library."""
    bad = [f"{p.relative_to(ROOT)}: {what}" for p in _sources("paged_jax") for what in _hidden_switches(p)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("code", [
    "import contextvars\nLAYOUT = contextvars.ContextVar('layout', default='in_out')\n",
    "MODE = 'a'\ndef set_mode(m):\n    global MODE\n    MODE = m\n",
    "KERNELS = {}\ndef register(name, fn):\n    KERNELS[name] = fn\n",
])
def test_the_hidden_state_rule_catches_a_switch(code):
    path = ROOT / "paged_jax" / "model" / "_probe_switch.py"
    path.write_text(code)
    try:
        with pytest.raises(AssertionError, match="_probe_switch"):
            test_no_module_level_state_switches_behaviour()
    finally:
        path.unlink()


def test_host_side_imports_neither_jax_nor_numpy():
    """config/ and core/ (and the contiguous baselines) are pure Python: importing all of
    them in a fresh interpreter loads no jax and no numpy."""
    modules = [_module_name(p) for p in _sources("paged_jax/config") + _sources("paged_jax/core")]
    modules.append("paged_jax.baselines.contiguous_allocator")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "bad = sorted(m for m in ('jax', 'numpy') if m in sys.modules)\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert len(modules) >= 12  # every core module was imported, not an empty list


def test_readme_layout_names_every_package():
    """The README's layout block (the fenced block that starts with `paged_jax/`) lists exactly
    the layers (and nothing that no longer exists)."""
    readme = (ROOT / "README.md").read_text()
    blocks = [block.split("\n", 1)[1] for block in readme.split("```")[1::2] if "\n" in block]
    [block] = [b for b in blocks if b.startswith("paged_jax/\n")]
    listed = [line.split()[0].rstrip("/") for line in block.splitlines() if line.startswith("  ") and
              line.split() and line.split()[0].endswith("/")]
    on_disk = sorted(p.name for p in (ROOT / "paged_jax").iterdir() if (p / "__init__.py").exists())
    assert sorted(listed) == on_disk
    assert listed == [name for name in LAYERS if name in listed], "the README lists the layers bottom to top"
    assert sorted(on_disk) == sorted(LAYERS)
