"""Reading checkpoint files without running code from them (layer ``checkpoint``).

A ``torch.save`` file is a pickle, and a pickle can call any importable function while it loads
(``os.system`` included). PyTorch's weights-only unpickler (the default of ``torch.load`` since 2.6) admits
tensors, plain containers and primitives, plus the globals one allowlists. DeepSpeed 0.19.8 reads checkpoints with
``weights_only=False``. Every file ds_muon reads goes through :func:`safe_load`, and every file of a checkpoint that a
ds_muon engine loads is checked first (:func:`file_code_problems`, collectively in
:func:`ds_muon.checkpoint.files.check_tag`), so the files DeepSpeed's own loaders read on a ds_muon engine (a
weights-only universal load) are checked ones. Configs handed to DeepSpeed's built-in (and ``DS_MUON=0``) load as
DeepSpeed does:

1. the file's pickle is disassembled without executing it (``torch.serialization.get_unsafe_globals_in_checkpoint``)
   and each global it names must be torch's weights-only default set or one of :data:`ALLOWED_GLOBALS` (what
   DeepSpeed's and ds_muon's own checkpoints hold besides tensors and containers, found by saving checkpoints
   of every mode); a pickle that cannot be disassembled is refused too;
2. ds_muon's own reads then load with ``weights_only=True`` and exactly those globals allowed.

A refused file raises :class:`~ds_muon.errors.CheckpointError` naming the file and the globals. For files you
trust (written by yourself), :data:`TRUST_ENV` ``=1`` turns both steps off (``torch.load(weights_only=False)``,
as DeepSpeed does); ``python -m ds_muon.checkpoint to-universal --trust-checkpoint`` sets it for one conversion.
"""
from __future__ import annotations

import glob
import importlib
import os
import pickle
from typing import Any, Iterable, Optional

import torch

from ..errors import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "TRUST_ENV", "trusted", "unsafe_globals", "check_file", "check_files",
           "file_code_problems", "safe_load"]

#: Environment variable: ``1``/``true``/``yes``/``on`` loads checkpoint files with ``weights_only=False`` (trusted
#: files only: a crafted file then runs its code).
TRUST_ENV = "DS_MUON_TRUST_CHECKPOINT"

#: Globals besides torch's weights-only defaults that DeepSpeed 0.19.8's and ds_muon's checkpoint files hold
#: (qualified names; imported only when a file names them). Found by saving ZeRO-1/2/3 checkpoints of every mode
#: (fp32, bf16, fp16 with its loss scaler, CPU and NVMe offload, Adam-mini, lr schedulers, universal conversions):
#: ``scripts/checkpoint_globals.py`` lists what a set of checkpoints holds.
ALLOWED_GLOBALS: tuple[str, ...] = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def trusted() -> bool:
    """Whether :data:`TRUST_ENV` says to load checkpoint files with ``weights_only=False``."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def unsafe_globals(path: str) -> list[str]:
    """The globals that ``path``'s pickle names and that neither torch's weights-only defaults nor
    :data:`ALLOWED_GLOBALS` admit, read without executing the pickle.

    Raises:
        CheckpointError: the file is truncated, damaged or not a ``torch.save`` zip archive (load another tag), or
            its pickle uses opcodes that cannot be read without executing it.
    """
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path} cannot be checked for code before loading ({err}): its pickle uses opcodes "
                              f"that torch.save does not write; ds_muon loads only files it can check. "
                              f"{_opt_out()}") from err
    except (OSError, ValueError, EOFError, RuntimeError) as err:  # not a (whole) torch.save zip archive
        size = os.path.getsize(path) if os.path.exists(path) else 0
        raise CheckpointError(f"{path} is truncated or damaged, or not a torch.save file ({size} bytes; "
                              f"{type(err).__name__}: {err}); load another tag") from err
    return sorted(n for n in names if n not in ALLOWED_GLOBALS)


def check_file(path: str) -> list[str]:
    """Check ``path`` (:func:`unsafe_globals`) and return the allowed non-default globals it names.

    Raises:
        CheckpointError: it names a global outside the allowlist (the file and the globals named), or cannot be
            checked.
    """
    bad = unsafe_globals(path)
    if bad:
        raise CheckpointError(f"{path} holds {', '.join(bad)}, which loading would import and call: a checkpoint of "
                              f"DeepSpeed and ds_muon holds tensors, containers and numbers only, so ds_muon does not "
                              f"load it (it may be crafted to run code). {_opt_out()}")
    return [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path) if n in ALLOWED_GLOBALS]


def file_code_problems(paths: Iterable[str], rank: int = 0, world_size: int = 1) -> list[str]:
    """One line per ``*.pt``/``*.pth`` file among ``paths`` (files, or folders searched recursively) that fails
    :func:`check_file`; with ``rank``/``world_size``, only every ``world_size``-th file from ``rank`` (so the ranks
    of a group split the reads and gather the lines). Empty when :func:`trusted`."""
    if trusted():
        return []
    files = [f for path in paths for f in ([path] if os.path.isfile(path) else sorted(
        f for pattern in ("*.pt", "*.pth") for f in glob.glob(os.path.join(path, "**", pattern), recursive=True)))]
    problems = []
    for f in files[rank::world_size]:
        try:
            check_file(f)
        except CheckpointError as err:
            problems.append(str(err))
    return problems


def check_files(paths: Iterable[str]) -> None:
    """:func:`check_file` on every ``*.pt``/``*.pth`` file among ``paths`` (files, or folders searched
    recursively); nothing when :func:`trusted`.

    Raises:
        CheckpointError: the first file that fails the check.
    """
    if trusted():
        return
    for path in paths:
        files = [path] if os.path.isfile(path) else sorted(
            f for pattern in ("*.pt", "*.pth") for f in glob.glob(os.path.join(path, "**", pattern), recursive=True))
        for f in files:
            check_file(f)


def safe_load(path: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path)`` that never runs code from the file: checked by :func:`check_file`, then loaded with
    ``weights_only=True`` and only the allowed globals it names (``weights_only=False`` when :func:`trusted`).

    Args:
        path: a ``torch.save`` file.
        map_location: as for ``torch.load`` (default: the CPU).
        mmap: memory-map the tensors' storage (no copy into memory until read).

    Raises:
        CheckpointError: the file names a global outside the allowlist, or cannot be checked or read weights-only.
    """
    if trusted():
        return torch.load(path, map_location=map_location, mmap=mmap, weights_only=False)
    allowed = [_resolve(name) for name in check_file(path)]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path} cannot be loaded weights-only: {err}. {_opt_out()}") from err


def _resolve(name: str) -> Optional[object]:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _opt_out() -> str:
    return (f"If you trust this checkpoint (you wrote it), set {TRUST_ENV}=1 to load it as DeepSpeed does "
            "(torch.load with weights_only=False); docs/checkpointing.md, \"Security\"")
