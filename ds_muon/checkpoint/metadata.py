"""ds_muon's checkpoint metadata and the checks that a checkpoint fits the engine loading it (layer ``checkpoint``).

Every rank's ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds ds_muon's metadata under ``"ds_muon"``
(:func:`metadata`: the world size, the step counts, and per ZeRO sub-group its param group, algorithm and
``(name, shape)`` of every parameter), identical on every rank and made of plain Python types. Before
DeepSpeed restores anything, :func:`zero_state_dict_problems` compares it with the loading engine's
:class:`ZeroLayout`, one line per parameter that does not fit. This module works on plain data: the
DeepSpeed glue (:mod:`ds_muon.integration.zero3_checkpoint`) builds the layout and raises; nothing here
touches an optimizer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from ..errors import CheckpointError
from ..names import (ADAM_MINI, BASE_OPTIMIZER_STATE, BLOCK_STATE_KEY, FP32_FLAT_GROUPS, MOMENTUM_KEY, MUON,
                     OPTIMIZER_STATE_DICT, PARTITION_COUNT)

__all__ = ["DS_MUON_KEY", "METADATA_VERSION", "CONVERT_COMMAND", "SubGroupInfo", "ZeroLayout", "metadata",
           "saved_step_counts", "zero_state_dict_problems", "param_table", "param_problems", "adam_mini_problems",
           "no_momentum", "raise_on_every_rank", "stage_of"]

logger = logging.getLogger("ds_muon")

DS_MUON_KEY = "ds_muon"
#: The checkpoint format's version, saved as the metadata's ``version``: 1. Keys added since are read with a default
#: when absent, so the version stayed 1 and the code names older checkpoints by what they lack. Format 1 as first
#: written (tests/dist/test_checkpoint.py loads one) has param groups without ``algorithm`` (derived from
#: ``use_muon``/``adam_mini``: :func:`ds_muon.names.algorithm_of`) and metadata without ``step_count``
#: (:func:`saved_step_counts`); an oracle state dict without ``ds_muon_qk_clip_steps`` takes QK-clip's counter from
#: AdamW's ``step`` (:meth:`ds_muon.oracle.MuonAdamW.load_state_dict`).
METADATA_VERSION = 1
CONVERT_COMMAND = "python -m ds_muon.checkpoint to-universal"


@dataclass(frozen=True)
class SubGroupInfo:
    """One ZeRO sub-group as the checkpoint sees it.

    Attributes:
        group: its param group's index. algorithm: ``"muon"``, ``"adam_mini"`` or ``"adamw"``.
        state_id: the key of its state in ``optimizer.state_dict()["state"]``.
        params: ``((name, shape), ...)`` in the order of the flat fp32 partition.
        blocks: Adam-mini sub-groups: elements per block of each parameter, in the same order.
        partition_numel: elements of this rank's fp32 partition.
        offsets: ZeRO-1/2's flat layout: where each parameter starts in the param group's flat buffer (elements;
            rank ``r``'s partition is ``[r * partition_numel, (r+1) * partition_numel)`` of it,
            :func:`ds_muon.partitions.flat_pieces`); None: ZeRO-3's chunked layout.
    """

    group: int
    algorithm: str
    state_id: int
    params: tuple[tuple[str, tuple[int, ...]], ...]
    blocks: Optional[tuple[int, ...]] = None
    partition_numel: int = 0
    offsets: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class ZeroLayout:
    """What the checkpoint format needs to know about a ds_muon ZeRO optimizer (built by the glue).

    Attributes:
        world_size: the ZeRO partition count W.
        sub_groups: one :class:`SubGroupInfo` per sub-group, in order.
        optimizer: ``"Muon"`` or ``"AdamMini"``; block_rule: AdamMini's ``block_rule`` (None for Muon).
        muon_step_count: optimizer steps that ran the Muon update; step_count: steps applied (any algorithm).
        layout: ``"chunked"`` (ZeRO-3: one sub-group per entry) or ``"flat"`` (ZeRO-1/2: one param group per
            entry, its parameters' ``offsets`` given).
    """

    world_size: int
    sub_groups: tuple[SubGroupInfo, ...]
    optimizer: str
    block_rule: Optional[str] = None
    muon_step_count: int = 0
    step_count: int = 0
    layout: str = "chunked"


def metadata(layout: ZeroLayout) -> dict:
    """ds_muon's metadata dict of ``layout``, the same on every rank (plain Python types).

    Keys: ``version``; ``world_size``; ``muon_step_count``; ``step_count``; ``sub_groups``, one entry per ZeRO
    sub-group in order: ``group``, ``use_muon``, ``adam_mini`` (an Adam-mini block sub-group), ``state_id``,
    ``params`` (a list of ``[name, shape]``) and for Adam-mini sub-groups ``blocks``; ``optimizer`` ("Muon" or
    "AdamMini") and, for AdamMini, ``block_rule``. (Format 1 as first written has no ``step_count``.)
    ZeRO-1/2 checkpoints (``layout`` ``"flat"``) also have ``layout`` and, per entry (a param group),
    ``offsets`` and ``partition_numel``.
    """
    sub_groups = []
    for sg in layout.sub_groups:
        entry = {"group": int(sg.group), "use_muon": sg.algorithm == MUON, "state_id": int(sg.state_id),
                 "adam_mini": sg.algorithm == ADAM_MINI,
                 "params": [[name, [int(d) for d in shape]] for name, shape in sg.params]}
        if entry["adam_mini"]:
            entry["blocks"] = [int(b) for b in sg.blocks]
        if layout.layout == "flat":
            entry["offsets"] = [int(o) for o in sg.offsets]
            entry["partition_numel"] = int(sg.partition_numel)
        sub_groups.append(entry)
    meta = {"version": METADATA_VERSION, "world_size": int(layout.world_size),
            "muon_step_count": int(layout.muon_step_count), "step_count": int(layout.step_count),
            "sub_groups": sub_groups, "optimizer": layout.optimizer}
    if layout.block_rule is not None:
        meta["block_rule"] = layout.block_rule
    if layout.layout == "flat":
        meta["layout"] = "flat"
    return meta


def stage_of(meta: dict) -> str:
    """How messages name the ZeRO stage(s) whose layout ``meta`` describes."""
    return "ZeRO stage 1/2" if meta.get("layout") == "flat" else "ZeRO stage 3"


def saved_step_counts(meta: Optional[dict]) -> Optional[tuple[int, int]]:
    """``(muon_step_count, step_count)`` of saved metadata, or None without metadata. A checkpoint saved
    before ``step_count`` was recorded counted every applied step as ``muon_step_count``."""
    if meta is None:
        return None
    return int(meta["muon_step_count"]), int(meta.get("step_count", meta["muon_step_count"]))


def adam_mini_blocks(meta: dict) -> dict[str, Optional[int]]:
    """``{name: elements per Adam-mini block, or None (per element)}`` of every parameter in ``meta``
    (:func:`metadata`'s ``sub_groups``, or a universal header's ``params``)."""
    if "sub_groups" in meta:
        return {name: (sg["blocks"][k] if sg.get("adam_mini") else None)
                for sg in meta["sub_groups"] for k, (name, _) in enumerate(sg["params"])}
    return {name: p.get("adam_mini_block") for name, p in meta["params"].items()}


def adam_mini_problems(saved: dict, current: dict) -> list[str]:
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
    old, new = adam_mini_blocks(saved), adam_mini_blocks(current)
    show = (lambda b: "per-element Adam" if b is None else f"Adam-mini blocks of {b} elements")
    return [f"parameter '{name}': {show(old[name])} in the checkpoint, {show(b)} in this run (optimizer.params."
            f"block_rule {current['block_rule']!r} on this model: did its head geometry change, "
            "num_attention_heads / num_key_value_heads / head_dim?); Adam-mini's per-block second moments do not "
            "carry over" for name, b in new.items() if name in old and old[name] != b]


def param_table(meta: dict) -> dict[str, dict]:
    """``{name: {"shape": tuple, "use_muon": bool, "group": int}}`` from :func:`metadata`."""
    return {name: {"shape": tuple(shape), "use_muon": sg["use_muon"], "group": sg["group"]}
            for sg in meta["sub_groups"] for name, shape in sg["params"]}


def _kind(use_muon: bool) -> str:
    return "Muon" if use_muon else "AdamW"


def param_problems(saved: dict[str, dict], current: dict[str, dict]) -> list[str]:
    """One line per parameter whose name, shape, Muon/AdamW flag or param group does not match."""
    lines = []
    group_moved = False
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
            group_moved = True
            lines.append(f"parameter '{name}': param group {old['group']} in the checkpoint, {cur['group']} in the "
                         "model; pass the same param groups as the saved run")
    lines += [f"parameter '{name}' (shape {tuple(old['shape'])}) is in the checkpoint but is not a trainable "
              "parameter of the model" for name, old in saved.items() if name not in current]
    if group_moved:
        lines.append("if the moved parameters are norm weights and biases: the saved run put them in a different "
                     "weight-decay group; set optimizer.params.decay_norms_and_biases to the saved run's value "
                     "(true for Muon checkpoints written before decay_norms_and_biases existed, whose AdamW "
                     "decayed them with the rest)")
    return lines


def no_momentum(names: list[str], muon_steps: int) -> list[str]:
    """Lines for Muon parameters without saved momentum (callers skip checkpoints saved before the
    first Muon step, whose momentum is zero and created on the first step)."""
    return [f"parameter '{name}' uses Muon but the checkpoint holds no Muon momentum ('{MOMENTUM_KEY}') for it, "
            f"although it was saved after {muon_steps} Muon steps" for name in names]


def raise_on_every_rank(problems: list[str], group, header: str) -> None:
    """Raise :class:`CheckpointError` on every rank of ``group`` if any rank found a problem (collective)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, problems, group=group)
        problems = list(dict.fromkeys(line for lines in gathered for line in lines))
    if problems:
        raise CheckpointError(problems, header)


# ------------------------------------------------------------------------------------------------
# Same-world-size load: checks before DeepSpeed restores anything
# ------------------------------------------------------------------------------------------------
def _partition_count(state_dict: dict, saved: dict) -> int:
    """The saved data-parallel world size (ZeRO-1/2 save ``partition_count`` per param group)."""
    count = state_dict.get(PARTITION_COUNT, saved["world_size"])
    return int(count[0] if isinstance(count, (list, tuple)) else count)


def zero_state_dict_problems(state_dict: dict, layout: ZeroLayout, load_optimizer_states: bool = True) -> list[str]:
    """The problems of loading this rank's ZeRO state dict into an optimizer of ``layout`` (same world size).

    Args:
        state_dict: ``optimizer_state_dict`` of this rank's ``*_optim_states.pt``.
        layout: the loading optimizer's :class:`ZeroLayout`.
        load_optimizer_states: whether the optimizer state (momentum, Adam moments) is loaded too.

    Returns:
        One line per problem: each parameter whose shape, Muon/AdamW flag or param group differs, parameters
        missing on either side, another optimizer type, Adam-mini ``block_rule`` or Adam-mini blocks (naming
        the key), a different ZeRO sub-group layout, another world size (naming ``python -m
        ds_muon.checkpoint to-universal``), a Muon parameter without saved momentum in a checkpoint saved after
        Muon steps, or an fp32 partition of another size (an empty one: an NVMe checkpoint saved by DeepSpeed
        alone). Empty when it fits. A checkpoint without ds_muon metadata (an older ds_muon) is not checked
        (a warning says so).
    """
    saved = state_dict.get(DS_MUON_KEY)
    current = metadata(layout)
    problems: list[str] = []
    if saved is None:  # written before ds_muon saved metadata: nothing to check against
        logger.warning("ds_muon: this checkpoint has no ds_muon metadata (saved by an older ds_muon?); parameter "
                       "shapes and Muon/AdamW selection are not checked")
    elif _partition_count(state_dict, saved) != current["world_size"]:
        problems.append(f"the checkpoint was saved at data-parallel world size {saved['world_size']}, this run has "
                        f"{current['world_size']}: ZeRO partitions depend on it; convert it with "
                        f"`{CONVERT_COMMAND}` and load the result with \"checkpoint\": {{\"load_universal\": true}}")
    elif saved.get("layout", "chunked") != current.get("layout", "chunked"):
        problems.append(f"the checkpoint was saved at {stage_of(saved)}, this run is at {stage_of(current)}: their "
                        f"partitions differ; convert it with `{CONVERT_COMMAND}` and load the result with "
                        "\"checkpoint\": {\"load_universal\": true}")
    else:
        # a weights-only load takes no optimizer state, so another optimizer or other blocks do not matter
        problems = ((adam_mini_problems(saved, current) if load_optimizer_states else [])
                    or param_problems(param_table(saved), param_table(current)))
        saved_layout = [(sg["group"], [n for n, _ in sg["params"]], sg.get("offsets")) for sg in saved["sub_groups"]]
        if not problems and saved_layout != [(sg["group"], [n for n, _ in sg["params"]], sg.get("offsets"))
                                             for sg in current["sub_groups"]]:
            problems.append("the ZeRO sub-groups hold other parameters than when saved (was "
                            "zero_optimization.sub_group_size, round_robin_gradients or parameter_alignment "
                            "changed?); a universal checkpoint does not depend on them: convert with "
                            f"`{CONVERT_COMMAND}` and load with \"load_universal\": true")
        if not problems and load_optimizer_states and saved["muon_step_count"] > 0:
            inner = state_dict.get(OPTIMIZER_STATE_DICT) or state_dict.get(BASE_OPTIMIZER_STATE) or {}
            state = inner.get("state", {})
            problems = [line for sg in saved["sub_groups"]
                        if sg["use_muon"] and MOMENTUM_KEY not in state.get(sg["state_id"], {})
                        for line in no_momentum([n for n, _ in sg["params"]], saved["muon_step_count"])]
    if not problems:
        for i, saved_fp32 in enumerate(state_dict.get(FP32_FLAT_GROUPS, [])):
            want = layout.sub_groups[i].partition_numel if i < len(layout.sub_groups) else 0
            if saved_fp32.numel() != want:
                problems.append(
                    f"ZeRO sub-group {i}: the checkpoint holds {saved_fp32.numel()} fp32 elements, this run's partition "
                    f"{want}" + (": an NVMe checkpoint saved by DeepSpeed without ds_muon holds empty placeholders "
                                 "instead of the weights and optimizer state; it cannot be resumed from"
                                 if saved_fp32.numel() == 0 else ""))
    return problems
