"""Every command in README.md and docs/*.md runs, or at least names what exists.

Why: docs drift from the code they describe, and a newcomer's first failed command costs
more trust than any missing paragraph. Four checks:

  * the fenced ```bash and ```python blocks run (from the repository root, `python` being
    this interpreter), except those behind a marker on the line before the block:
    `<!-- slow: why -->` runs it only with `-m slow`, `<!-- not-run: why -->` never (it
    serves forever, needs a GPU or another venv, or takes hours). The list of blocks not run
    is those markers: `grep -rn "not-run:" README.md docs/`;
  * every `python -m X ...` named anywhere in them (code spans, blocks, the generated results
    table) names a module that exists, and every `--flag` it passes is one of that module's
    absl flags (read by executing each entry point up to its `app.run`, in one subprocess);
  * every relative link resolves to a file inside the repository (and an `#anchor` to a
    heading of that file);
  * the README stays a first screen and a short tour: at most 250 lines, prose lines at most
    120 characters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(slow|not-run):\s*(\S.*?)\s*-->$")
RUNNABLE = ("bash", "python")


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "slow" | "not-run" | None
    reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of one markdown file, with the marker on the line before each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = lines[i - 1].strip() if i else ""
            marker = MARKER.match(before)
            blocks.append(Block(path, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n",
                                marker.group(1) if marker else None, marker.group(2) if marker else None))
            i = end + 1
        else:
            i += 1
    return blocks


ALL_BLOCKS = [b for path in DOCS for b in fenced_blocks(path)]


def _run_params():
    for block in ALL_BLOCKS:
        if block.lang in RUNNABLE and block.marker != "not-run":
            marks = [pytest.mark.slow] if block.marker == "slow" else []
            yield pytest.param(block, id=block.name, marks=marks)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # `python` is this one
    return env


def test_the_docs_have_runnable_blocks_and_every_marker_says_why():
    runnable = [b for b in ALL_BLOCKS if b.lang in RUNNABLE]
    assert len(runnable) >= 10, [b.name for b in ALL_BLOCKS]
    assert any(b.marker is None for b in runnable), "at least some blocks run in the default suite"
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "not-run" in line or "<!-- slow" in line:
                assert MARKER.match(line.strip()), f"{path.name}:{number}: a marker is `<!-- not-run: why -->`"
    marked_lines = {(b.path, b.line - 1) for b in ALL_BLOCKS if b.marker}
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if MARKER.match(line.strip()):
                assert (path, number) in marked_lines, f"{path.name}:{number}: a marker must precede a fence"


@pytest.mark.parametrize("block", list(_run_params()))
def test_block_runs(block: Block):
    if block.lang == "python":
        argv = [sys.executable, "-c", block.code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    run = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=600 if block.marker == "slow" else 240, check=False)
    assert run.returncode == 0, f"{block.name} failed:\n{block.code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    if block.lang == "python" and "print(" in block.code:
        assert run.stdout.strip(), f"{block.name} prints nothing, though its code prints"


# ---------------------------------------------------------------------------------------
# `python -m X --flags` named anywhere in the docs

_STOP = {"&", "&&", ";", "|", "||", "done", ">", "2>&1"}
_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _command_texts(path: pathlib.Path) -> list[str]:
    """Text of every code span and every fenced bash line (continuations joined) of a file."""
    texts = []
    in_fence = False
    for line in re.sub(r"\\\n\s*", " ", path.read_text()).splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            texts.append(line.split("  #")[0].split(" # ")[0])
        else:
            texts += _CODE_SPAN.findall(line)
    return texts


def named_commands() -> list[tuple[str, str, list[str]]]:
    """[(where, module, --flag tokens)] of every `python -m <module> ...` in the docs."""
    found = []
    for path in DOCS:
        for text in _command_texts(path):
            for match in re.finditer(r"python -m ([A-Za-z_][\w.]*)(.*)", text):
                module, rest = match.group(1), match.group(2)
                try:
                    tokens = shlex.split(rest)
                except ValueError:  # an unbalanced quote inside prose: take the plain words
                    tokens = rest.split()
                args = []
                for token in tokens:
                    if token in _STOP or token.startswith("python"):
                        break
                    if token.startswith("--"):
                        args.append(token)
                found.append((path.name, module, args))
    return found


_FLAGS_OF = r'''
import json, runpy, sys
from absl import app, flags

class _Stop(Exception):
    pass

def _stop(*args, **kwargs):
    raise _Stop()

app.define_help_flags()  # --help, --helpfull, ...: what app.run adds to every entry point
app.run = _stop
FLAGS = flags.FLAGS
base = set(FLAGS)
out = {}
for module in sys.argv[1:]:
    for name in list(FLAGS):
        if name not in base:
            delattr(FLAGS, name)
    for name in [m for m in sys.modules if m == "experiments" or m.startswith("experiments.")]:
        del sys.modules[name]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
        out[module] = {"error": "no app.run: not an absl entry point"}
    except _Stop:
        names = set(FLAGS)
        out[module] = {"flags": sorted(names),
                       "booleans": sorted(n for n in names if FLAGS[n].boolean)}
    except BaseException as error:  # reported per module by the test
        out[module] = {"error": f"{type(error).__name__}: {error}"}
print("FLAGS-JSON " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def module_flags():
    modules = sorted({module for _, module, _ in named_commands()})
    run = subprocess.run([sys.executable, "-c", _FLAGS_OF, *modules], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("FLAGS-JSON ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("FLAGS-JSON "):])


def test_named_commands_are_found():
    modules = {module for _, module, _ in named_commands()}
    # a handful that must be seen, so an extraction bug cannot pass by finding nothing
    assert {"experiments.serve_local", "experiments.results_table", "experiments.peer_vllm",
            "experiments.fleet_prefix_routing"} <= modules
    flags_seen = {arg for _, module, args in named_commands() if module == "experiments.fleet_prefix_routing"
                  for arg in args}
    assert any(arg.startswith("--replica_flags=--max_num_seqs=16 ") for arg in flags_seen), flags_seen


def test_every_named_module_exists_with_the_flags_given(module_flags):
    problems = []
    for where, module, args in named_commands():
        info = module_flags[module]
        if "error" in info:
            problems.append(f"{where}: python -m {module}: {info['error']}")
            continue
        for arg in args:
            name = arg[2:].split("=", 1)[0]
            negated = name.startswith("no") and name[2:] in info["booleans"]
            if name not in info["flags"] and not negated:
                problems.append(f"{where}: python -m {module}: no flag --{name}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_bash_scripts_named_exist():
    for path in DOCS:
        for script in re.findall(r"bash ((?:experiments|\.ci)/[\w./-]+)", path.read_text()):
            assert (ROOT / script).is_file(), f"{path.name}: {script}"


# ---------------------------------------------------------------------------------------
# links and the README's size

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve_inside_the_repository():
    checked = 0
    for path in DOCS:
        for target in _LINK.findall(path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            assert resolved.is_relative_to(ROOT), f"{path.name}: {target} leaves the repository"
            assert resolved.exists(), f"{path.name}: {target} does not exist"
            if anchor and resolved.suffix == ".md":
                assert anchor in _anchors(resolved), f"{path.name}: {target}: no heading #{anchor}"
            checked += 1
    assert checked >= 20


def test_the_docs_name_no_file_outside_the_repository():
    for path in DOCS:
        text = path.read_text()
        for absolute in ("/work/", "/home/", "/root/"):
            assert absolute not in text, f"{path.name} names {absolute}"


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    in_fence = False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence:
            assert len(line) <= 120, f"README.md:{number} has {len(line)} characters"
