"""The package's import graph has no cycle: every ``import`` / ``from ... import`` statement between
modules of ``memopt`` (those inside functions included) is an edge, and a cycle fails with its path.

Function-level imports count on purpose: a lazy import that closes a cycle only moves the failure
from import time to call time, and the layering (config -> engines -> compose -> models/strategies)
is what keeps a new strategy or engine a single module.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "memopt")


def module_names(root: str = ROOT) -> dict[str, str]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(root))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def edges(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the memopt modules it imports (``from a.b import c`` counts a.b.c when that is a module)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    mods = module_names()
    cycle = find_cycle(edges(mods))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walker_sees_a_cycle(tmp_path):
    """The check itself: two modules importing each other (one inside a function) are reported."""
    pkg = tmp_path / "memopt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from memopt import b\n")
    (pkg / "b.py").write_text("def f():\n    from memopt.a import x\n")
    (pkg / "c.py").write_text("import memopt.a\n")
    cycle = find_cycle(edges(module_names(str(pkg))))
    assert cycle is not None and set(cycle) == {"memopt.a", "memopt.b"}


ENTRY_POINTS = {"memopt.train", "memopt.api", "memopt.report.__main__"}
ENTRY_PACKAGES = ("memopt.gpu_check",)  # a command line whose modules import each other, never imported from below


def is_entry(mod: str) -> bool:
    return mod in ENTRY_POINTS or any(mod == p or mod.startswith(p + ".") for p in ENTRY_PACKAGES)


def test_no_module_below_the_entry_points_imports_them():
    """The command lines and the programmatic entry points sit on top: the gate, the planner and the
    engines never reach back up into them (the planner builds typed candidates, not commands)."""
    graph = edges(module_names())
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if not is_entry(m) for t in targets if is_entry(t))
    assert not bad, bad
