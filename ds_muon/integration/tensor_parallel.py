"""AutoTP's layout for the owner exchange: which Muon matrices DeepSpeed split across the tensor-parallel group,
and their pieces over the tensor-parallel x data-parallel ranks (layer ``integration``; docs/parallelism_tp.md).

DeepSpeed 0.19.8's AutoTP (``tensor_parallel.autotp_size > 1``, ``DeepSpeedEngine._apply_autotp_partitioning``)
replaces each linear layer by a tensor-parallel one (``deepspeed.module_inject.layers``) that keeps the same
parameter object with its shard as data, marks it ``tensor_model_parallel`` and records how it was cut under
``deepspeed.checkpoint.constants.DS_AUTOTP_UC_META`` (``partition_dim``, ``partition_sizes``, ``logical_shape``):
column-parallel ``LinearLayer`` along dim 0 (output features), row-parallel ``LinearAllreduce`` along dim 1
(input features). Parameters AutoTP leaves whole (norms, embeddings, a row-parallel bias) are replicated on every
tensor-parallel rank with the same gradient. The groups are ``deepspeed.utils.groups``' (the engine's ``mpu``):
the tensor-parallel group, and ZeRO's data-parallel group, whose product is the world.

With ``tp_mode: "full"`` a Muon param group's exchange runs over the whole ``T x D`` world: each tensor-parallel
matrix is one slot whose pieces address its stacked form
(:func:`ds_muon.partitions.tensor_parallel_pieces`), so its owner rebuilds and orthogonalizes the full matrix;
a replicated Muon matrix is one slot per tensor-parallel rank, held by that rank's data-parallel group (each
copy gets the same update).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..partitions import Piece, TensorParallelSplit, tensor_parallel_pieces
from ..sharded.ownership import ParamInfo

__all__ = ["autotp_world", "tensor_parallel_split", "TensorParallelLayout"]

TP_ATTR = "tensor_model_parallel"  # deepspeed.module_inject.layers.DS_TENSOR_MODEL_PARALLEL


def autotp_world(module: Optional[torch.nn.Module]) -> int:
    """The tensor-parallel world size of ``module``: 1 unless AutoTP split some of its parameters (marked
    ``tensor_model_parallel``), else the size of ``deepspeed.utils.groups``' tensor-parallel group. (The groups are
    process-global and DeepSpeed asserts on reading them before AutoTP set them up, so the model is asked first.)"""
    if module is None or not any(getattr(p, TP_ATTR, False) for p in module.parameters()):
        return 1
    from deepspeed.utils import groups
    return dist.get_world_size(groups.get_tensor_model_parallel_group())


def tensor_parallel_split(param: torch.nn.Parameter, name: str) -> Optional[TensorParallelSplit]:
    """How AutoTP split ``param`` (a Muon matrix), or None when it is replicated.

    Raises:
        ConfigError: a tensor-parallel Muon parameter whose layout is not one contiguous split of a 2-D matrix
            along dim 0 or 1 (a fused QKV or gate_up layer, a conv layer, ...), naming ``tp_mode: "shard"``.
    """
    if not getattr(param, TP_ATTR, False):
        return None
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    meta = getattr(param, DS_AUTOTP_UC_META, None) or {}
    dim, sizes, shape = meta.get("partition_dim"), meta.get("partition_sizes"), meta.get("logical_shape")
    if (meta.get("sub_param_shard_widths") or meta.get("replicated") or dim not in (0, 1) or not sizes
            or not shape or len(shape) != 2):
        raise ConfigError(f"optimizer.params.tp_mode: 'full' cannot rebuild the tensor-parallel Muon matrix {name!r} "
                          f"(AutoTP layout: partition_type {meta.get('partition_type')!r}, partition_dim {dim!r}, "
                          f"sub-parameters {meta.get('sub_param_shard_widths')!r}): ds_muon reassembles contiguous "
                          "row (column-parallel) or column (row-parallel) splits of 2-D weights only; set tp_mode "
                          "'shard' to orthogonalize each shard on its own, or put the parameter on AdamW "
                          "(adamw_params)")
    return TensorParallelSplit(tuple(int(x) for x in shape), int(dim), tuple(int(x) for x in sizes))


class TensorParallelLayout:
    """The ranks of a ``T x D`` AutoTP run, for building full-matrix owner plans (``tp_mode: "full"``).

    Built on every rank (collective: one ``all_gather_object`` over the world of each rank's coordinates).

    Args:
        dp_group: ZeRO's data-parallel process group of this rank.

    Attributes:
        coords: per global rank, its ``(tensor-parallel rank, data-parallel rank)``.
        group: the exchange's process group (None: the world, whose rank index is the global rank).

    Raises:
        ConfigError: the tensor-parallel and data-parallel groups do not make up the world (another parallelism
            is combined with AutoTP).
    """

    def __init__(self, dp_group) -> None:
        from deepspeed.utils import groups
        tp_group = groups.get_tensor_model_parallel_group()
        self.tp_size, self.dp_size = dist.get_world_size(tp_group), dist.get_world_size(dp_group)
        if self.tp_size * self.dp_size != dist.get_world_size():
            raise ConfigError(f"tensor_parallel.autotp_size: {self.tp_size} x {self.dp_size} data-parallel ranks is "
                              f"not the world size {dist.get_world_size()}: ds_muon serves AutoTP combined with ZeRO "
                              "data parallelism only; remove the other parallelism or use tp_mode 'shard'")
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (dist.get_rank(tp_group), dist.get_rank(dp_group)))
        self.coords: list[tuple[int, int]] = [tuple(c) for c in coords]
        self.group = None
        self.rank = dist.get_rank()

    def infos(self, what: str, params: Sequence[tuple[str, tuple[int, ...], Optional[TensorParallelSplit],
                                                      tuple[Piece, ...]]], split_of) -> list[ParamInfo]:
        """The plan's parameters of one Muon param group over the ``T x D`` ranks. Collective (one
        ``all_gather_object`` over the world of the group's shard pieces).

        Args:
            what: how messages name the group.
            params: per parameter of the group on this rank, in its order: ``(name, shard shape, split or None,
                its pieces over this rank's data-parallel group)``.
            split_of: ``name -> declared/detected matrix view Split`` of the full matrix (or None).

        Raises:
            ConfigError: the ranks' param groups differ (names or order).
        """
        mine = [(name, shape, pieces) for name, shape, _, pieces in params]
        every: list = [None] * len(self.coords)
        dist.all_gather_object(every, mine)
        names = [n for n, _, _ in mine]
        for g, theirs in enumerate(every):
            if [n for n, _, _ in theirs] != names:
                raise ConfigError(f"ds_muon: {what} holds different Muon parameters on rank {g} than on rank "
                                  f"{self.rank} under AutoTP (the tensor-parallel ranks must hold the same model)")
        first = {t: next(g for g, c in enumerate(self.coords) if c[0] == t) for t in range(self.tp_size)}
        out = []
        for j, (name, shape, split, _) in enumerate(params):
            if split is not None:
                shard_pieces = [every[first[t]][j][2] for t in range(self.tp_size)]
                out.append(ParamInfo(name, split.shape, split.shape[0] * split.shape[1], split_of(name),
                                     tensor_parallel_pieces(split, shard_pieces, self.coords), split))
                continue
            numel = 1
            for x in shape:
                numel *= x
            for t in range(self.tp_size):  # a replicated matrix: one copy per tensor-parallel rank
                pieces = tuple(every[first[t]][j][2][d] if tt == t else Piece(0, 0, 0, 0) for tt, d in self.coords)
                out.append(ParamInfo(f"{name} (tensor-parallel rank {t})", tuple(shape), numel, split_of(name),
                                     pieces))
        return out
