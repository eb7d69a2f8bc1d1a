"""Zero-code activation: ``"type": "Muon"`` in any DeepSpeed config uses ds_muon once it is installed.

The installed package ships ``ds_muon_autoload.pth`` into site-packages (``setup.py`` puts it
there for both ``pip install .`` and ``pip install -e .``). Python runs its one line at start-up,
in every process (so in every rank the ``deepspeed`` launcher, ``torchrun`` or ``accelerate
launch`` starts), and that line calls :func:`install`. It costs one environment lookup and one
entry on ``sys.meta_path``: neither ``torch`` nor ``deepspeed`` is imported here.

When the process later imports ``deepspeed`` (the top-level package, whoever imports it), the
finder lets the normal import run to completion and then calls
:func:`ds_muon.integration.auto_enable`, which is :func:`ds_muon.enable` plus a one-line notice
on rank 0 the first time a Muon config is built. Non-Muon configs are untouched either way.

``DS_MUON=0`` (also ``false``/``off``/``no``) in the environment turns this off: DeepSpeed's
built-in ``"Muon"`` runs as if ds_muon were not installed. Explicit ``ds_muon.enable()`` and
``ds_muon.initialize`` keep working under ``DS_MUON=0``; the variable only governs the automatic
path. See docs/migration.md ("Zero-code activation") for the trade-offs.
"""
from __future__ import annotations

import os
import sys

ENV = "DS_MUON"
_OFF = {"0", "false", "off", "no"}


def auto_enabled_by_env() -> bool:
    """Whether ``DS_MUON`` allows automatic activation (unset, or anything but 0/false/off/no)."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


class _AfterLoad:  # a Loader by duck type (importlib.abc costs milliseconds at start-up)
    """Wraps a module's own loader: runs it unchanged, then removes its finder and runs the finder's callback."""

    def __init__(self, loader, finder: "_AfterImport") -> None:
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)  # an error here leaves the finder in place for the next attempt
        # the module is imported now: the finder has done its job (it stays until here because
        # importlib.util.find_spec("deepspeed"), as Accelerate's is_deepspeed_available() calls it,
        # asks finders without importing). A new list, not an edit in place: another thread's import
        # may be iterating over the old one.
        sys.meta_path = [f for f in sys.meta_path if f is not self._finder]
        for callback in self._finder.callbacks:
            callback()

    def __getattr__(self, name: str):  # get_resource_reader, is_package, get_code, ... of the real loader
        return getattr(self._loader, name)


class _AfterImport:  # a MetaPathFinder by duck type
    """Meta-path finder for one module (``fullname``): lets the normal import run, then calls each of
    ``callbacks`` (no arguments) in the order they were added.

    It finds nothing itself: it asks the other finders for the spec and wraps the loader, so the module
    is the one the import would have loaded anyway. Removed from ``sys.meta_path`` once the module is
    imported (not when its import fails: a later attempt is hooked again)."""

    def __init__(self, fullname: str) -> None:
        self.fullname, self.callbacks = fullname, []

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module") and not isinstance(loader, _AfterLoad):
            spec.loader = _AfterLoad(loader, self)
        return spec


def after_import(fullname: str, callback) -> None:  # callback: () -> None (no typing import at start-up)
    """Call ``callback()`` right after the module ``fullname`` is first imported (at once if it already is).

    Several callbacks may wait for one module; the same callback object is added once. Callbacks must not
    raise: they run inside the ``import`` statement of whoever imports the module. Call it from one thread
    at a time (start-up code: the ``.pth`` hook, :func:`ds_muon.enable`).
    """
    if fullname in sys.modules:
        callback()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.fullname == fullname), None)
    if finder is None:
        finder = _AfterImport(fullname)
        sys.meta_path = [finder, *sys.meta_path]
    if not any(c is callback for c in finder.callbacks):
        finder.callbacks.append(callback)


def _activate() -> None:
    """The callback for ``deepspeed``: :func:`ds_muon.integration.auto_enable`, never breaking the import."""
    if not auto_enabled_by_env():  # DS_MUON=0 set after start-up (e.g. by a test suite's conftest)
        return
    try:
        from .integration import auto_enable
        auto_enable()
    except Exception as err:  # never break `import deepspeed`; say loudly that ds_muon is off
        import warnings
        warnings.warn(f"ds_muon: automatic activation failed ({type(err).__name__}: {err}); DeepSpeed's "
                      "built-in Muon will be used. Call ds_muon.enable() to see the full error, or set "
                      f"{ENV}=0 to silence this.", RuntimeWarning, stacklevel=2)


def install() -> None:
    """Arrange for ds_muon to activate when ``deepspeed`` is imported (no-op under ``DS_MUON=0``).

    If ``deepspeed`` is already imported, activates at once. Called by ``ds_muon_autoload.pth``.
    """
    if not auto_enabled_by_env():
        return
    if "deepspeed" in sys.modules:
        from .integration import auto_enable
        auto_enable()
    else:
        after_import("deepspeed", _activate)
