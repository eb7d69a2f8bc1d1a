"""Post-import hooks: run a function right after a named module is first imported, without importing it.

Used by the zero-code start-up hook (:mod:`ds_muon._autoload`: ds_muon activates when ``deepspeed`` is
imported) and by :func:`ds_muon.enable` (``attn_implementation="ds_muon_sdpa"`` is registered when
``transformers.modeling_utils`` is imported). It imports nothing but ``sys``: it runs at interpreter start-up.
"""
from __future__ import annotations

import sys


class _AfterLoad:  # a Loader by duck type (importlib.abc costs milliseconds at start-up)
    """Wraps a module's own loader: runs it unchanged, then removes its finder and runs the finder's callbacks."""

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
