"""Checkpoints of ds_muon ZeRO-3 engines: metadata, fit checks, and the universal (any world size) format.

Same data-parallel world size
    ``engine.save_checkpoint`` / ``engine.load_checkpoint`` as with any ZeRO-3 optimizer. Every
    rank's ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` also holds ds_muon's metadata under
    ``"ds_muon"`` (:func:`zero_metadata`: the world size, the Muon step count, and per ZeRO
    sub-group its param group, Muon/AdamW flag and ``(name, shape)`` of every parameter), identical
    on every rank and made of plain Python types. Before DeepSpeed restores anything, ds_muon checks
    that the checkpoint fits (:func:`check_zero_state_dict`) and raises :class:`CheckpointError`
    naming each parameter that does not.

Another data-parallel world size
    A ZeRO-3 partition depends on the world size W (a parameter of ``numel`` elements has
    ``partition_numel = ceil(numel / W)``; rank r holds flattened elements ``[r*partition_numel,
    (r+1)*partition_numel)``, zero-padded past ``numel``), so the per-rank files only load at the W
    they were saved at. ``python -m ds_muon.checkpoint to-universal CKPT_DIR OUT_DIR [--tag TAG]``
    (:func:`convert_to_universal`) writes DeepSpeed's universal-checkpoint layout with full,
    padding-free tensors per parameter. A ds_muon engine at any W loads it with
    ``"checkpoint": {"load_universal": true}`` in its DeepSpeed config and the usual
    ``engine.load_checkpoint(OUT_DIR)``; DeepSpeed's engine then calls the ZeRO-3 optimizer's
    ``_load_universal_checkpoint``, which ds_muon's :class:`~ds_muon.zero3.MuonZeroOptimizer`
    routes to :func:`load_universal_state`.

Why ds_muon's own loader and not DeepSpeed's stage-3 universal loader
(``load_hp_checkpoint_state_from_checkpoint_dir_stage3``, deepspeed 0.19.8): that loader reads the
fixed keys ``fp32``/``exp_avg``/``exp_avg_sq`` for every sub-group (Muon sub-groups have
``momentum_buffer`` instead), takes one ``step`` for all sub-groups, and copies the hyperparameters
of param group 0 into every param group, which would give the AdamW groups Muon's lr and
``use_muon=True``. :func:`load_universal_state` fills each sub-group's fp32 partition and state
from the full tensors with DeepSpeed's own per-parameter slicing (``load_hp_checkpoint_state``) and
refreshes the model's partitions with DeepSpeed's ``_reassign_or_swap_out_partitioned_parameters``.

Universal layout written by :func:`convert_to_universal` (``OUT_DIR/<tag>/``)::

    zero/<param name>/fp32.pt             {"param": fp32 tensor of the parameter's shape}
    zero/<param name>/momentum_buffer.pt  Muon parameters: momentum (its saved dtype: fp32, or bf16), the parameter's shape
    zero/<param name>/exp_avg.pt          AdamW parameters (and exp_avg_sq.pt): fp32, the parameter's shape;
                                          Adam-mini parameters: exp_avg only
    zero/<param name>/block_exp_avg_sq.pt Adam-mini block parameters: fp32 (numel / block,), one second
                                          moment per block of this parameter (rank-independent)
    zero/optimizer_state.pt               DeepSpeed's global optimizer state (loss scaler, param groups,
                                          AdamW step) plus ds_muon's metadata under "ds_muon"
    *_model_states.pt                     copied from the source (lr scheduler, global step, ...)
    ../latest_universal                   the tag, for engine.load_checkpoint(OUT_DIR) with tag=None
    ../<side files>                       Trainer/Accelerate files next to the source tag (trainer_state.json,
                                          rng_state_<rank>.pth, scheduler.pt, ...), see carry_side_files

Errors are :class:`CheckpointError`, raised on every rank together, so none waits in a collective
for a rank that failed: :func:`check_before_load` (wrapped around ``engine.load_checkpoint``) reads
only files every rank reads, before any collective; the optimizer-level checks read the checkpoint's
metadata (identical in every rank's file) and all-gather what each rank found before raising.
"""
from __future__ import annotations

import argparse
import functools
import glob
import inspect
import math
import os
import re
import shutil
import sys
import weakref
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS,
                                            PARTITION_COUNT)
from deepspeed.utils import logger

from .adam_mini import BLOCK_ATTR, BLOCK_STATE_KEY
from .reference import MOMENTUM_KEY

__all__ = ["CheckpointError", "CONVERT_COMMAND", "DS_MUON_KEY", "zero_metadata", "add_metadata", "restore_step_count",
           "rigid_load_arguments", "check_zero_state_dict", "saved_model_states", "saved_world_size", "check_before_load", "install_load_checks",
           "convert_to_universal", "carry_side_files", "load_universal_state", "main"]

DS_MUON_KEY = "ds_muon"
METADATA_VERSION = 1
CONVERT_COMMAND = "python -m ds_muon.checkpoint to-universal"
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
UNIVERSAL_STATE_FILE = os.path.join("zero", "optimizer_state.pt")
_MAX_LINES = 25
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that ds_muon cannot load into this engine, or cannot convert.

    ``str(err)`` is a header and one line per problem (each naming the parameter, the file or the
    fix), at most 25 of them; ``err.problems`` holds all the lines.
    """

    def __init__(self, problems: Iterable[str] | str, header: Optional[str] = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        shown = self.problems[:_MAX_LINES]
        if len(self.problems) > _MAX_LINES:
            shown.append(f"... and {len(self.problems) - _MAX_LINES} more")
        lines = ([header] if header else []) + [("  " if header else "") + p for p in shown]
        super().__init__("\n".join(lines))


# ------------------------------------------------------------------------------------------------
# Metadata saved with every ZeRO state dict
# ------------------------------------------------------------------------------------------------
def zero_metadata(opt) -> dict:
    """ds_muon's metadata of a :class:`~ds_muon.zero3.MuonZeroOptimizer`, the same on every rank.

    Returns a dict of plain Python types: ``version``; ``world_size`` (the ZeRO partition count);
    ``muon_step_count``; ``sub_groups``, one entry per ZeRO sub-group in order: ``group`` (its param
    group), ``use_muon``, ``adam_mini`` (an Adam-mini block sub-group), ``state_id`` (the key of its state in
    ``optimizer.state_dict()["state"]``), ``params``, a list of ``[name, shape]`` in the order of the flat
    fp32 partition, and for Adam-mini sub-groups ``blocks`` (elements per block of each parameter, in the
    same order; the sub-group's blocks are numbered in that order); ``optimizer`` ("Muon" or
    "AdamMini") and, for AdamMini, ``block_rule``.
    """
    groups = opt.optimizer.param_groups
    sub_to_group = opt.sub_group_to_group_id
    state_id = opt._state_index()
    sub_groups = []
    for s, params in enumerate(opt.fp16_groups):
        g = sub_to_group[s]
        entry = {"group": int(g), "use_muon": bool(groups[g]["use_muon"]), "state_id": state_id[s],
                 "adam_mini": bool(groups[g].get("adam_mini", False)),
                 "params": [[opt.param_names[p], [int(d) for d in p.ds_shape]] for p in params]}
        if entry["adam_mini"]:
            entry["blocks"] = [int(getattr(p, BLOCK_ATTR)) for p in params]
        sub_groups.append(entry)
    meta = {"version": METADATA_VERSION, "world_size": int(opt.partition_count),
            "muon_step_count": int(opt.muon_step_count), "sub_groups": sub_groups}
    block_rule = getattr(opt.optimizer.config, "block_rule", None)  # AdamMini's; Muon's config has none
    meta["optimizer"] = "Muon" if block_rule is None else "AdamMini"
    if block_rule is not None:
        meta["block_rule"] = block_rule
    return meta


def _adam_mini_blocks(meta: dict) -> dict[str, Optional[int]]:
    """``{name: elements per Adam-mini block, or None (per element)}`` of every parameter in ``meta``
    (:func:`zero_metadata`'s ``sub_groups``, or a universal header's ``params``)."""
    if "sub_groups" in meta:
        return {name: (sg["blocks"][k] if sg.get("adam_mini") else None)
                for sg in meta["sub_groups"] for k, (name, _) in enumerate(sg["params"])}
    return {name: p.get("adam_mini_block") for name, p in meta["params"].items()}


def _adam_mini_problems(saved: dict, current: dict) -> list[str]:
    """Lines for an Adam-mini checkpoint loaded with another optimizer, another ``block_rule``, or other
    blocks (e.g. another head geometry): the per-block second moments would not fit. Checkpoints
    without the keys (saved before ds_muon recorded them) are not checked."""
    if "optimizer" not in saved or saved["optimizer"] == current["optimizer"] == "Muon":
        return []
    if saved["optimizer"] != current["optimizer"]:
        return [f"optimizer.type: the checkpoint was saved with {saved['optimizer']}, this run uses "
                f"{current['optimizer']}; their optimizer states do not carry over; set optimizer.type to "
                f"{saved['optimizer']!r}"]
    if saved["block_rule"] != current["block_rule"]:
        return [f"optimizer.params.block_rule: the checkpoint was saved with {saved['block_rule']!r}, this run has "
                f"{current['block_rule']!r}; Adam-mini's per-block second moments ('{BLOCK_STATE_KEY}') do not carry "
                f"over to other blocks; set optimizer.params.block_rule to {saved['block_rule']!r}"]
    old, new = _adam_mini_blocks(saved), _adam_mini_blocks(current)
    show = (lambda b: "per-element Adam" if b is None else f"Adam-mini blocks of {b} elements")
    return [f"parameter '{name}': {show(old[name])} in the checkpoint, {show(b)} in this run (optimizer.params."
            f"block_rule {current['block_rule']!r} on this model: did its head geometry change, "
            "num_attention_heads / num_key_value_heads / head_dim?); Adam-mini's per-block second moments do not "
            "carry over" for name, b in new.items() if name in old and old[name] != b]


def add_metadata(opt, state_dict: dict) -> dict:
    """``state_dict`` (DeepSpeed's ZeRO-3 optimizer state dict) with :func:`zero_metadata` under ``"ds_muon"``."""
    state_dict[DS_MUON_KEY] = zero_metadata(opt)
    return state_dict


def restore_step_count(opt, state_dict: dict) -> None:
    """Set ``opt.muon_step_count`` from a state dict's metadata (left alone when it has none)."""
    meta = state_dict.get(DS_MUON_KEY)
    if meta is not None:
        opt.muon_step_count = int(meta["muon_step_count"])


def rigid_load_arguments(opt, parent_load, args: tuple, kwargs: dict) -> tuple[Optional[dict], bool]:
    """From the arguments of ``DeepSpeedZeroOptimizer_Stage3.load_state_dict`` (``parent_load``):
    ``(this rank's ZeRO state dict, load_optimizer_states)`` for a same-world-size load, or
    ``(None, load_optimizer_states)`` for a universal checkpoint (``checkpoint_folder`` given)."""
    bound = inspect.signature(parent_load).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a.get("checkpoint_folder") or a["state_dict_list"] is None:
        return None, bool(a["load_optimizer_states"])
    return a["state_dict_list"][dist.get_rank(group=opt.dp_process_group)], bool(a["load_optimizer_states"])


def _param_table(meta: dict) -> dict[str, dict]:
    """``{name: {"shape": tuple, "use_muon": bool, "group": int}}`` from :func:`zero_metadata`."""
    return {name: {"shape": tuple(shape), "use_muon": sg["use_muon"], "group": sg["group"]}
            for sg in meta["sub_groups"] for name, shape in sg["params"]}


def _kind(use_muon: bool) -> str:
    return "Muon" if use_muon else "AdamW"


def _param_problems(saved: dict[str, dict], current: dict[str, dict]) -> list[str]:
    """One line per parameter whose name, shape, Muon/AdamW flag or param group does not match."""
    lines = []
    for name, cur in current.items():
        old = saved.get(name)
        if old is None:
            lines.append(f"parameter '{name}' (shape {cur['shape']}) is in the model but not in the checkpoint")
            continue
        if tuple(old["shape"]) != cur["shape"]:
            lines.append(f"parameter '{name}': shape {tuple(old['shape'])} in the checkpoint, {cur['shape']} "
                         "in the model")
        if old["use_muon"] != cur["use_muon"]:
            lines.append(f"parameter '{name}': {_kind(old['use_muon'])} in the checkpoint, {_kind(cur['use_muon'])} "
                         f"in the model (use_muon={cur['use_muon']}); Muon keeps '{MOMENTUM_KEY}' and AdamW "
                         "'exp_avg'/'exp_avg_sq', so its optimizer state does not carry over. Select it as in the "
                         "saved run (param.use_muon, optimizer.params.muon_params / adamw_params)")
        elif old["group"] != cur["group"]:
            lines.append(f"parameter '{name}': param group {old['group']} in the checkpoint, {cur['group']} in the "
                         "model; pass the same param groups as the saved run")
    lines += [f"parameter '{name}' (shape {tuple(old['shape'])}) is in the checkpoint but is not a trainable "
              "parameter of the model" for name, old in saved.items() if name not in current]
    return lines


def _raise_on_every_rank(problems: list[str], group, header: str) -> None:
    """Raise :class:`CheckpointError` on every rank of ``group`` if any rank found a problem (collective)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, problems, group=group)
        problems = list(dict.fromkeys(line for lines in gathered for line in lines))
    if problems:
        raise CheckpointError(problems, header)


def _convert_hint(load_dir: str, tag: str) -> str:
    return (f"convert it once with `{CONVERT_COMMAND} {load_dir} OUT_DIR --tag {tag}`, then load OUT_DIR with "
            "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config (docs/checkpointing.md)")


# ------------------------------------------------------------------------------------------------
# Same-world-size load: checks before DeepSpeed restores anything
# ------------------------------------------------------------------------------------------------
def check_zero_state_dict(opt, state_dict: dict, load_optimizer_states: bool = True) -> None:
    """Check that this rank's ZeRO-3 state dict fits ``opt``; called on every rank before loading it.

    Args:
        opt: the :class:`~ds_muon.zero3.MuonZeroOptimizer` being loaded.
        state_dict: ``optimizer_state_dict`` of this rank's ``*_optim_states.pt``.
        load_optimizer_states: whether the optimizer state (momentum, Adam moments) is loaded too.

    Raises:
        CheckpointError: on every rank, listing each parameter whose shape, Muon/AdamW flag or param
            group differs, parameters missing on either side, another optimizer type, Adam-mini
            ``block_rule`` or Adam-mini blocks (naming the key), a different ZeRO sub-group layout,
            another world size (naming ``python -m ds_muon.checkpoint to-universal``), a Muon
            parameter without saved momentum in a checkpoint saved after Muon steps, or an fp32
            partition of another size (an empty one: an NVMe checkpoint saved by DeepSpeed alone).
    """
    saved = state_dict.get(DS_MUON_KEY)
    current = zero_metadata(opt)
    problems: list[str] = []
    if saved is None:  # written before ds_muon saved metadata: nothing to check against
        logger.warning("ds_muon: this checkpoint has no ds_muon metadata (saved by an older ds_muon?); parameter "
                       "shapes and Muon/AdamW selection are not checked")
    elif state_dict.get(PARTITION_COUNT, saved["world_size"]) != current["world_size"]:
        problems.append(f"the checkpoint was saved at data-parallel world size {saved['world_size']}, this run has "
                        f"{current['world_size']}: ZeRO-3 partitions depend on it; convert it with "
                        f"`{CONVERT_COMMAND}` and load the result with \"checkpoint\": {{\"load_universal\": true}}")
    else:
        # a weights-only load takes no optimizer state, so another optimizer or other blocks do not matter
        problems = ((_adam_mini_problems(saved, current) if load_optimizer_states else [])
                    or _param_problems(_param_table(saved), _param_table(current)))
        layout = [(sg["group"], [n for n, _ in sg["params"]]) for sg in saved["sub_groups"]]
        if not problems and layout != [(sg["group"], [n for n, _ in sg["params"]]) for sg in current["sub_groups"]]:
            problems.append("the ZeRO sub-groups hold other parameters than when saved (was "
                            "zero_optimization.sub_group_size changed?); a universal checkpoint does not depend on "
                            f"them: convert with `{CONVERT_COMMAND}` and load with \"load_universal\": true")
        if not problems and load_optimizer_states and saved["muon_step_count"] > 0:
            state = state_dict[OPTIMIZER_STATE_DICT]["state"]
            problems = [line for sg in saved["sub_groups"]
                        if sg["use_muon"] and MOMENTUM_KEY not in state.get(sg["state_id"], {})
                        for line in _no_momentum([n for n, _ in sg["params"]], saved["muon_step_count"])]
    if not problems:
        for i, saved_fp32 in enumerate(state_dict.get(FP32_FLAT_GROUPS, [])):
            want = opt.fp16_partitioned_groups_flat_numel[i] if i < len(opt.fp16_groups) else 0
            if saved_fp32.numel() != want:
                problems.append(
                    f"ZeRO sub-group {i}: the checkpoint holds {saved_fp32.numel()} fp32 elements, this run's partition "
                    f"{want}" + (": an NVMe checkpoint saved by DeepSpeed without ds_muon holds empty placeholders "
                                 "instead of the weights and optimizer state; it cannot be resumed from"
                                 if saved_fp32.numel() == 0 else ""))
    _raise_on_every_rank(problems, opt.dp_process_group,
                         "ds_muon: the checkpoint does not fit this model and optimizer:")


def _no_momentum(names: list[str], muon_steps: int) -> list[str]:
    """Lines for Muon parameters without saved momentum (callers skip checkpoints saved before the
    first Muon step, whose momentum is zero and created on the first step)."""
    return [f"parameter '{name}' uses Muon but the checkpoint holds no Muon momentum ('{MOMENTUM_KEY}') for it, "
            f"although it was saved after {muon_steps} Muon steps" for name in names]


def _read_tag(load_dir: str, latest_name: str) -> Optional[str]:
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
    return torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)


def saved_world_size(ckpt_dir: str) -> Optional[int]:
    """``dp_world_size`` from a ``*_model_states.pt`` of a DeepSpeed checkpoint tag dir, or None."""
    states = saved_model_states(ckpt_dir)
    return None if states is None else states.get("dp_world_size")


def _file_problem(path: str) -> Optional[str]:
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
        problems += [line for line in map(_file_problem, files[rank::world]) if line]
        universal = os.path.isfile(os.path.join(ckpt_dir, UNIVERSAL_STATE_FILE))
        model_files = [f for f in glob.glob(os.path.join(ckpt_dir, "*_model_states.pt"))
                       if not os.path.basename(f).startswith("layer_")]
        if not universal and rank == 0:
            if not model_files:
                problems.append(f"{ckpt_dir} has no mp_rank_00_model_states.pt: the save did not finish; load "
                                "another tag")
            elif _file_problem(sorted(model_files)[0]) is None:
                saved = saved_world_size(ckpt_dir) or 0
                have = _optim_files(ckpt_dir)
                problems += [f"{ckpt_dir} has no ZeRO optimizer file of data-parallel rank {r} of the {saved} it was "
                             f"saved with ({os.path.join(ckpt_dir, f'zero_pp_rank_{r}_mp_rank_00_optim_states.pt')} is "
                             "missing): the save did not finish; load another tag" for r in range(saved) if r not in have]
    _raise_on_every_rank(problems, group, f"ds_muon: checkpoint {ckpt_dir} is incomplete or damaged:")


def check_before_load(engine, load_dir: str, tag: Optional[str], load_optimizer_states: bool = True,
                      load_module_only: bool = False) -> None:
    """Checks ``engine.load_checkpoint`` runs first on a ds_muon engine (from the files alone).

    Args:
        engine: the DeepSpeed engine whose optimizer is a ``MuonZeroOptimizer``.
        load_dir, tag: as given to ``engine.load_checkpoint`` (``tag`` None: the one in ``latest`` or
            ``latest_universal``).
        load_optimizer_states, load_module_only: as given to ``engine.load_checkpoint``.

    Raises:
        CheckpointError: a file of the tag is missing, truncated or damaged (:func:`verify_checkpoint_files`);
            the checkpoint was saved at another data-parallel world size (naming
            ``python -m ds_muon.checkpoint to-universal``; weights-only loads too, since ds_muon loads
            the tag's ZeRO partitions);
            ``checkpoint.load_universal`` is set but the checkpoint is not a universal one, or the
            other way round.
    """
    universal = bool(engine.load_universal_checkpoint())
    if tag is None:
        tag = _read_tag(load_dir, LATEST_UNIVERSAL if universal else LATEST)
        if tag is None:
            other = _read_tag(load_dir, LATEST if universal else LATEST_UNIVERSAL)
            if other is not None and universal:
                raise CheckpointError(f"{load_dir} holds a ZeRO checkpoint ('{LATEST}' names '{other}'), which is "
                                      "not a universal checkpoint, but checkpoint.load_universal is true; "
                                      + _convert_hint(load_dir, other))
            if other is not None:
                raise CheckpointError(f"{load_dir} holds a universal checkpoint ('{LATEST_UNIVERSAL}' names "
                                      f"'{other}'); set \"checkpoint\": {{\"load_universal\": true}} in the DeepSpeed "
                                      "config to load it")
            return  # DeepSpeed says there is nothing to load
    ckpt_dir = os.path.join(load_dir, str(tag))
    verify_checkpoint_files(ckpt_dir)
    is_universal = os.path.isfile(os.path.join(ckpt_dir, UNIVERSAL_STATE_FILE))
    if universal and not is_universal:
        raise CheckpointError(f"checkpoint.load_universal is true but {ckpt_dir} is not a universal checkpoint (no "
                              f"{UNIVERSAL_STATE_FILE}); " + _convert_hint(load_dir, str(tag)))
    if not universal and is_universal:
        raise CheckpointError(f"{ckpt_dir} is a universal checkpoint; set \"checkpoint\": {{\"load_universal\": "
                              "true} in the DeepSpeed config to load it")
    if universal:
        return
    saved = saved_world_size(ckpt_dir)  # weights-only loads too: ds_muon loads the tag's ZeRO partitions
    current = engine.seq_dp_world_size  # what DeepSpeed compares against
    if saved is not None and saved != current:
        raise CheckpointError(f"{ckpt_dir} was saved at data-parallel world size {saved}, this run has {current}; "
                              "ZeRO-3 partitions depend on the world size, so " + _convert_hint(load_dir, str(tag)))


def install_load_checks(engine) -> None:
    """Make ``engine.load_checkpoint`` run :func:`check_before_load` first (on this engine only;
    it holds the engine weakly, as the monitor hook does)."""
    engine_ref = weakref.ref(engine)
    load = type(engine).load_checkpoint
    signature = inspect.signature(load)

    @functools.wraps(load)
    def load_checkpoint(*args, **kwargs):
        this = engine_ref()
        bound = signature.bind(this, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        check_before_load(this, a["load_dir"], a["tag"], a["load_optimizer_states"], a["load_module_only"])
        result = load(this, *args, **kwargs)
        weights_only = a["load_module_only"] or not a["load_optimizer_states"]
        if weights_only and result[0] is not None and not this.load_universal_checkpoint():
            tag = a["tag"] if a["tag"] is not None else _read_tag(a["load_dir"], LATEST)
            load_weights_of_tag(this, a["load_dir"], str(tag))
        return result

    engine.load_checkpoint = load_checkpoint
    install_atomic_save(engine)


def install_atomic_save(engine) -> None:
    """Make ``engine.save_checkpoint`` crash-safe (on this engine only).

    DeepSpeed 0.19.8 writes each file in place and rank 0 writes ``latest`` as soon as its own files
    are written, without waiting for the other ranks: a rank killed in the middle of its write leaves
    a short file under the final name, and ``latest`` may already name the broken tag. Here each file is
    written to ``<name>.tmp`` and renamed when complete (``os.replace``, atomic on POSIX), and ``latest``
    is written (also through a temporary name) only after a barrier that every rank reaches once all its
    files are in place. A crash during a save therefore leaves ``latest`` on the previous tag, and the
    broken tag without the file that was being written (:func:`verify_checkpoint_files` names it).
    Decoupled (asynchronous) checkpoint engines keep DeepSpeed's own commit protocol.
    """
    engine_ref = weakref.ref(engine)
    save = type(engine).save_checkpoint
    signature = inspect.signature(save)

    def make_atomic(ckpt_engine) -> None:  # the engine builds its checkpoint engine after the optimizer
        if getattr(ckpt_engine, "_ds_muon_atomic", False):
            return
        write = ckpt_engine.save

        def atomic_write(state_dict, path: str):
            tmp = f"{path}.tmp"
            result = write(state_dict, tmp)
            os.replace(tmp, path)
            return result

        ckpt_engine.save, ckpt_engine._ds_muon_atomic = atomic_write, True

    @functools.wraps(save)
    def save_checkpoint(*args, **kwargs):
        this = engine_ref()
        if this.checkpoint_engine is None or this.checkpoint_engine.is_decoupled():
            return save(this, *args, **kwargs)
        make_atomic(this.checkpoint_engine)
        bound = signature.bind(this, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        save_latest, a["save_latest"] = a["save_latest"], False
        tag = str(a["tag"]) if a["tag"] is not None else f"global_step{this.global_steps}"  # DeepSpeed's default
        result = save(*bound.args, **bound.kwargs)
        if save_latest:
            dist.barrier()  # every rank's files are renamed into place
            if this.global_rank == 0:
                tmp = os.path.join(a["save_dir"], f"{LATEST}.tmp")
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(tag)
                os.replace(tmp, os.path.join(a["save_dir"], LATEST))
            dist.barrier()
        return result

    engine.save_checkpoint = save_checkpoint


def load_weights_of_tag(engine, load_dir: str, tag: str) -> None:
    """Install the fp32 weights of ``load_dir/tag`` (this rank's ZeRO partitions), keeping the live
    optimizer state, loss scaler and step counts: what ``load_checkpoint(tag=..., load_optimizer_states=False)``
    and ``load_module_only=True`` must do.

    DeepSpeed 0.19.8 does neither for ZeRO-3: without the optimizer states it re-derives the fp32
    weights from the live bf16/fp16 ones (so the model keeps whatever it held, e.g. ``latest``'s weights,
    not ``tag``'s), and ``load_module_only`` loads nothing (ZeRO-3's module file holds no weights).

    Raises:
        CheckpointError: the tag does not fit the model (:func:`check_zero_state_dict`); another
            data-parallel world size is refused before, by :func:`check_before_load`.
    """
    opt = engine.optimizer
    live = (opt.loss_scaler, opt.dynamic_loss_scale, opt.overflow)
    engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=False)
    opt.loss_scaler, opt.dynamic_loss_scale, opt.overflow = live


# ------------------------------------------------------------------------------------------------
# Conversion to the universal layout
# ------------------------------------------------------------------------------------------------
def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def _optim_files(ckpt_dir: str) -> dict[int, str]:
    files: dict[int, str] = {}
    for path in glob.glob(os.path.join(ckpt_dir, "*_optim_states.pt")):
        m = _OPTIM_FILE.match(os.path.basename(path))
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise CheckpointError(f"{path}: model-parallel checkpoints are not supported by ds_muon")
        files[int(m.group(1))] = path
    return files


def _save(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path)


def convert_to_universal(ckpt_dir: str, out_dir: str, tag: Optional[str] = None) -> str:
    """Convert a ds_muon ZeRO-3 checkpoint to a universal checkpoint that loads at any world size.

    Reads ``ckpt_dir/<tag>/`` (every rank's ``*_optim_states.pt`` and the ``*_model_states.pt``
    files) one parameter at a time through memory-mapped files, and writes ``out_dir/<tag>/`` in
    the layout of the module docstring, plus ``out_dir/latest_universal`` and the framework's side
    files (:func:`carry_side_files`). Per parameter of shape
    ``S``: ``fp32.pt`` and either ``momentum_buffer.pt`` (Muon) or ``exp_avg.pt``/``exp_avg_sq.pt``
    (AdamW), each ``{"param": float32 tensor of shape S}`` without ZeRO padding; scalar state
    (the AdamW ``step``) goes to the metadata.

    Args:
        ckpt_dir: the directory given to ``engine.save_checkpoint``.
        out_dir: where to write; must not be ``ckpt_dir``.
        tag: the checkpoint tag; default: the one named in ``ckpt_dir/latest``.

    Returns:
        The universal checkpoint's directory ``out_dir/<tag>``.

    Raises:
        CheckpointError: no tag, missing rank files, no ds_muon metadata (not saved by ds_muon, or
            by a version before the metadata), a partition layout that does not match the metadata,
            a Muon sub-group without momentum after Muon steps, ranks disagreeing on scalar state,
            or ``out_dir`` equal to ``ckpt_dir``.
    """
    if tag is None:
        tag = _read_tag(ckpt_dir, LATEST)
        if tag is None:
            raise CheckpointError(f"no '{LATEST}' file in {ckpt_dir}; pass the tag (--tag)")
    src = os.path.join(ckpt_dir, tag)
    dst = os.path.join(out_dir, tag)
    if os.path.realpath(os.path.abspath(ckpt_dir)) == os.path.realpath(os.path.abspath(out_dir)):
        raise CheckpointError(f"write the universal checkpoint to another directory than {ckpt_dir}")
    files = _optim_files(src)
    if 0 not in files:
        raise CheckpointError(f"{src} holds no ZeRO optimizer state (zero_pp_rank_0_mp_rank_00_optim_states.pt)")
    first = _load(files[0])[OPTIMIZER_STATE_DICT]
    meta = first.get(DS_MUON_KEY)
    if meta is None:
        raise CheckpointError(f"{files[0]} has no ds_muon metadata: it was not saved by a ds_muon engine, or by a "
                              "ds_muon version older than its checkpoint metadata; resume it at its world size and "
                              "save it again")
    world = meta["world_size"]
    if sorted(files) != list(range(world)):
        raise CheckpointError(f"{src}: expected the optimizer state files of ranks 0..{world - 1}, found ranks "
                              f"{sorted(files)}")
    states = [first] + [_load(files[r])[OPTIMIZER_STATE_DICT] for r in range(1, world)]

    # First check every sub-group, then write: a failed conversion leaves no half-written parameters.
    plans, problems = [], []
    for s, sg in enumerate(meta["sub_groups"]):
        flats = [sd[FP32_FLAT_GROUPS][s] for sd in states]
        per_rank = [sd[OPTIMIZER_STATE_DICT]["state"].get(sg["state_id"], {}) for sd in states]
        numels = [math.prod(shape) for _, shape in sg["params"]]
        partition = [math.ceil(n / world) for n in numels]
        if any(f.numel() != sum(partition) for f in flats):
            raise CheckpointError(f"{src}: sub-group {s} holds {[f.numel() for f in flats]} elements per rank, its "
                                  f"parameters need {sum(partition)}; the files do not match their metadata")
        tensor_keys = sorted(k for k, v in per_rank[0].items() if k != BLOCK_STATE_KEY
                             and torch.is_tensor(v) and v.dim() == 1 and v.numel() == flats[0].numel())
        scalars = {k: v for k, v in per_rank[0].items() if k not in tensor_keys and k != BLOCK_STATE_KEY}
        if sg.get("adam_mini") and any(BLOCK_STATE_KEY in st for st in per_rank):
            problems += _block_state_problems(s, sg, per_rank)
        for r, st in enumerate(per_rank[1:], 1):
            if sorted(st) != sorted(per_rank[0]) or any(st.get(k) != v for k, v in scalars.items()):
                problems.append(f"sub-group {s}: rank {r} holds other optimizer state than rank 0 "
                                f"({sorted(st)} vs {sorted(per_rank[0])})")
        if sg["use_muon"] and meta["muon_step_count"] > 0 and any(MOMENTUM_KEY not in st for st in per_rank):
            problems += _no_momentum([n for n, _ in sg["params"]], meta["muon_step_count"])
        plans.append((sg, flats, per_rank, numels, partition, tensor_keys, scalars))
    if problems:
        raise CheckpointError(problems, f"ds_muon: cannot convert {src}:")

    params: dict[str, dict] = {}
    for sg, flats, per_rank, numels, partition, tensor_keys, scalars in plans:
        offset = 0
        for (name, shape), numel, pn in zip(sg["params"], numels, partition):
            for key in ("fp32", *tensor_keys):
                sources = flats if key == "fp32" else [st[key] for st in per_rank]
                full = torch.cat([t.narrow(0, offset, pn) for t in sources])[:numel].reshape(shape).clone()
                _save(os.path.join(dst, "zero", name, f"{key}.pt"), {PARAM: full})
            params[name] = {"shape": list(shape), "use_muon": sg["use_muon"], "group": sg["group"],
                            "state_keys": tensor_keys, "scalars": scalars}
            offset += pn
        if sg.get("adam_mini"):  # per-block second moments: one vector per parameter, rank-independent
            block_state = per_rank[0].get(BLOCK_STATE_KEY)
            start = 0
            for (name, _), numel, block in zip(sg["params"], numels, sg["blocks"]):
                params[name]["adam_mini_block"] = block
                params[name]["block_state"] = block_state is not None
                if block_state is not None:
                    _save(os.path.join(dst, "zero", name, f"{BLOCK_STATE_KEY}.pt"),
                          {PARAM: block_state[start:start + numel // block].clone()})
                start += numel // block

    groups = [{k: v for k, v in g.items() if k != "params"} for g in first[OPTIMIZER_STATE_DICT][PARAM_GROUPS]]
    adam_step = next((p["scalars"]["step"] for p in params.values() if "step" in p["scalars"]), None)
    header = {k: v for k, v in first.items() if k not in (FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, DS_MUON_KEY)}
    # DeepSpeed's universal optimizer_state.pt keys, and ds_muon's metadata next to them.
    header[OPTIMIZER_STATE_DICT] = {"state": {} if adam_step is None else {0: {"step": adam_step}},
                                    PARAM_GROUPS: groups}
    header[PARAM_GROUPS] = groups
    header[DS_MUON_KEY] = {"version": METADATA_VERSION, "format": "universal", "source_world_size": world,
                           "source_tag": tag, "muon_step_count": meta["muon_step_count"], "params": params,
                           **{k: meta[k] for k in ("optimizer", "block_rule") if k in meta}}
    _save(os.path.join(dst, UNIVERSAL_STATE_FILE), header)
    for path in glob.glob(os.path.join(src, "*_model_states.pt")):
        shutil.copy2(path, dst)
    with open(os.path.join(out_dir, LATEST_UNIVERSAL), "w", encoding="utf-8") as f:
        f.write(tag)
    carry_side_files(ckpt_dir, out_dir)
    return dst


def _block_state_problems(s: int, sg: dict, per_rank: list[dict]) -> list[str]:
    """Lines for an Adam-mini sub-group ``s`` whose per-block second moments are missing on a rank, have
    another length than its blocks, or differ between ranks (they are replicated: every rank adds the
    same all-reduced sums)."""
    n_blocks = sum(math.prod(shape) // block for (_, shape), block in zip(sg["params"], sg["blocks"]))
    first = per_rank[0].get(BLOCK_STATE_KEY)
    for r, st in enumerate(per_rank):
        v = st.get(BLOCK_STATE_KEY)
        if v is None or v.numel() != n_blocks:
            return [f"sub-group {s}: rank {r} holds {'no' if v is None else v.numel()} Adam-mini block second "
                    f"moments ('{BLOCK_STATE_KEY}'), its parameters have {n_blocks} blocks"]
        if first is None or not torch.equal(v, first):
            return [f"sub-group {s}: the Adam-mini block second moments ('{BLOCK_STATE_KEY}') of rank {r} differ "
                    "from rank 0's; they are the same on every rank in a ds_muon run, so the files are not from "
                    "one save"]
    return []


# Written by DeepSpeed for its own format; not carried into a universal checkpoint folder.
_NOT_CARRIED = {LATEST, LATEST_UNIVERSAL, "zero_to_fp32.py", "zero_to_torch.py"}


def carry_side_files(ckpt_dir: str, out_dir: str) -> list[str]:
    """Copy the files a training framework saved next to the ZeRO checkpoint into ``out_dir``.

    HF Trainer and Accelerate keep their own state beside DeepSpeed's ``<tag>/`` folder:
    ``trainer_state.json``, ``training_args.bin``, ``scheduler.pt``, ``rng_state_<rank>.pth``
    (``rng_state.pth`` at one process), model config and weights, PEFT adapter files, Accelerate's
    ``random_states_<rank>.pkl``. Every regular file directly in ``ckpt_dir`` is copied except
    DeepSpeed's ``latest``/``latest_universal`` and ``zero_to_fp32.py``/``zero_to_torch.py`` (they
    read only the rigid format); sub-folders are not. ``out_dir`` is then a folder Trainer resumes from
    (``resume_from_checkpoint=out_dir``, with ``"checkpoint": {"load_universal": true}``).

    RNG states are per process and have no counterpart at another world size: the files are
    carried as they are (ranks below the new world size find theirs), and when the source has
    ``rng_state_0.pth`` but no ``rng_state.pth``, a copy of rank 0's is written as
    ``rng_state.pth``, the name Trainer reads when resuming at one process.

    Returns:
        The names written into ``out_dir``, sorted.
    """
    written = []
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name in _NOT_CARRIED or not os.path.isfile(path):
            continue
        shutil.copy2(path, os.path.join(out_dir, name))
        written.append(name)
    if "rng_state_0.pth" in written and "rng_state.pth" not in written:
        shutil.copy2(os.path.join(ckpt_dir, "rng_state_0.pth"), os.path.join(out_dir, "rng_state.pth"))
        written.append("rng_state.pth")
    return sorted(written)


# ------------------------------------------------------------------------------------------------
# Loading a universal checkpoint into a ds_muon engine
# ------------------------------------------------------------------------------------------------
def _read_universal(folder: str) -> dict:
    path = os.path.join(folder, UNIVERSAL_STATE_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is not a universal checkpoint (no {UNIVERSAL_STATE_FILE}); write one from a "
                              f"ZeRO checkpoint with `{CONVERT_COMMAND} CKPT_DIR OUT_DIR` and load OUT_DIR")
    header = torch.load(path, map_location="cpu", weights_only=False)
    if DS_MUON_KEY not in header:
        raise CheckpointError(f"{path} has no ds_muon metadata: it was not written by ds_muon's converter "
                              f"(DeepSpeed's ds_to_universal does not know Muon's '{MOMENTUM_KEY}'); convert the "
                              f"original ZeRO checkpoint with `{CONVERT_COMMAND}`")
    return header


def _universal_problems(opt, folder: str, names: list[list[str]], load_optimizer_states: bool):
    """``(header of zero/optimizer_state.pt or None, problem lines)`` for :func:`load_universal_state`."""
    try:
        header = _read_universal(folder)
    except CheckpointError as err:  # raised by the caller, on every rank together
        return None, err.problems
    meta = header[DS_MUON_KEY]
    saved = meta["params"]
    current = zero_metadata(opt)
    problems = ((_adam_mini_problems(meta, current) if load_optimizer_states else [])
                or _param_problems(saved, _param_table(current)))
    if problems:
        return header, problems
    zero_dir = os.path.join(folder, "zero")
    for group_names in names:
        kinds = {(tuple(saved[n]["state_keys"]), repr(saved[n]["scalars"]), bool(saved[n].get("block_state")))
                 for n in group_names}
        if load_optimizer_states and len(kinds) > 1:
            problems.append(f"parameters {group_names} share a ZeRO sub-group here but were saved with different "
                            f"optimizer state {sorted(kinds)}")
        for n in group_names:
            block = (BLOCK_STATE_KEY,) if saved[n].get("block_state") else ()
            for key in ("fp32", *((*saved[n]["state_keys"], *block) if load_optimizer_states else ())):
                if not os.path.isfile(os.path.join(zero_dir, n, f"{key}.pt")):
                    problems.append(f"parameter '{n}': {os.path.join(zero_dir, n, key + '.pt')} is missing")
            if (load_optimizer_states and saved[n]["use_muon"] and meta["muon_step_count"] > 0
                    and MOMENTUM_KEY not in saved[n]["state_keys"]):
                problems += _no_momentum([n], meta["muon_step_count"])
    return header, problems


def load_universal_state(opt, folder: str, load_optimizer_states: bool = True) -> None:
    """Load a universal checkpoint (``OUT_DIR/<tag>``) into a MuonZeroOptimizer at its world size W.

    Called on every rank by ``MuonZeroOptimizer._load_universal_checkpoint``. For each ZeRO
    sub-group, each parameter's full tensors are cut into this rank's partition by DeepSpeed's
    ``load_hp_checkpoint_state`` (``partition_numel = ceil(numel / W)``, this rank's slice, zero
    padding) and concatenated in the sub-group's order: the fp32 partition, ``momentum_buffer``
    (Muon sub-groups), ``exp_avg``/``exp_avg_sq`` and ``step`` (AdamW sub-groups) or ``exp_avg``,
    ``step`` and ``block_exp_avg_sq`` (Adam-mini sub-groups: the per-parameter vectors of one fp32 per
    block, concatenated whole, the same on every rank), all fp32 on the device of the fp32 partition.
    Then the param groups' hyperparameters (keys both sides have),
    the loss scaler and ``muon_step_count`` are restored, and the model's partitions are refreshed
    from fp32 with DeepSpeed's ``_reassign_or_swap_out_partitioned_parameters``. Under NVMe
    optimizer offload each sub-group's loaded fp32 partition and state go through one swap-in and
    swap-out (the Muon momentum stays in memory with ``save_muon_momentum_buffer_in_memory``). With
    ``load_optimizer_states=False`` only the checks run; DeepSpeed's own loader then reads ``fp32.pt``.

    Raises:
        CheckpointError: on every rank: not a universal checkpoint or not written by ds_muon (naming
            ``python -m ds_muon.checkpoint to-universal``); a parameter's shape, Muon/AdamW flag or
            param group differs, or it is missing on either side; another optimizer type, Adam-mini
            ``block_rule`` or Adam-mini blocks; a file is missing; a Muon parameter has no momentum
            after Muon steps.
    """
    names = [[opt.param_names[p] for p in params] for params in opt.fp16_groups]
    header, problems = _universal_problems(opt, folder, names, load_optimizer_states)
    _raise_on_every_rank(problems, opt.dp_process_group,
                         f"ds_muon: the universal checkpoint {folder} does not fit this model and optimizer:")
    if not load_optimizer_states:
        return

    meta = header[DS_MUON_KEY]
    saved = meta["params"]
    zero_dir = os.path.join(folder, "zero")
    opt._load_global_state_stage3(header)

    def load(s: int) -> tuple[torch.Tensor, dict]:
        """Sub-group ``s``'s fp32 partition and state, cut from the full tensors (one sub-group at a time)."""
        params, fp32 = opt.fp16_groups[s], opt.fp32_partitioned_groups_flat[s]
        first = saved[names[s][0]] if names[s] else {"state_keys": [], "scalars": {}}
        flats = {}
        for key in ("fp32", *first["state_keys"]):
            flat = torch.zeros(opt.fp16_partitioned_groups_flat_numel[s], dtype=torch.float32, device=fp32.device)
            offset = 0
            for p, name in zip(params, names[s]):
                part = opt.load_hp_checkpoint_state(os.path.join(zero_dir, name), key, param=p)
                flat.narrow(0, offset, part.numel()).copy_(part)
                offset += part.numel()
            flats[key] = flat
        if s in opt.adam_mini_maps and first.get("block_state"):  # per-parameter vectors, in block order
            flats[BLOCK_STATE_KEY] = torch.cat([
                torch.load(os.path.join(zero_dir, name, f"{BLOCK_STATE_KEY}.pt"), map_location="cpu",
                           weights_only=False)[PARAM] for name in names[s]]).to(fp32.device, torch.float32)
        return flats.pop("fp32"), {**flats, **first["scalars"]}

    # Under NVMe each sub-group's loaded fp32 partition and state go through one swap-in and swap-out.
    opt._install_partitions(load, replace_state=True)
    for group, saved_group in zip(opt.optimizer.param_groups, header[PARAM_GROUPS]):
        group.update({k: v for k, v in saved_group.items() if k in group and k not in ("params", "momentum_dtype")})
    opt.muon_step_count = int(meta["muon_step_count"])


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ds_muon.checkpoint to-universal CKPT_DIR OUT_DIR [--tag TAG]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m ds_muon.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("to-universal", help="convert a ds_muon ZeRO-3 checkpoint to a universal checkpoint "
                                               "that loads at any data-parallel world size")
    conv.add_argument("ckpt_dir", help="the directory given to engine.save_checkpoint")
    conv.add_argument("out_dir", help="where to write the universal checkpoint (and its latest_universal file)")
    conv.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CKPT_DIR/latest)")
    args = parser.parse_args(argv)
    try:
        dst = convert_to_universal(args.ckpt_dir, args.out_dir, args.tag)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {dst}; load it at any data-parallel world size with \"checkpoint\": {{\"load_universal\": true}} "
          f"in the DeepSpeed config and engine.load_checkpoint({args.out_dir!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
