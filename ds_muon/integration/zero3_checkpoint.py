"""The checkpoint overrides of :class:`~ds_muon.integration.zero3.MuonZeroOptimizer` (layer ``integration``).

A mixin of DeepSpeed ZeRO-3 overrides that hands the file format (:mod:`ds_muon.checkpoint`) the plain data it
needs: the optimizer's :class:`~ds_muon.checkpoint.metadata.ZeroLayout`, this rank's state dict, and a slicing
callback for universal checkpoints. It adds ds_muon's metadata to every save, runs the fit checks before every
load (on every rank together), and loads universal checkpoints with ds_muon's loader.

NVMe-swapped sub-groups: DeepSpeed 0.19.8 saves a swapped sub-group's fp32 partition and optimizer state as the
empty placeholders they are between steps (so zero_to_fp32 fails on them), copies its raw swap files next to
the checkpoint instead, and on load skips the optimizer state entirely (the state keys the swapper latched in the
saving process are unknown to a fresh one, so momentum and Adam moments are lost, and so is the Adam step).
ds_muon puts the real tensors into the ZeRO checkpoint and loads them through the swapper; the engine hook turns
the raw-file copy off (:mod:`ds_muon.integration.hooks`).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from ..checkpoint.metadata import DS_MUON_KEY, SubGroupInfo, ZeroLayout, metadata, raise_on_every_rank
from ..checkpoint.safe_load import safe_load
from ..checkpoint.universal import universal_loader, universal_problems
from ..errors import CheckpointError
from ..names import (BLOCK_ATTR, BLOCK_STATE_KEY, FP32_FLAT_GROUPS, LOSS_SCALER, MOMENTUM_KEY, OPTIMIZER_STATE_DICT,
                     PARAM, PARAM_GROUPS)
from ..partitions import chunked_pieces
from .inner import cast_momentum_

__all__ = ["ZeroCheckpointing"]


class ZeroCheckpointing:
    """Checkpoint overrides of a ds_muon ``DeepSpeedZeroOptimizer_Stage3`` subclass (put it first in the bases)."""

    def checkpoint_layout(self) -> ZeroLayout:
        """This optimizer as the checkpoint format sees it (the same on every rank)."""
        state_id = self._state_index()
        sub_groups = []
        for s, params in enumerate(self.fp16_groups):
            algorithm = self.sub_group_algorithm(s)
            blocks = tuple(int(getattr(p, BLOCK_ATTR)) for p in params) if algorithm == "adam_mini" else None
            sub_groups.append(SubGroupInfo(int(self.sub_group_to_group_id[s]), algorithm, state_id[s],
                                           tuple((self.param_names[p], tuple(int(d) for d in p.ds_shape))
                                                 for p in params), blocks,
                                           int(self.fp16_partitioned_groups_flat_numel[s])))
        kind = self.optimizer.optimizer_type
        block_rule = self.optimizer.config.block_rule if kind == "AdamMini" else None
        return ZeroLayout(int(self.partition_count), tuple(sub_groups), kind, block_rule, self.muon_step_count,
                          self.step_count)

    def _state_index(self) -> dict[int, int]:
        """``{sub_group: index}`` of each fp32 partition in the inner optimizer's ``state_dict()``:
        torch numbers state entries param group by param group, and DeepSpeed appends each sub-group's
        fp32 partition to its param group in sub-group order (``_set_fp32_optimizer_param_groups``)."""
        order = sorted(range(len(self.fp16_groups)), key=lambda i: (self.sub_group_to_group_id[i], i))
        return {i: k for k, i in enumerate(order)}

    def _rigid_state_dict(self) -> dict:
        """DeepSpeed's ZeRO-3 state dict, with the real fp32 partition and state tensors of swapped
        sub-groups (swapped in one at a time and copied to CPU memory, without writing back)."""
        self._refuse_after_swap_failure()
        sd = super()._rigid_state_dict()
        if not self.swap_optimizer:
            return sd
        index = self._state_index()
        fp32_groups = list(sd[FP32_FLAT_GROUPS])
        opt_state = sd[OPTIMIZER_STATE_DICT]["state"]
        for i in range(len(self.fp16_groups)):
            if not self._swappable_optimizer_subgroup(i):
                continue
            self._optimizer_states_and_gradient_swap_in(i)
            fp32 = self.fp32_partitioned_groups_flat[i]
            fp32_groups[i] = fp32.detach().to("cpu", copy=True)
            saved = dict(opt_state.get(index[i], {}))  # a new dict: the old one is the live state's
            for key, value in self.optimizer.state.get(fp32, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    saved[key] = value.detach().to("cpu", copy=True)
            opt_state[index[i]] = saved
            self._release_swap_buffers(i)
        self._agree_on_swap_errors("reading the optimizer state for a checkpoint")
        sd[FP32_FLAT_GROUPS] = fp32_groups
        return sd

    def _install_partitions(self, load: Callable[[int], tuple], replace_state: bool, refresh_lp: bool = True) -> None:
        """Write every sub-group's fp32 partition (and, with ``replace_state``, its optimizer state)
        from ``load``; swapped (NVMe) sub-groups go through one swap-in and one swap-out each.

        With ``replace_state`` the live state is dropped and the swapper's swapped state purged
        first: the swapper latches a sub-group's state keys whenever it looks the sub-group up and
        finds state (and would then read state files this process never wrote), so the new state is
        installed only once the sub-group's fp32 partition is resident, and the swap-out latches and
        writes it. A Muon momentum stays out of the swap with ``save_muon_momentum_buffer_in_memory``.

        Args:
            load: ``i -> (fp32, state)``, called once per sub-group in order, after its swap-in:
                ``fp32`` of shape ``(partition numel,)``; ``state`` the sub-group's new optimizer state
                dict (ignored unless ``replace_state``; empty or None installs none).
            replace_state: install the loaded state instead of keeping the live one.
            refresh_lp: also refresh the bf16/fp16 partitions (and the model's partitioned
                parameters) from fp32, as DeepSpeed's loads do.
        """
        n = len(self.fp16_groups)
        swapped = [bool(self._swappable_optimizer_subgroup(i)) for i in range(n)]
        if replace_state:
            for i in range(n):
                self.optimizer.state.pop(self.fp32_partitioned_groups_flat[i], None)
            if self.swap_optimizer:
                self.optimizer_swapper.purge_state()
        refresh_swapper = self.swap_optimizer and refresh_lp
        timer_names: set = set()
        if refresh_swapper:
            self._partition_all_parameters()
        for i in range(n):
            fp32 = self.fp32_partitioned_groups_flat[i]
            if swapped[i]:
                self._prepare_sub_group(i, timer_names)  # with replace_state: only the fp32 partition
            flat, state = load(i)
            if replace_state and state:
                if i in self.muon_steps:
                    cast_momentum_(state, self._param_group(i))
                if self._momentum_in_memory and MOMENTUM_KEY in state:
                    state[MOMENTUM_KEY].swappable = False
                if BLOCK_STATE_KEY in state:  # Adam-mini's per-block second moments: never swapped
                    state[BLOCK_STATE_KEY].swappable = False
                self.optimizer.state[fp32] = state
            fp32.data.copy_(flat)
            if refresh_lp:
                self._reassign_or_swap_out_partitioned_parameters(i)  # bf16/fp16 partition <- fp32
            if swapped[i]:
                self._release_sub_group(i, timer_names)  # writes fp32 (+ state) to NVMe
        if refresh_swapper:
            self._post_step(timer_names)
        self._agree_on_swap_errors("installing loaded optimizer partitions")

    def _rigid_load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """DeepSpeed's load without NVMe; with it, the checkpoint's fp32 partitions and state go
        through the swapper (:meth:`_install_partitions`). The fp32 partition sizes were checked by
        :func:`ds_muon.checkpoint.metadata.zero_state_dict_problems` before (an NVMe checkpoint written by
        DeepSpeed alone holds empty ones)."""
        if not self.swap_optimizer:
            return super()._rigid_load_state_dict(state_dict, load_optimizer_states)
        self.loss_scaler = state_dict[LOSS_SCALER]
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        states = None
        if load_optimizer_states:
            self._set_fp32_optimizer_param_groups()
            self.optimizer.load_state_dict(state_dict[OPTIMIZER_STATE_DICT])
            self._clear_fp32_optimizer_param_groups()
            states = [self.optimizer.state.get(fp32, {}) for fp32 in self.fp32_partitioned_groups_flat]
        saved_fp32 = state_dict[FP32_FLAT_GROUPS]
        self._install_partitions(lambda i: (saved_fp32[i], states[i] if states else None),
                                 replace_state=load_optimizer_states)

    def _restore_from_bit16_weights(self) -> None:
        """fp32 partitions <- bf16/fp16 ones (DeepSpeed's), through the swapper for swapped sub-groups."""
        if not self.swap_optimizer:
            return super()._restore_from_bit16_weights()
        self._install_partitions(lambda i: (self.fp16_partitioned_groups_flat[i], None), replace_state=False,
                                 refresh_lp=False)

    def state_dict(self):
        """DeepSpeed's ZeRO-3 optimizer state dict plus ds_muon's metadata under ``"ds_muon"``
        (:func:`ds_muon.checkpoint.metadata.metadata`: parameter names, shapes, algorithms, sub-group layout,
        world size, step counts)."""
        sd = super().state_dict()
        sd[DS_MUON_KEY] = metadata(self.checkpoint_layout())
        return sd

    def load_state_dict(self, *args, **kwargs):
        """DeepSpeed's ZeRO-3 load (arguments passed through unchanged). At the same world size, ds_muon's fit
        checks run first (``CheckpointError`` on every rank before anything is restored) and the step counts are
        restored after; universal checkpoints go to :meth:`_load_universal_checkpoint`."""
        load_optimizer_states, state_dict = self._check_fit_before_load(super().load_state_dict, args, kwargs)
        super().load_state_dict(*args, **kwargs)
        if state_dict is not None and load_optimizer_states:
            self._restore_step_counts(state_dict.get(DS_MUON_KEY))

    def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
        """Universal checkpoint (``"checkpoint": {"load_universal": true}``): ds_muon's loader, which knows Muon's
        ``momentum_buffer`` and Adam-mini's ``block_exp_avg_sq`` (:mod:`ds_muon.checkpoint.universal`); weights
        only (``load_optimizer_states=False``): DeepSpeed's, after ds_muon's checks.

        For each ZeRO sub-group, each parameter's full tensors are cut into this rank's partition by DeepSpeed's
        ``load_hp_checkpoint_state`` and concatenated in the sub-group's order; then the param groups'
        hyperparameters (keys both sides have), the loss scaler and the step counts are restored, and the model's
        partitions are refreshed from fp32. Under NVMe each sub-group's loaded partition and state go through one
        swap-in and swap-out (the Muon momentum stays in memory with ``save_muon_momentum_buffer_in_memory``).

        Raises:
            CheckpointError: on every rank, when the checkpoint does not fit
                (:func:`ds_muon.checkpoint.universal.universal_problems`); weights only under NVMe offload.
        """
        if self.swap_optimizer and not load_optimizer_states:
            raise CheckpointError("loading only the weights of a universal checkpoint (load_module_only / "
                                  "load_optimizer_states=False) is not supported with NVMe optimizer offload: "
                                  "DeepSpeed's weights-only loader writes into swapped-out partitions; load the "
                                  "optimizer states too, or load without NVMe offload")
        names = [[self.param_names[p] for p in params] for params in self.fp16_groups]
        header, problems = universal_problems(self.checkpoint_layout(), checkpoint_folder, names, load_optimizer_states)
        raise_on_every_rank(problems, self.dp_process_group,
                            f"ds_muon: the universal checkpoint {checkpoint_folder} does not fit this model and "
                            "optimizer:")
        if not load_optimizer_states:
            return super()._load_universal_checkpoint(checkpoint_folder, load_optimizer_states, load_from_fp32_weights)
        self._load_global_state_stage3(header)
        load = universal_loader(
            checkpoint_folder, header, names, [int(n) for n in self.fp16_partitioned_groups_flat_numel],
            set(self.adam_mini_steps), self.fp32_partitioned_groups_flat[0].device if self.fp16_groups else "cpu",
            self._slice_param)
        self._install_partitions(load, replace_state=True)
        for group, saved_group in zip(self.optimizer.param_groups, header[PARAM_GROUPS]):
            group.update({k: v for k, v in saved_group.items() if k in group and k not in ("params", "momentum_dtype")})
        self._restore_step_counts(header[DS_MUON_KEY])

    def _slice_param(self, folder: str, key: str, s: int, k: int) -> torch.Tensor:
        """This rank's ZeRO-3 chunk of parameter ``k`` of sub-group ``s`` from its universal folder: the full tensor
        ``folder/<key>.pt`` read weights-only (:func:`ds_muon.checkpoint.safe_load.safe_load`), flattened, and cut
        as ZeRO-3 partitions it over the parameter's partition group (:func:`ds_muon.partitions.chunked_pieces`:
        ``ceil(numel / W)`` elements, zero padded past ``numel``); on the CPU, in the saved dtype."""
        param = self.fp16_groups[s][k]
        group = self._get_param_partition_group(param)
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        saved = safe_load(os.path.join(folder, f"{key}.pt"))
        full = (saved[PARAM] if isinstance(saved, dict) else saved).reshape(-1)
        piece = chunked_pieces(full.numel(), world, 0)[rank]
        out = torch.zeros(piece.sent, dtype=full.dtype)
        out[:piece.length].copy_(full.narrow(0, piece.start, piece.length))
        return out
