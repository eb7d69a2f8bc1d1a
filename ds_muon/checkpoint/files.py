"""A checkpoint's files: tags, the ``latest`` pointers, integrity, and the checks before a load (layer ``checkpoint``).

Everything here reads files only (and, for the checks every rank makes together, all-gathers what each
rank found), so it runs before DeepSpeed restores anything and fails on every rank at once.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .metadata import CONVERT_COMMAND, raise_on_every_rank
from .safe_load import file_code_problems, safe_load

__all__ = ["LATEST", "LATEST_UNIVERSAL", "UNIVERSAL_STATE_FILE", "read_tag", "saved_model_states", "saved_world_size",
           "file_problem", "verify_checkpoint_files", "optim_files", "convert_hint", "check_tag"]

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
UNIVERSAL_STATE_FILE = os.path.join("zero", "optimizer_state.pt")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def read_tag(load_dir: str, latest_name: str) -> Optional[str]:
    """The tag a ``latest``/``latest_universal`` file in ``load_dir`` names, or None without one."""
    path = os.path.join(load_dir, latest_name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def saved_model_states(ckpt_dir: str) -> Optional[dict]:
    """The first ``*_model_states.pt`` of a DeepSpeed checkpoint tag dir (memory-mapped, on the CPU), or None.

    It holds DeepSpeed's engine fields (``dp_world_size``, ``global_steps``, ...) and the ``client_state``
    keys that ``save_checkpoint`` was given, at the top level. Under ZeRO-3 its ``module`` holds no weights."""
    files = sorted(f for f in glob.glob(os.path.join(ckpt_dir, "*_model_states.pt"))
                   if not os.path.basename(f).startswith("layer_"))
    if not files:
        return None
    return safe_load(files[0], mmap=True)


def saved_world_size(ckpt_dir: str) -> Optional[int]:
    """``dp_world_size`` from a ``*_model_states.pt`` of a DeepSpeed checkpoint tag dir, or None."""
    states = saved_model_states(ckpt_dir)
    return None if states is None else states.get("dp_world_size")


def file_problem(path: str) -> Optional[str]:
    """A line naming ``path`` if it is not an intact ``torch.save`` file (a zip archive): truncated, or a
    member whose CRC-32 does not match its data (a flipped bit, which ``torch.load`` reads silently)."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member and checks the CRC-32 torch.save wrote
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        return (f"{path} is truncated or damaged ({size} bytes; {err}): the save did not finish or the file was "
                "damaged after it; load another tag")
    if bad is not None:
        return (f"{path}: its member '{bad}' fails the CRC-32 check (the file changed after it was written, e.g. a "
                "flipped bit); load another tag")
    return None


def verify_checkpoint_files(ckpt_dir: str, group=None) -> None:
    """Check a checkpoint tag's files before anything is loaded: every ``*.pt`` file is an intact zip
    (truncation and flipped bits found by the CRC-32 each member carries), and a ZeRO checkpoint has its
    model-states file and one ``*_optim_states.pt`` per saved data-parallel rank. Each rank reads every
    W-th file (one extra read of the tag in all), and all ranks raise the same error. Collective over
    ``group`` (None: the world).

    Raises:
        CheckpointError: on every rank, naming each missing, short or damaged file.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    problems: list[str] = []
    if not os.path.isdir(ckpt_dir):
        problems.append(f"{ckpt_dir} does not exist")
    else:
        files = sorted(glob.glob(os.path.join(ckpt_dir, "**", "*.pt"), recursive=True))
        problems += [line for line in map(file_problem, files[rank::world]) if line]
        universal = os.path.isfile(os.path.join(ckpt_dir, UNIVERSAL_STATE_FILE))
        model_files = [f for f in glob.glob(os.path.join(ckpt_dir, "*_model_states.pt"))
                       if not os.path.basename(f).startswith("layer_")]
        if not universal and rank == 0:
            if not model_files:
                problems.append(f"{ckpt_dir} has no mp_rank_00_model_states.pt: the save did not finish; load "
                                "another tag")
            elif file_problem(sorted(model_files)[0]) is None:
                try:
                    saved = saved_world_size(ckpt_dir) or 0
                except CheckpointError as err:  # raised on every rank below, never on rank 0 alone
                    problems.append(str(err))
                    saved = 0
                have = optim_files(ckpt_dir)
                problems += [f"{ckpt_dir} has no ZeRO optimizer file of data-parallel rank {r} of the {saved} it was "
                             f"saved with ({os.path.join(ckpt_dir, f'zero_pp_rank_{r}_mp_rank_00_optim_states.pt')} is "
                             "missing): the save did not finish; load another tag" for r in range(saved) if r not in have]
    raise_on_every_rank(problems, group, f"ds_muon: checkpoint {ckpt_dir} is incomplete or damaged:")


def check_tag_code(ckpt_dir: str, group=None) -> None:
    """No file of ``ckpt_dir`` may name a global that loading would import and call
    (:func:`ds_muon.checkpoint.safe_load.file_code_problems`; docs/checkpointing.md, "Security"). Collective over
    ``group`` (None: the world): each rank checks every W-th file and all ranks raise the same error.

    Raises:
        CheckpointError: on every rank, naming each file and the globals it names.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    problems = file_code_problems([ckpt_dir], rank, world) if os.path.isdir(ckpt_dir) else []
    raise_on_every_rank(problems, group, f"ds_muon: checkpoint {ckpt_dir} is refused:")


def optim_files(ckpt_dir: str) -> dict[int, str]:
    """``{data-parallel rank: path}`` of a tag's ZeRO optimizer files.

    Raises:
        CheckpointError: a model-parallel file (``mp_rank`` > 0), which ds_muon does not support.
    """
    files: dict[int, str] = {}
    for path in glob.glob(os.path.join(ckpt_dir, "*_optim_states.pt")):
        m = _OPTIM_FILE.match(os.path.basename(path))
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise CheckpointError(f"{path}: model-parallel checkpoints are not supported by ds_muon")
        files[int(m.group(1))] = path
    return files


def convert_hint(load_dir: str, tag: str) -> str:
    """How to convert ``load_dir/tag`` to a universal checkpoint and load that (a message fragment)."""
    return (f"convert it once with `{CONVERT_COMMAND} {load_dir} OUT_DIR --tag {tag}`, then load OUT_DIR with "
            "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config (docs/checkpointing.md)")


def saved_layout(ckpt_dir: str) -> Optional[str]:
    """``"chunked"`` (ZeRO-3: per-rank model-state files) or ``"flat"`` (ZeRO-1/2: one ``mp_rank_00`` model-state
    file) from a tag's files, or None when neither is there."""
    if glob.glob(os.path.join(ckpt_dir, "zero_pp_rank_*_mp_rank_*_model_states.pt")):
        return "chunked"
    if glob.glob(os.path.join(ckpt_dir, "mp_rank_*_model_states.pt")):
        return "flat"
    return None


def check_tag(load_dir: str, tag: Optional[str], universal: bool, world_size: Optional[int],
              zero3: Optional[bool] = None) -> None:
    """The checks a ds_muon engine's ``load_checkpoint`` runs first (from the files alone; collective: every rank
    calls it).

    Args:
        load_dir, tag: as given to ``engine.load_checkpoint`` (``tag`` None: the one in ``latest`` or
            ``latest_universal``).
        universal: the engine's ``checkpoint.load_universal``.
        world_size: the engine's data-parallel world size (what DeepSpeed compares against); None: not checked
            (a ZeRO-1/2 weights-only load, which reads the module file's full weights at any world size).
        zero3: whether the engine is at ZeRO stage 3 (None: not checked); a checkpoint of the other layout
            (stage 1/2 against 3) is refused naming the conversion.

    Raises:
        CheckpointError: a file of the tag is missing, truncated or damaged (:func:`verify_checkpoint_files`);
            the checkpoint was saved at another data-parallel world size (naming
            ``python -m ds_muon.checkpoint to-universal``; weights-only loads too, since ds_muon loads
            the tag's ZeRO partitions);
            ``checkpoint.load_universal`` is set but the checkpoint is not a universal one, or the
            other way round; a file of the tag names a global that loading would import and call
            (:func:`check_tag_code`).
    """
    if tag is None:
        tag = read_tag(load_dir, LATEST_UNIVERSAL if universal else LATEST)
        if tag is None:
            other = read_tag(load_dir, LATEST if universal else LATEST_UNIVERSAL)
            if other is not None and universal:
                raise CheckpointError(f"{load_dir} holds a ZeRO checkpoint ('{LATEST}' names '{other}'), which is "
                                      "not a universal checkpoint, but checkpoint.load_universal is true; "
                                      + convert_hint(load_dir, other))
            if other is not None:
                raise CheckpointError(f"{load_dir} holds a universal checkpoint ('{LATEST_UNIVERSAL}' names "
                                      f"'{other}'); set \"checkpoint\": {{\"load_universal\": true}} in the DeepSpeed "
                                      "config to load it")
            return  # DeepSpeed says there is nothing to load
    ckpt_dir = os.path.join(load_dir, str(tag))
    verify_checkpoint_files(ckpt_dir)
    check_tag_code(ckpt_dir)
    is_universal = os.path.isfile(os.path.join(ckpt_dir, UNIVERSAL_STATE_FILE))
    if universal and not is_universal:
        raise CheckpointError(f"checkpoint.load_universal is true but {ckpt_dir} is not a universal checkpoint (no "
                              f"{UNIVERSAL_STATE_FILE}); " + convert_hint(load_dir, str(tag)))
    if not universal and is_universal:
        raise CheckpointError(f"{ckpt_dir} is a universal checkpoint; set \"checkpoint\": {{\"load_universal\": "
                              "true} in the DeepSpeed config to load it")
    if universal:
        return
    layout = saved_layout(ckpt_dir)
    if zero3 is not None and layout is not None and (layout == "chunked") != zero3:
        saved_stage, this_stage = ("3", "1/2") if layout == "chunked" else ("1/2", "3")
        raise CheckpointError(f"{ckpt_dir} was saved at ZeRO stage {saved_stage}, this run is at ZeRO stage "
                              f"{this_stage}; their partitions differ, so " + convert_hint(load_dir, str(tag)))
    saved = saved_world_size(ckpt_dir)  # weights-only loads too at ZeRO-3: ds_muon loads the tag's ZeRO partitions
    if world_size is not None and saved is not None and saved != world_size:
        raise CheckpointError(f"{ckpt_dir} was saved at data-parallel world size {saved}, this run has {world_size}; "
                              "ZeRO partitions depend on the world size, so " + convert_hint(load_dir, str(tag)))
