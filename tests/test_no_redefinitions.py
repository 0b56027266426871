"""No function, method or class is defined twice in one module or class body (what ruff's
F811 reports): the later definition silently replaces the earlier one, so whichever a
reader finds first may be the one that never runs (grammar_matchers.py once had two
`num_matchers` properties). Property setters and deleters reuse their property's name
by design and are not counted."""

import ast
import pathlib

import paged_jax

ROOT = pathlib.Path(paged_jax.__file__).parent


def redefinitions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, redefining line) for each name defined twice in one body."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef)):
            continue
        seen: dict[str, int] = {}
        for item in node.body:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            decorators = [ast.unparse(d) for d in getattr(item, "decorator_list", [])]
            if any(d.endswith((".setter", ".deleter")) or d.endswith("overload") for d in decorators):
                continue
            if item.name in seen:
                found.append((item.name, seen[item.name], item.lineno))
            seen[item.name] = item.lineno
    return found


def test_the_check_finds_a_redefined_property():
    source = ("class A:\n    @property\n    def n(self):\n        return 1\n\n"
              "    @n.setter\n    def n(self, v):\n        pass\n\n"
              "    @property\n    def n(self):\n        return 2\n")
    assert redefinitions(source) == [("n", 3, 11)]  # the setter (line 7) is not one


def test_nothing_in_paged_jax_is_defined_twice():
    found = {str(path.relative_to(ROOT)): dups for path in sorted(ROOT.rglob("*.py"))
             if (dups := redefinitions(path.read_text()))}
    assert not found, found
