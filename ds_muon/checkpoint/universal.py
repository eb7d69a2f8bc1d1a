"""The universal checkpoint: ds_muon's any-world-size format, its converter and its reader (layer ``checkpoint``).

A ZeRO partition depends on the world size W and the stage (:mod:`ds_muon.partitions`: ZeRO-3 cuts every
parameter into W chunks of ``ceil(numel / W)`` elements, zero-padded; ZeRO-1/2 cut each param group's flat buffer
into W equal partitions), so the per-rank files only load at the W and stage they were saved at. ``python -m
ds_muon.checkpoint to-universal CKPT_DIR OUT_DIR [--tag TAG]`` (:func:`convert_to_universal`) writes DeepSpeed's
universal-checkpoint layout with full, padding-free tensors per parameter, from either layout. A ds_muon engine at
any W and stage 1, 2 or 3 loads it with ``"checkpoint": {"load_universal": true}`` and the usual
``engine.load_checkpoint(OUT_DIR)``; the glue (:mod:`ds_muon.integration.zero3_checkpoint`,
:mod:`ds_muon.integration.zero12_checkpoint`) checks it with :func:`universal_problems` and fills each partition
with :func:`universal_loader`.

Why ds_muon's own loader and not DeepSpeed's stage-3 universal loader
(``load_hp_checkpoint_state_from_checkpoint_dir_stage3``, deepspeed 0.19.8): that loader reads the fixed keys
``fp32``/``exp_avg``/``exp_avg_sq`` for every sub-group (Muon sub-groups have ``momentum_buffer`` instead), takes
one ``step`` for all sub-groups, and copies the hyperparameters of param group 0 into every param group, which
would give the AdamW groups Muon's lr and ``use_muon=True``.

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
"""
from __future__ import annotations

import glob
import math
import os
import shutil
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import CheckpointError
from ..names import (BASE_OPTIMIZER_STATE, BLOCK_STATE_KEY, FP32_FLAT_GROUPS, MOMENTUM_KEY, OPTIMIZER_STATE_DICT, PARAM,
                     PARAM_GROUPS, PARTITION_COUNT, SINGLE_PARTITION_OF_FP32_GROUPS, ZERO_PARTITION_GROUPS)
from ..partitions import chunked_pieces, flat_pieces
from .files import LATEST, LATEST_UNIVERSAL, UNIVERSAL_STATE_FILE, optim_files, read_tag
from .safe_load import check_files, safe_load
from .metadata import (CONVERT_COMMAND, DS_MUON_KEY, METADATA_VERSION, ZeroLayout, adam_mini_problems, metadata,
                       no_momentum, param_problems, param_table)

__all__ = ["convert_to_universal", "carry_side_files", "read_universal", "universal_problems", "universal_loader"]


# ------------------------------------------------------------------------------------------------
# Conversion to the universal layout
# ------------------------------------------------------------------------------------------------
def _load(path: str) -> dict:
    return safe_load(path, mmap=True)


def _save(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path)


def _source_keys(meta: dict) -> tuple[str, str]:
    """``(fp32 partitions key, inner optimizer state key)`` inside a rank file's ``optimizer_state_dict``."""
    if meta.get("layout") == "flat":  # ZeRO-1/2
        return SINGLE_PARTITION_OF_FP32_GROUPS, BASE_OPTIMIZER_STATE
    return FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT


def _expert_parallel_problem(state_dict: dict, world: int) -> Optional[str]:
    """Why rank 0's ZeRO optimizer state ``state_dict`` (its ``optimizer_state_dict``) cannot be converted: saved under
    DeepSpeed's AutoEP (expert parallelism), whose expert parameters are partitioned over the expert-data-parallel
    group, not the ``world`` ranks; None otherwise.

    DeepSpeed marks it: at ZeRO-3 with each sub-group's partition group (:data:`ds_muon.names.ZERO_PARTITION_GROUPS`,
    written only when a sub-group holds AutoEP experts), at ZeRO-1/2 with a ``partition_count`` below ``world`` for
    the expert param groups. Each expert-parallel rank holds other experts under the same parameter names, and the
    conversion joins a parameter's partitions by name over all ranks."""
    groups = state_dict.get(ZERO_PARTITION_GROUPS) or []
    counts = state_dict.get(PARTITION_COUNT)
    counts = counts if isinstance(counts, list) else [g.get("partition_count", world) for g in groups]
    if not any(int(c) != world for c in counts):
        return None
    return ("saved under DeepSpeed's AutoEP (expert parallelism): its expert parameters are partitioned over the "
            f"expert-data-parallel group (partition counts {sorted(set(int(c) for c in counts))} of {world} ranks), and "
            "each expert-parallel rank holds other experts under the same names (experts.w1, ...), which ds_muon's "
            "universal conversion does not handle yet; resume at the world size and expert_parallel.autoep_size it "
            "was saved with (loaded exactly), without load_universal")


def _pieces(sg: dict, world: int, flat: bool) -> list[tuple]:
    """Per parameter of a saved sub-group (ZeRO-3) or param group (ZeRO-1/2): its
    :class:`~ds_muon.partitions.Piece` on every rank."""
    if flat:
        return [flat_pieces(int(o), math.prod(shape), int(sg["partition_numel"]), world)
                for (_, shape), o in zip(sg["params"], sg["offsets"])]
    out, offset = [], 0
    for _, shape in sg["params"]:
        out.append(chunked_pieces(math.prod(shape), world, offset))
        offset += out[-1][0].sent
    return out


def convert_to_universal(ckpt_dir: str, out_dir: str, tag: Optional[str] = None) -> str:
    """Convert a ds_muon ZeRO checkpoint (stage 3, or stages 1/2) to a universal checkpoint that loads at any world
    size and any of those stages.

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
            ``out_dir`` equal to ``ckpt_dir``, or a file of the tag that names a global loading would import and
            call (:func:`ds_muon.checkpoint.safe_load.check_files`).
    """
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} does not exist or is not a directory: pass the directory given to "
                              "engine.save_checkpoint")
    if tag is None:
        tag = read_tag(ckpt_dir, LATEST)
        if tag is None:
            raise CheckpointError(f"no '{LATEST}' file in {ckpt_dir}; pass the tag (--tag)")
    if not os.path.isdir(os.path.join(ckpt_dir, str(tag))):
        raise CheckpointError(f"{os.path.join(ckpt_dir, str(tag))} does not exist: no tag {tag!r} in {ckpt_dir}")
    src = os.path.join(ckpt_dir, tag)
    dst = os.path.join(out_dir, tag)
    if os.path.realpath(os.path.abspath(ckpt_dir)) == os.path.realpath(os.path.abspath(out_dir)):
        raise CheckpointError(f"write the universal checkpoint to another directory than {ckpt_dir}")
    if os.path.isdir(src):
        check_files([src])  # every file it reads or copies: no code runs from a checkpoint (docs: "Security")
    files = optim_files(src)
    if 0 not in files:
        raise CheckpointError(f"{src} holds no ZeRO optimizer state (zero_pp_rank_0_mp_rank_00_optim_states.pt)")
    first = _load(files[0])[OPTIMIZER_STATE_DICT]
    meta = first.get(DS_MUON_KEY)
    if meta is None:
        raise CheckpointError(f"{files[0]} has no ds_muon metadata: it was not saved by a ds_muon engine, or by a "
                              "ds_muon version older than its checkpoint metadata; resume it at its world size and "
                              "save it again")
    world = meta["world_size"]
    problem = _expert_parallel_problem(first, world)
    if problem is not None:
        raise CheckpointError(f"{src}: {problem}")
    flat = meta.get("layout") == "flat"
    fp32_key, inner_key = _source_keys(meta)
    if sorted(files) != list(range(world)):
        raise CheckpointError(f"{src}: expected the optimizer state files of ranks 0..{world - 1}, found ranks "
                              f"{sorted(files)}")
    states = [first] + [_load(files[r])[OPTIMIZER_STATE_DICT] for r in range(1, world)]

    # First check every sub-group, then write: a failed conversion leaves no half-written parameters.
    plans, problems = [], []
    for s, sg in enumerate(meta["sub_groups"]):
        flats = [sd[fp32_key][s] for sd in states]
        per_rank = [sd[inner_key]["state"].get(sg["state_id"], {}) for sd in states]
        numels = [math.prod(shape) for _, shape in sg["params"]]
        pieces = _pieces(sg, world, flat)
        # ZeRO-1/2 save the last rank's fp32 partition without its end padding: each rank's must cover its pieces
        need = [max((q[r].shard_offset + q[r].sent for q in pieces if q[r].sent), default=0) for r in range(world)]
        partition_numel = int(sg["partition_numel"]) if flat else sum(q[0].sent for q in pieces)
        if any(f.numel() < n or (not flat and f.numel() != partition_numel) for f, n in zip(flats, need)):
            raise CheckpointError(f"{src}: sub-group {s} holds {[f.numel() for f in flats]} elements per rank, its "
                                  f"parameters need {need}; the files do not match their metadata")
        tensor_keys = sorted(k for k, v in per_rank[0].items() if k != BLOCK_STATE_KEY
                             and torch.is_tensor(v) and v.dim() == 1 and v.numel() == partition_numel)
        scalars = {k: v for k, v in per_rank[0].items() if k not in tensor_keys and k != BLOCK_STATE_KEY}
        if sg.get("adam_mini") and any(BLOCK_STATE_KEY in st for st in per_rank):
            problems += _block_state_problems(s, sg, per_rank)
        for r, st in enumerate(per_rank[1:], 1):
            if sorted(st) != sorted(per_rank[0]) or any(st.get(k) != v for k, v in scalars.items()):
                problems.append(f"sub-group {s}: rank {r} holds other optimizer state than rank 0 "
                                f"({sorted(st)} vs {sorted(per_rank[0])})")
        if sg["use_muon"] and meta["muon_step_count"] > 0 and any(MOMENTUM_KEY not in st for st in per_rank):
            problems += no_momentum([n for n, _ in sg["params"]], meta["muon_step_count"])
        plans.append((sg, flats, per_rank, numels, pieces, tensor_keys, scalars))
    if problems:
        raise CheckpointError(problems, f"ds_muon: cannot convert {src}:")

    params: dict[str, dict] = {}
    for sg, flats, per_rank, numels, pieces, tensor_keys, scalars in plans:
        for (name, shape), numel, piece in zip(sg["params"], numels, pieces):
            for key in ("fp32", *tensor_keys):
                sources = flats if key == "fp32" else [st[key] for st in per_rank]
                full = torch.cat([t.narrow(0, q.shard_offset, q.length) for t, q in zip(sources, piece) if q.length])
                _save(os.path.join(dst, "zero", name, f"{key}.pt"), {PARAM: full[:numel].reshape(shape).clone()})
            params[name] = {"shape": list(shape), "use_muon": sg["use_muon"], "group": sg["group"],
                            "state_keys": tensor_keys, "scalars": scalars}
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

    groups = [{k: v for k, v in g.items() if k != "params"} for g in first[inner_key][PARAM_GROUPS]]
    adam_step = next((p["scalars"]["step"] for p in params.values() if "step" in p["scalars"]), None)
    header = {k: v for k, v in first.items() if k not in (fp32_key, inner_key, DS_MUON_KEY, "param_slice_mappings")}
    # DeepSpeed's universal optimizer_state.pt keys, and ds_muon's metadata next to them.
    header[OPTIMIZER_STATE_DICT] = {"state": {} if adam_step is None else {0: {"step": adam_step}},
                                    PARAM_GROUPS: groups}
    header[PARAM_GROUPS] = groups
    header[DS_MUON_KEY] = {"version": METADATA_VERSION, "format": "universal", "source_world_size": world,
                           "source_layout": meta.get("layout", "chunked"),
                           "source_tag": tag, "muon_step_count": meta["muon_step_count"],
                           "step_count": meta.get("step_count", meta["muon_step_count"]), "params": params,
                           **{k: meta[k] for k in ("optimizer", "block_rule") if k in meta}}
    _save(os.path.join(dst, UNIVERSAL_STATE_FILE), header)
    for path in glob.glob(os.path.join(src, "*_model_states.pt")):
        shutil.copy2(path, dst)
    _model_states_for_every_stage(src, dst)
    with open(os.path.join(out_dir, LATEST_UNIVERSAL), "w", encoding="utf-8") as f:
        f.write(tag)
    carry_side_files(ckpt_dir, out_dir)
    return dst


def _model_states_for_every_stage(src: str, dst: str) -> None:
    """The engine-state file under the names both layouts load from a universal checkpoint: ZeRO-1/2 read
    ``mp_rank_00_model_states.pt``, ZeRO-3 ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (lr scheduler, global
    step, client state; the weights come from ``zero/``)."""
    flat, chunked = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"
    for have, want in ((flat, chunked), (chunked, flat)):
        if os.path.isfile(os.path.join(src, have)) and not os.path.isfile(os.path.join(dst, want)):
            shutil.copy2(os.path.join(src, have), os.path.join(dst, want))


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
def read_universal(folder: str) -> dict:
    """The header (``zero/optimizer_state.pt``) of a universal checkpoint written by ds_muon's converter.

    Raises:
        CheckpointError: ``folder`` is not a universal checkpoint, or was not written by ds_muon.
    """
    path = os.path.join(folder, UNIVERSAL_STATE_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is not a universal checkpoint (no {UNIVERSAL_STATE_FILE}); write one from a "
                              f"ZeRO checkpoint with `{CONVERT_COMMAND} CKPT_DIR OUT_DIR` and load OUT_DIR")
    header = safe_load(path)
    if DS_MUON_KEY not in header:
        raise CheckpointError(f"{path} has no ds_muon metadata: it was not written by ds_muon's converter "
                              f"(DeepSpeed's ds_to_universal does not know Muon's '{MOMENTUM_KEY}'); convert the "
                              f"original ZeRO checkpoint with `{CONVERT_COMMAND}`")
    return header


def universal_problems(layout: ZeroLayout, folder: str, names: Sequence[Sequence[str]],
                       load_optimizer_states: bool) -> tuple[Optional[dict], list[str]]:
    """Whether the universal checkpoint ``folder`` (``OUT_DIR/<tag>``) fits an optimizer of ``layout``.

    Args:
        layout: the loading optimizer's layout. names: the parameter names of each of its sub-groups.
        load_optimizer_states: whether the optimizer state is loaded too (else only the weights must fit).

    Returns:
        ``(header of zero/optimizer_state.pt or None, problem lines)``: not a universal checkpoint or not written
        by ds_muon (naming ``python -m ds_muon.checkpoint to-universal``); a parameter's shape, Muon/AdamW flag or
        param group differs, or it is missing on either side; another optimizer type, Adam-mini ``block_rule``
        or blocks; a file is missing; a Muon parameter has no momentum after Muon steps.
    """
    try:
        header = read_universal(folder)
    except CheckpointError as err:  # raised by the caller, on every rank together
        return None, err.problems
    meta = header[DS_MUON_KEY]
    saved = meta["params"]
    current = metadata(layout)
    problems = ((adam_mini_problems(meta, current) if load_optimizer_states else [])
                or param_problems(saved, param_table(current)))
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
                problems += no_momentum([n], meta["muon_step_count"])
    return header, problems


def universal_loader(folder: str, header: dict, names: Sequence[Sequence[str]], partition_numels: Sequence[int],
                     block_subgroups: set[int], device: torch.device,
                     slice_param: Callable[[str, str, int, int], torch.Tensor],
                     place: Optional[Callable[[int, int], int]] = None) -> Callable[[int], tuple[torch.Tensor, dict]]:
    """A function ``s -> (fp32 partition, state)`` that cuts sub-group ``s``'s partition out of the universal
    checkpoint ``folder`` (after :func:`universal_problems` found none), one sub-group at a time.

    Per parameter of the sub-group, its full tensors are cut into this rank's partition by ``slice_param`` and
    concatenated in the sub-group's order: the fp32 partition, ``momentum_buffer`` (Muon sub-groups),
    ``exp_avg``/``exp_avg_sq`` (AdamW) or ``exp_avg`` and ``block_exp_avg_sq`` (Adam-mini: the per-parameter
    vectors of one fp32 per block, concatenated whole, the same on every rank), all fp32 on ``device``, and the
    scalar state (``step``) of the metadata.

    Args:
        header: from :func:`read_universal`. names: the parameter names of each sub-group.
        partition_numels: elements of each sub-group's fp32 partition on this rank.
        block_subgroups: the Adam-mini sub-groups. device: where the partitions live.
        slice_param: ``(parameter folder, state key, sub-group, index of the parameter in it) -> this rank's
            slice`` of the parameter's full tensor, ZeRO padding included (DeepSpeed's ``load_hp_checkpoint_state``).
        place: ``(sub-group, index of the parameter) -> where its slice starts in the partition`` (ZeRO-1/2's flat
            partitions, with alignment gaps); default: the slices back to back (ZeRO-3). Elements no slice covers
            are zero.
    """
    saved = header[DS_MUON_KEY]["params"]
    zero_dir = os.path.join(folder, "zero")

    def load(s: int) -> tuple[torch.Tensor, dict]:
        first = saved[names[s][0]] if names[s] else {"state_keys": [], "scalars": {}}
        flats = {}
        for key in ("fp32", *first["state_keys"]):
            flat = torch.zeros(partition_numels[s], dtype=torch.float32, device=device)
            offset = 0
            for k, name in enumerate(names[s]):
                part = slice_param(os.path.join(zero_dir, name), key, s, k)
                at = offset if place is None else place(s, k)
                flat.narrow(0, at, part.numel()).copy_(part.reshape(-1))
                offset = at + part.numel()
            flats[key] = flat
        if s in block_subgroups and first.get("block_state"):  # per-parameter vectors, in block order
            flats[BLOCK_STATE_KEY] = torch.cat([
                safe_load(os.path.join(zero_dir, name, f"{BLOCK_STATE_KEY}.pt"))[PARAM] for name in names[s]]).to(device, torch.float32)
        return flats.pop("fp32"), {**flats, **first["scalars"]}

    return load
