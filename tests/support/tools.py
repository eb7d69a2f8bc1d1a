"""Repository scripts as modules, for tests (no ``sys.path`` edits in the tests themselves).

``examples/``, ``benchmarks/`` and ``scripts/`` are not packages: each file is a command run by path. A test
that needs one of their functions loads it with :func:`repo_module`, which executes the file once under a
module name of its own (``repo.<folder>.<stem>``) with the file's folder importable for its siblings
(``examples/train.py`` imports ``data`` and ``model``) while it executes, as running it from the command
line would.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def repo_module(relpath: str) -> ModuleType:
    """The module of the repository file ``relpath`` (e.g. ``"benchmarks/comm_model.py"``), loaded once.

    Raises:
        FileNotFoundError: no such file.
    """
    path = REPO / relpath
    if not path.is_file():
        raise FileNotFoundError(path)
    name = "repo." + ".".join(path.relative_to(REPO).with_suffix("").parts)
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if added:
            sys.path.remove(folder)
    return module
