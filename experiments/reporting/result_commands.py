"""The command that reproduces a results record, checked against the record's flags.

Why: every record carries the `command` that wrote it (results_io.write_result), but a
record can outlive its command line: a script renamed or run through another entry point
writes the wrong module, and flags left at their default are missing from the line, so
a later change of a default silently changes what the command runs. The
results table (docs/results.md) prints a command beside each figure, so it must be one that reproduces
the record. Here the record's `flags` (every flag value of the run) are compared with
the command line and with the script's current defaults, read statically from the
script's `flags.DEFINE_*` calls (no import: the scripts define clashing flag names and
pull in JAX); where they disagree, the command is rebuilt from the record's flags.

No jax, no absl flag parsing: only `ast` over experiments/*.py and
paged_jax/config/engine_config.py.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import re
import shlex

EXPERIMENTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_CONFIG_PATH = os.path.join(os.path.dirname(EXPERIMENTS_DIR), "paged_jax", "config", "engine_config.py")

UNKNOWN = object()  # a default that is not a constant expression (e.g. list(ALLOCATORS))
_MODULE_RE = re.compile(r"-m\s+experiments\.(\w+)")


@dataclasses.dataclass(frozen=True)
class Command:
    text: str  # the command to print
    module: str | None  # experiments.<module> that wrote the record (None: not found)
    rebuilt: bool  # True where the record's own `command` would not reproduce it
    reason: str = ""  # why it was rebuilt, or why it cannot reproduce the record


def _const(node):
    """Value of a constant expression (numbers, strings, lists, + - * ** //), else UNKNOWN."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_const(n) for n in node.elts]
        return UNKNOWN if any(i is UNKNOWN for i in items) else list(items)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _const(node.operand)
        return UNKNOWN if value is UNKNOWN else -value
    if isinstance(node, ast.BinOp):
        left, right = _const(node.left), _const(node.right)
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Pow: lambda a, b: a ** b, ast.FloorDiv: lambda a, b: a // b}
        if left is not UNKNOWN and right is not UNKNOWN and type(node.op) in ops:
            return ops[type(node.op)](left, right)
    return UNKNOWN


def engine_config_defaults(skip=()) -> dict:
    """EngineConfig field defaults (paged_jax/entrypoints/engine_flags.py makes each field a flag)."""
    with open(ENGINE_CONFIG_PATH) as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "EngineConfig":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    value = _const(item.value)
                    defaults[item.target.id] = [str(v) for v in value] if isinstance(value, list) else value
    return {k: v for k, v in defaults.items() if k not in skip}


def flag_defaults(module: str) -> dict:
    """{flag name: current default} of experiments/<module>.py ({} if there is no such file)."""
    path = os.path.join(EXPERIMENTS_DIR, f"{module}.py")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if func.startswith("DEFINE_") and node.args and isinstance(node.args[0], ast.Constant):
            kwargs = {k.arg: k.value for k in node.keywords}
            default = node.args[1] if len(node.args) > 1 else kwargs.get("default")
            defaults[node.args[0].value] = UNKNOWN if default is None else _const(default)
        elif func == "define_engine_flags":
            skip = {k.arg: _const(k.value) for k in node.keywords}.get("skip", [])
            defaults.update(engine_config_defaults(skip if isinstance(skip, list) else []))
    return defaults


def _norm(value):
    """Flag values as the command line spells them: lists comma-joined, numbers as text."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    try:
        return float(_norm(a)) == float(_norm(b))
    except ValueError:
        return _norm(a) == _norm(b)


def parse_args(command: str) -> dict:
    """`--name=value`, `--name value`, `--name`, `--noname` after `-m experiments.X`; a
    flag given more than once (absl's multi-string flags) maps to the list of its values."""
    tokens = shlex.split(command)
    start = next((i + 2 for i, t in enumerate(tokens) if t == "-m"), len(tokens))
    args, i = {}, start
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value, i = tokens[i + 1], i + 1
            elif not eq:
                value = "true"
            if name in args:
                previous = args[name]
                args[name] = [*previous, value] if isinstance(previous, list) else [previous, value]
            else:
                args[name] = value
        i += 1
    return args


def _writer_module(record: dict) -> str | None:
    """The experiments module that wrote the record: the command's, if that script exists;
    else the one script that calls write_result and names the record."""
    match = _MODULE_RE.search(record.get("command") or "")
    if match and os.path.exists(os.path.join(EXPERIMENTS_DIR, f"{match.group(1)}.py")):
        return match.group(1)
    for path in sorted(glob.glob(os.path.join(EXPERIMENTS_DIR, "*.py"))):
        with open(path) as f:
            source = f.read()
        if "write_result(" in source and f'"{record.get("name")}"' in source:
            return os.path.basename(path)[:-3]
    return match.group(1) if match else None


def _spell(name: str, value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no{name}"
    return shlex.quote(f"--{name}={_norm(value)}")


def reproducing_command(record: dict) -> Command:
    """The record's command if it reproduces the record, else one built from its flags."""
    original = record.get("command") or ""
    module = _writer_module(record)
    if module is None:
        return Command(original, None, False, "no experiments script found for this record")
    args = parse_args(original) if _MODULE_RE.search(original) else {}
    defaults = flag_defaults(module)
    missing = []
    for name, value in (record.get("flags") or {}).items():
        if name in args:
            ok = _same(args[name], value)
        elif f"no{name}" in args:
            ok = value is False
        else:
            default = defaults.get(name, UNKNOWN)
            ok = default is UNKNOWN or (default is None and value is None) or (
                default is not None and value is not None and _same(default, value))
        if not ok:
            missing.append(name)
    match = _MODULE_RE.search(original)
    wrong_module = not match or match.group(1) != module
    if not missing and not wrong_module:
        return Command(original, module, False)
    python = shlex.split(original)[0] if original else "python"
    parts = [python, "-m", f"experiments.{module}"]
    flags = record.get("flags") or {}
    for name, value in args.items():
        if name not in flags and name.removeprefix("no") not in flags:
            parts.append(shlex.quote(f"--{name}={value}") if value != "true" else f"--{name}")
    for name in flags:
        if name in missing or name in args or f"no{name}" in args:
            spelled = _spell(name, flags[name])
            if spelled:
                parts.append(spelled)
    reason = (f"command names experiments.{match.group(1) if match else '?'}, the record comes from "
              f"experiments.{module}" if wrong_module else "")
    if missing:
        reason += ("; " if reason else "") + "flags not on the command line and not at today's default: " + \
            ", ".join(missing)
    if not os.path.exists(os.path.join(EXPERIMENTS_DIR, f"{module}.py")):
        reason += ("; " if reason else "") + f"experiments/{module}.py does not exist"
    return Command(" ".join(parts), module, True, reason)
