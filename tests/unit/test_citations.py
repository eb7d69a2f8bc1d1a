"""Every dotted ``ds_muon.`` name the repository cites resolves: a module, then attributes of it.

Cited in docstrings, comments and messages of the package, the tests, scripts, benchmarks and examples, and in
``docs/*.md`` and ``README.md`` (``:func:`ds_muon.model.selection.tag_model```, ``ds_muon.sharded.ownership``,
``ds_muon.sharded.no_grad.GradientFlags.agree``). A name that no longer resolves (a module moved,
a function renamed) fails here with its ``file:line``. Resolution is by ``importlib`` and ``getattr`` only
(a dataclass field or a class-level annotation counts as an attribute of its class).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any, Iterator

from tests.support.tools import REPO

#: A dotted name that starts with the package: ``ds_muon`` and at least one ``.part``; not inside a longer word or
#: a path (``ds_muon_autoload.pth``, ``docs/ds_muon.x``) and never its trailing sentence period.
CITATION = re.compile(r"(?<![\w./-])ds_muon(?:\.[A-Za-z_]\w*)+")
#: Where citations are read: source, tests and scripts (every ``.py``) and the documentation pages.
SOURCES = ("ds_muon/**/*.py", "tests/**/*.py", "scripts/**/*.py", "benchmarks/**/*.py", "examples/**/*.py",
           "docs/*.md", "README.md")


def citations(root: Path = REPO) -> Iterator[tuple[str, int, str]]:
    """``(path relative to root, line number, dotted name)`` of every citation in :data:`SOURCES`."""
    for pattern in SOURCES:
        for path in sorted(root.glob(pattern)):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for match in CITATION.finditer(line):
                    yield str(path.relative_to(root)), number, match.group(0)


def _has_attribute(obj: Any, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if isinstance(obj, type):  # instance attributes a class declares: dataclass fields, annotations
        declared = set(getattr(obj, "__dataclass_fields__", {}))
        for klass in obj.__mro__:
            declared.update(getattr(klass, "__annotations__", {}))
        return name in declared
    return False


@functools.lru_cache(maxsize=None)
def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names something: its longest importable module prefix, then ``getattr`` for the rest.

    A ``__main__`` module is found (``importlib.util.find_spec``), not run. An error other than the module not
    existing propagates (a module that cannot be imported is a failure of its own, not a stale citation).
    """
    parts = dotted.split(".")
    obj: Any = None
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        if parts[end - 1] == "__main__":
            if importlib.util.find_spec(module) is not None:
                return end == len(parts)
            continue
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as err:  # err.name: the first missing module of the chain
            if not (module == err.name or module.startswith(f"{err.name}.")):
                raise
    for k, part in enumerate(parts[end:]):
        if not _has_attribute(obj, part):
            return False
        obj = getattr(obj, part, None)
        if obj is None and k < len(parts[end:]) - 1:  # a declared, unset attribute has no attributes to follow
            return False
    return True


def test_every_cited_ds_muon_name_resolves() -> None:
    found = list(citations())
    assert len(found) > 200, len(found)  # the scan reads the sources at all
    stale = [f"{path}:{line}: {name}" for path, line, name in found if not resolves(name)]
    assert not stale, "dotted ds_muon names that no longer resolve:\n" + "\n".join(stale)


def test_resolver_follows_modules_attributes_and_declared_fields() -> None:
    assert resolves("ds_muon.sharded.no_grad.GradientFlags")
    assert resolves("ds_muon.sharded.ownership.MatrixSlot.owner")  # a dataclass field without a default
    assert resolves("ds_muon.model.selection.tag_model")
    assert resolves("ds_muon.checkpoint.__main__")
    stale = "ds_muon" + ".selection.tag_model"  # split, so this file cites nothing stale itself
    assert not resolves(stale)
    assert not resolves("ds_muon" + ".model.selection.tag_models")
    assert not resolves("ds_muon" + ".sharded.ownership.MatrixSlot.owner.real")


def test_scan_finds_a_stale_citation_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("intro\nsee `ds_muon" + ".attention.register_attention`.\n")
    (tmp_path / "README.md").write_text("ds_muon_autoload.pth, docs/ds_muon.x and ds_muon.core.matrix.\n")
    found = list(citations(tmp_path))
    assert found == [("docs/page.md", 2, "ds_muon" + ".attention.register_attention"),
                     ("README.md", 1, "ds_muon.core.matrix")], found
    assert [resolves(name) for _, _, name in found] == [False, True]


#: A calendar date (``2026-12-01``): the package says which checkpoint format or which recorded measurement
#: (docs/benchmarks.md's section) it means, not when.
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_the_package_names_formats_and_measurements_not_dates() -> None:
    dated = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in sorted(REPO.glob("ds_muon/**/*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if DATE.search(line)]
    assert not dated, "dated comments in the package:\n" + "\n".join(dated)
