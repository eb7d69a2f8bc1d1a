"""The checkpoint overrides of :class:`~ds_muon.integration.zero12.MuonZero12Optimizer` (layer ``integration``).

DeepSpeed's ZeRO-1/2 optimizer saves, per rank, its fp32 partitions (``single_partition_of_fp32_groups``) and the
inner optimizer's state dict (``base_optimizer_state``: the Muon momentum, Adam moments and Adam-mini block
moments of each param group's partition), and loads them back at the same world size. This mixin adds what the
checkpoint format needs (:mod:`ds_muon.checkpoint`): ds_muon's metadata with the flat layout on every save (each
parameter's offset in its param group's flat buffer, the partition size), the fit checks before every load (on
every rank together: another world size, another stage's layout, another model or selection name the fix), and
the load of universal checkpoints (written from a ZeRO-1/2 or ZeRO-3 checkpoint by ``python -m ds_muon.checkpoint
to-universal``), which DeepSpeed's own ZeRO-1/2 universal loader cannot do for Muon: it reads the fixed keys
``fp32``/``exp_avg``/``exp_avg_sq`` (deepspeed 0.19.8, ``load_hp_checkpoint_state``).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..checkpoint.metadata import DS_MUON_KEY, SubGroupInfo, ZeroLayout, metadata, raise_on_every_rank
from ..checkpoint.safe_load import safe_load
from ..checkpoint.universal import universal_loader, universal_problems
from ..names import ADAM_MINI, BLOCK_ATTR, LOSS_SCALER, MUON, PARAM, PARAM_GROUPS
from .inner import cast_momentum_

__all__ = ["FlatCheckpointing"]


class FlatCheckpointing:
    """Checkpoint overrides of a ds_muon ``DeepSpeedZeroOptimizer`` (ZeRO-1/2) subclass (put it first in the bases).

    The host provides ``pieces`` (per param group, ``[(param, its Piece on every rank)]``), ``_algorithms``,
    ``_rank(i)``, ``_name(p)``, ``step_count``, ``muon_step_count``, ``relink_optimizer_states()``,
    ``_restore_step_counts(meta)``.
    """

    def checkpoint_layout(self) -> ZeroLayout:
        """This optimizer as the checkpoint format sees it (the same on every rank): one entry per param group."""
        groups = []
        for i, pairs in enumerate(self.pieces):
            algorithm = self._algorithms[i]
            params = tuple((self._name(p), tuple(int(d) for d in meta.shape))
                           for (p, _), meta in zip(pairs, self.round_robin_bit16_meta[i]))
            blocks = tuple(int(getattr(p, BLOCK_ATTR)) for p, _ in pairs) if algorithm == ADAM_MINI else None
            groups.append(SubGroupInfo(i, algorithm, i, params, blocks, int(self.partition_size[i]),
                                       tuple(int(o) for o in self.round_robin_bit16_offsets[i])))
        kind = self.optimizer.optimizer_type
        block_rule = self.optimizer.config.block_rule if kind == "AdamMini" else None
        world = dist.get_world_size(group=self.dp_process_group)
        return ZeroLayout(world, tuple(groups), kind, block_rule, self.muon_step_count, self.step_count, layout="flat")

    def state_dict(self):
        """DeepSpeed's ZeRO-1/2 optimizer state dict plus ds_muon's metadata under ``"ds_muon"``
        (:func:`ds_muon.checkpoint.metadata.metadata`, with the flat layout)."""
        sd = super().state_dict()
        sd[DS_MUON_KEY] = metadata(self.checkpoint_layout())
        return sd

    def load_state_dict(self, *args, **kwargs):
        """DeepSpeed's ZeRO-1/2 load (arguments passed through unchanged). At the same world size, ds_muon's fit
        checks run first (``CheckpointError`` on every rank before anything is restored); the step counts are
        restored after; universal checkpoints go to :meth:`_load_universal_checkpoint`.

        Raises:
            CheckpointError: the checkpoint was saved at another world size or ZeRO stage (naming ``python -m
                ds_muon.checkpoint to-universal``), or for another model, selection or optimizer
                (:func:`ds_muon.checkpoint.metadata.zero_state_dict_problems`).
        """
        load_optimizer_states, state_dict = self._check_fit_before_load(super().load_state_dict, args, kwargs)
        super().load_state_dict(*args, **kwargs)
        if load_optimizer_states:
            self.relink_optimizer_states()
        if state_dict is not None and load_optimizer_states:
            self._restore_step_counts(state_dict.get(DS_MUON_KEY))
        if self.step_count == 0:  # saved before any applied step: no state to link yet; link after the first one
            self._states_linked = False

    def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
        """Universal checkpoint (``"checkpoint": {"load_universal": true}``), written from ZeRO-1/2 or ZeRO-3
        files: each parameter's full tensors are cut into this rank's piece of its param group's flat partition
        (:func:`ds_muon.partitions.flat_pieces`), the fp32 partitions and (with ``load_optimizer_states``) the
        optimizer state installed, the param groups' hyperparameters (and AdamW's per-group ``step``), the loss
        scaler and the step counts restored, and the bf16/fp16 parameters refreshed from fp32 (all-gathered).

        Raises:
            CheckpointError: on every rank, when the checkpoint does not fit
                (:func:`ds_muon.checkpoint.universal.universal_problems`).
        """
        layout = self.checkpoint_layout()
        names = [[n for n, _ in sg.params] for sg in layout.sub_groups]
        header, problems = universal_problems(layout, checkpoint_folder, names, load_optimizer_states)
        raise_on_every_rank(problems, self.dp_process_group,
                            f"ds_muon: the universal checkpoint {checkpoint_folder} does not fit this model and "
                            "optimizer:")
        pieces = [[pair[1][self._rank(i)] for pair in group] for i, group in enumerate(self.pieces)]

        def slice_param(folder: str, key: str, i: int, k: int) -> torch.Tensor:
            piece = pieces[i][k]
            full = safe_load(os.path.join(folder, f"{key}.pt"))[PARAM]
            return full.reshape(-1).narrow(0, piece.start, piece.length)

        def place(i: int, k: int) -> int:
            return pieces[i][k].shard_offset

        flats = self.single_partition_of_fp32_groups
        load = universal_loader(checkpoint_folder, header, names, [int(n) for n in self.partition_size],
                                set(self.adam_mini_steps), flats[0].device if flats else torch.device("cpu"),
                                slice_param, place)
        for i, fp32 in enumerate(flats):
            flat, state = load(i)
            fp32.data.copy_(flat)
            if load_optimizer_states:
                if self._algorithms[i] == MUON:
                    cast_momentum_(state, self.optimizer.param_groups[i])
                self.optimizer.state[fp32] = state
        if load_optimizer_states:
            for group, saved in zip(self.optimizer.param_groups, header[PARAM_GROUPS]):
                group.update({k: v for k, v in saved.items()
                              if (k in group or k == "step") and k not in ("params", "momentum_dtype")})
            # the loss scaler, as DeepSpeed's loads restore it (a ZeRO-3 source has no ds_version, which
            # DeepSpeed's ZeRO-1/2 _load_global_state asserts)
            self.loss_scaler = header.get(LOSS_SCALER, self.loss_scaler)
            self.dynamic_loss_scale = header.get("dynamic_loss_scale", self.dynamic_loss_scale)
            self.overflow = header.get("overflow", self.overflow)
            self._restore_step_counts(header[DS_MUON_KEY])
            self.relink_optimizer_states()
        self.update_lp_params()
