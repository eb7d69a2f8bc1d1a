"""Names shared by every layer: optimizer-state keys, parameter attributes, param-group keys.

One module so that the oracle, the sharded steps, the DeepSpeed glue and the checkpoint format
spell each name once (the NVMe swapper, the checkpoints and the universal converter all see the
same keys). Standard library only: every layer may import it (docs/design.md, "Layers").
"""
from __future__ import annotations

from typing import Any, Mapping

# ---- optimizer state keys ----------------------------------------------------------------------
#: A Muon parameter's momentum (the oracle's per-parameter state, ZeRO's per-partition state).
MOMENTUM_KEY = "momentum_buffer"
#: Adam-mini's per-block second moments: one fp32 per block, ``(n_blocks,)``.
BLOCK_STATE_KEY = "block_exp_avg_sq"
#: The oracle's (``MuonAdamW``) state-dict key for QK-clip's step count, which the ``until_step`` window counts
#: (ZeRO's is the ``step_count`` of ds_muon's checkpoint metadata).
QK_CLIP_STEPS_KEY = "ds_muon_qk_clip_steps"

# ---- parameter attributes ----------------------------------------------------------------------
#: DeepSpeed's contract: ``param.use_muon`` True/False (set by the user, or by selection).
USE_MUON_ATTR = "use_muon"
#: What selection decided for a parameter it tagged itself (so a later user change counts as explicit).
AUTO_USE_MUON_ATTR = "_ds_muon_auto"
#: The :class:`ds_muon.core.matrix.Split` selection recorded for a Muon parameter (or None).
SPLIT_ATTR = "ds_muon_split"
#: A split the user declares on a parameter (a list of row sizes or ``{"rows": [...], "cols": [...]}``).
USER_SPLIT_ATTR = "muon_split"
#: True on a norm weight or bias (Hugging Face Trainer's no-weight-decay convention), set by selection.
NO_DECAY_ATTR = "ds_muon_no_decay"
#: Elements per Adam-mini block (int), or None for per-element Adam.
BLOCK_ATTR = "ds_adam_mini_block"

# ---- param-group keys --------------------------------------------------------------------------
#: The one key that says which algorithm steps a param group.
ALGORITHM_KEY = "algorithm"
MUON = "muon"
ADAM_MINI = "adam_mini"
ADAMW = "adamw"
ALGORITHMS = (MUON, ADAM_MINI, ADAMW)


def algorithm_of(group: Mapping[str, Any]) -> str:
    """The algorithm of a param group: its ``"algorithm"`` key, or, for groups saved before that key
    existed (checkpoint format 1 as first written, :data:`ds_muon.checkpoint.metadata.METADATA_VERSION`),
    derived from ``use_muon``/``adam_mini``.

    Raises:
        ValueError: an ``"algorithm"`` value not in :data:`ALGORITHMS`.
    """
    algorithm = group.get(ALGORITHM_KEY)
    if algorithm is None:
        return MUON if group.get(USE_MUON_ATTR) else ADAM_MINI if group.get("adam_mini") else ADAMW
    if algorithm not in ALGORITHMS:
        raise ValueError(f"param group algorithm {algorithm!r} is invalid; allowed: {', '.join(ALGORITHMS)}")
    return algorithm


# ---- DeepSpeed's checkpoint file format ----------------------------------------------------------
# Keys of DeepSpeed's ZeRO checkpoint files that ds_muon's converter reads and writes, spelled here so the
# checkpoint layer needs no deepspeed import (tests/unit/test_layout.py pins them to
# deepspeed.checkpoint.constants).
FP32_FLAT_GROUPS = "fp32_flat_groups"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
# ZeRO-1/2's keys inside ``optimizer_state_dict``: the fp32 partitions (the last one without its end padding) and
# the inner optimizer's state dict
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
PARAM = "param"
PARAM_GROUPS = "param_groups"
PARTITION_COUNT = "partition_count"
LOSS_SCALER = "loss_scaler"
# DeepSpeed's ZeRO-3 optimizer file, under AutoEP (expert parallelism) only: each sub-group's partition group (the
# expert sub-groups' is the expert-data-parallel group). A literal in deepspeed/runtime/zero/stage3.py
# (``_rigid_state_dict``), not in deepspeed.checkpoint.constants; pinned by tests/unit/test_layout.py.
ZERO_PARTITION_GROUPS = "ds_zero_partition_groups"
