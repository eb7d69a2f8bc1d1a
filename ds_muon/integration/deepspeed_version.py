"""The DeepSpeed releases ds_muon runs with, checked before anything of DeepSpeed's is hooked (layer ``integration``).

ds_muon subclasses DeepSpeed's ZeRO optimizers and replaces engine methods, so it relies on names and layouts of
particular DeepSpeed releases (docs/design.md, "Where DeepSpeed is hooked"): :data:`ds_muon.errors.SUPPORTED_DEEPSPEED`,
the range ``pyproject.toml`` declares. Measured with ds_muon 0.1.0 (CPU, gloo, torch 2.13): 0.19.8 passes the suite;
0.19.7 and 0.19.6 build engines but miss the oracle (ZeRO-2 with ``overlap_comm``: the global gradient norm 23% off;
ZeRO-3 with ``zero.Init`` and small sub-groups: an AdamW bias not updated as the oracle's; 0.19.6 also lacks
``DeepSpeedZeroOptimizer.round_robin_bit16_offsets``); 0.19.5 and older lack
``DeepSpeedEngine.get_optimizer_configuration``. Outside the range, importing this layer, :func:`ds_muon.enable`
and :func:`ds_muon.initialize` raise :class:`~ds_muon.errors.DeepSpeedVersionError` naming the range, instead of an
``AttributeError`` deep inside ``deepspeed.initialize`` or a silently different update.
"""
from __future__ import annotations

import operator
import re
from typing import Optional

from ..errors import SUPPORTED_DEEPSPEED, DeepSpeedVersionError

__all__ = ["TESTED_DEEPSPEED", "deepspeed_version_problem", "require_supported_deepspeed"]

#: The releases the test suite ran against (CI: CPU/gloo; the device machine: 2xH200/NCCL).
TESTED_DEEPSPEED = "0.19.8"


_OPS = {">=": operator.ge, "<": operator.lt, ">": operator.gt, "<=": operator.le, "==": operator.eq}


def _release(version: str) -> Optional[tuple[int, ...]]:
    """``"0.19.9+cu128"`` -> ``(0, 19, 9)``: the numeric release at the start of a version (local and pre-release
    suffixes dropped, missing parts 0), or None when it has none."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        return None
    parts = tuple(int(x) for x in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts))


def deepspeed_version_problem(version: str) -> Optional[str]:
    """Why DeepSpeed ``version`` (a ``deepspeed.__version__``) is not one ds_muon runs with, naming the supported
    range and the fix; None when its release is in :data:`ds_muon.errors.SUPPORTED_DEEPSPEED` (comma-separated
    ``>=``/``<``/``>``/``<=``/``==`` clauses; local and pre-release suffixes, e.g. ``0.19.9+cu128`` or
    ``0.19.9.dev0``, count as their release)."""
    release = _release(version)
    clauses = [re.match(r"\s*(>=|<=|==|<|>)\s*(\S+)", c).groups() for c in SUPPORTED_DEEPSPEED.split(",")]
    if release is not None and all(_OPS[op](release, _release(bound)) for op, bound in clauses):
        return None
    return (f"ds_muon supports deepspeed{SUPPORTED_DEEPSPEED} (tested with {TESTED_DEEPSPEED}), but deepspeed "
            f"{version} is installed: install a supported release (pip install 'deepspeed{SUPPORTED_DEEPSPEED}'), "
            "or uninstall ds_muon (or set DS_MUON=0 and do not call ds_muon.initialize/enable) to use DeepSpeed's "
            "built-in Muon")


def require_supported_deepspeed() -> None:
    """Raise :class:`~ds_muon.errors.DeepSpeedVersionError` unless the imported ``deepspeed`` is in
    :data:`ds_muon.errors.SUPPORTED_DEEPSPEED` (read from ``deepspeed.__version__`` at each call)."""
    import deepspeed
    problem = deepspeed_version_problem(str(getattr(deepspeed, "__version__", "(unknown)")))
    if problem is not None:
        raise DeepSpeedVersionError(problem)
