"""The module map of design.md §9 as a check: data flows one way, and no two ds_muon modules import
each other (an import circle hides which layer depends on which, and forces function-local imports)."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ds_muon"


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(ds_muon modules imported at module level, ds_muon modules imported inside a function)."""
    tree = ast.parse(path.read_text())
    top, local = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            in_function = any(isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef))
                              and node in ast.walk(parent) for parent in ast.walk(tree))
            (local if in_function else top).update(n.split(".")[0] for n in names)
    return top, local


def test_no_import_cycles_between_ds_muon_modules():
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}
    edges = {m: top | local for m, (top, local) in graph.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(m for m in edges if m != "__init__" and reaches(m, m, {m}))
    assert not cycles, f"ds_muon modules in an import cycle: {cycles}"
    # the DeepSpeed glue uses the checkpoint logic; the checkpoint logic never imports the glue
    assert "checkpoint" in graph["zero3"][0]
    assert "zero3" not in edges["checkpoint"]
