"""docs/design.md's module map is the list of ds_muon's modules: a module missing from it, or a row naming a module
that does not exist, fails here (issue 37, item 6)."""
from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ds_muon"


def map_modules(text: str) -> list[str]:
    """The module paths (relative to ``ds_muon/``) named in the first cell of the "Module map" table of design.md's
    text: ``| `core/matrix.py`, `core/x.py` | job |`` -> ``["core/matrix.py", "core/x.py"]``."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names += [n.removeprefix("ds_muon/") for n in re.findall(r"`([^`]+\.py)`", first)]
    return names


def package_modules() -> set[str]:
    """Every module of the package, ``__init__.py`` of the sub-packages excepted (their job is the package's)."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts and not (p.name == "__init__.py" and p.parent != PACKAGE)}


def problems(named: list[str], present: set[str]) -> list[str]:
    out = [f"not in docs/design.md's module map: ds_muon/{m}" for m in sorted(present - set(named))]
    out += [f"named in docs/design.md's module map but absent: ds_muon/{m}" for m in sorted(set(named) - present)]
    out += [f"named twice in docs/design.md's module map: {m}" for m in sorted({m for m in named if named.count(m) > 1})]
    return out


def test_module_map_lists_every_module_and_nothing_else():
    named = map_modules((ROOT / "docs" / "design.md").read_text())
    assert named, "the module map table was not found in docs/design.md"
    assert not problems(named, package_modules()), "\n".join(problems(named, package_modules()))


def test_the_check_catches_a_missing_and_a_stale_row():
    text = "## Module map\n\n| module | job |\n|---|---|\n| `core/a.py`, `core/gone.py` | x |\n\n## Next\n| `core/b.py` | y |\n"
    named = map_modules(text)
    assert named == ["core/a.py", "core/gone.py"]
    found = problems(named, {"core/a.py", "core/new.py"})
    assert found == ["not in docs/design.md's module map: ds_muon/core/new.py",
                     "named in docs/design.md's module map but absent: ds_muon/core/gone.py"]
