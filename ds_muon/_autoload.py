"""Zero-code activation: ``"type": "Muon"`` in any DeepSpeed config uses ds_muon once it is installed.

The installed package ships ``ds_muon_autoload.pth`` into site-packages (``setup.py`` puts it
there for both ``pip install .`` and ``pip install -e .``). Python runs its one line at start-up,
in every process (so in every rank the ``deepspeed`` launcher, ``torchrun`` or ``accelerate
launch`` starts), and that line calls :func:`install`. It costs one environment lookup and one
entry on ``sys.meta_path``: neither ``torch`` nor ``deepspeed`` is imported here. The line swallows any
exception (``try``/``except Exception: pass`` inside an ``exec``), so a broken or half-uninstalled ds_muon (the
``.pth`` left behind, the package gone) never makes Python print a traceback at start-up; ``pip uninstall``
removes the ``.pth`` with the package (it is in the wheel's RECORD).

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

from .import_hooks import after_import

ENV = "DS_MUON"
_OFF = {"0", "false", "off", "no"}
#: Kept for code that reads it; always False: activation never waits. (It did while ``ds_muon.integration.hooks``
#: finished its own import; now ``ds_muon.integration`` imports ``deepspeed`` before that module, so
#: :func:`_activate` runs before it and imports it itself.)
deferred = False


def auto_enabled_by_env() -> bool:
    """Whether ``DS_MUON`` allows automatic activation (unset, or anything but 0/false/off/no)."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def _activate() -> None:
    """The callback for ``deepspeed``: :func:`ds_muon.integration.auto_enable`, never breaking the import.

    It may run inside ``ds_muon.integration``'s own first import (a script that imports ds_muon before deepspeed):
    that package imports ``deepspeed`` before any of its modules, so the hooks module is imported here, whole.
    """
    if not auto_enabled_by_env():  # DS_MUON=0 set after start-up (e.g. by a test suite's conftest)
        return
    try:
        from .integration.hooks import auto_enable
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
        from .integration.hooks import auto_enable
        auto_enable()
    else:
        after_import("deepspeed", _activate)
