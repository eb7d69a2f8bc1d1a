"""Checkpoints of ds_muon engines: the file format only (layer ``checkpoint``).

Same data-parallel world size
    ``engine.save_checkpoint`` / ``engine.load_checkpoint`` as with any ZeRO optimizer; every rank's optimizer
    file also holds ds_muon's metadata (:mod:`ds_muon.checkpoint.metadata`), which is checked before anything
    is restored.
Another data-parallel world size
    ``python -m ds_muon.checkpoint to-universal CKPT_DIR OUT_DIR`` (:mod:`ds_muon.checkpoint.universal`), then
    ``"checkpoint": {"load_universal": true}``.
Files
    tags, ``latest``, integrity (CRC-32 of every member), completeness: :mod:`ds_muon.checkpoint.files`.

Errors are :class:`ds_muon.errors.CheckpointError`, raised on every rank together, so none waits in a collective
for a rank that failed. This package reads and writes files and never touches an optimizer: the DeepSpeed
glue (:mod:`ds_muon.integration.zero3_checkpoint`, :mod:`ds_muon.integration.checkpoint_hooks`) hands it
plain data (a :class:`~ds_muon.checkpoint.metadata.ZeroLayout`, state dicts, slicing callbacks).
docs/checkpointing.md has the user's view.
"""
from __future__ import annotations

from ..errors import CheckpointError
from .cli import main
from .files import LATEST, LATEST_UNIVERSAL, saved_model_states, saved_world_size, verify_checkpoint_files
from .metadata import CONVERT_COMMAND, DS_MUON_KEY
from .universal import carry_side_files, convert_to_universal

__all__ = ["CheckpointError", "CONVERT_COMMAND", "DS_MUON_KEY", "LATEST", "LATEST_UNIVERSAL", "saved_model_states",
           "saved_world_size", "verify_checkpoint_files", "convert_to_universal", "carry_side_files", "main"]
