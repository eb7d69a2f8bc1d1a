"""integration/hooks.py: one object owns DeepSpeed's patches, and importing the module runs nothing.

The patches themselves (what ``enable()`` changes in DeepSpeed, the hand-over) are tested end to end in
tests/dist/test_handover.py, test_dropin.py and tests/e2e/test_autoload.py; here ``_Patches`` runs on a
stand-in owner, so DeepSpeed is never changed.
"""
from __future__ import annotations

import ast
import types

from tests.support.tools import REPO

HOOKS = REPO / "ds_muon" / "integration" / "hooks.py"


def test_importing_hooks_runs_no_statement_of_its_own() -> None:
    """Module level holds imports, definitions and assignments only: no ``if``, loop, ``with``, ``try`` or bare
    call (the activation of the start-up hook is ds_muon._autoload's, not this import's)."""
    tree = ast.parse(HOOKS.read_text(encoding="utf-8"))
    allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
    stray = [f"hooks.py:{node.lineno}: {type(node).__name__}" for node in tree.body[1:]  # [0]: the docstring
             if not isinstance(node, allowed)]
    assert not stray, stray


def _patches():
    from ds_muon.integration.hooks import _Patches

    def original():
        return "original"

    def replacement():
        return "replaced"
    owner = types.SimpleNamespace(fn=original, registry=["x"])
    registries = types.SimpleNamespace(listed=["x"])
    return _Patches(replaced=((owner, "fn", replacement),), listed=((registries, "listed", ("a", "x")),)), owner, \
        registries, original


def test_patches_nest_and_the_last_disable_restores_everything() -> None:
    patches, owner, registries, original = _patches()
    patches.enable()
    patches.enable()
    assert owner.fn() == "replaced" and registries.listed == ["x", "a"] and patches.original("fn") is original
    patches.disable()
    assert owner.fn() == "replaced" and patches.depth == 1
    patches.disable()
    assert owner.fn is original and registries.listed == ["x"] and patches.depth == 0
    patches.disable()  # one too many: nothing
    assert owner.fn is original and patches.depth == 0


def test_auto_level_hands_over_only_alone_and_the_notice_is_taken_once() -> None:
    patches, *_ = _patches()
    assert patches.hold_auto() and not patches.hold_auto()  # the start-up hook's level, held once
    patches.enable()
    assert patches.may_hand_over()
    patches.enable()  # the script enabled ds_muon too
    assert not patches.may_hand_over() and not patches.take_auto_notice()
    patches.disable()
    assert patches.take_auto_notice() and not patches.take_auto_notice()
    patches.disable()  # the last level goes: the start-up hook's level with it
    assert not patches.auto and not patches.may_hand_over() and patches.hold_auto()
