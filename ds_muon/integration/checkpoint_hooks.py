"""Checkpoint hooks on a ds_muon engine (layer ``integration``): checks before every load, crash-safe saves.

Installed per engine by :mod:`ds_muon.integration.hooks` (the engine is held weakly):

* ``engine.load_checkpoint`` first checks the tag's files (:func:`ds_muon.checkpoint.files.check_tag`: integrity,
  completeness, no code in any file, the world size, universal or not), reads them weights-only
  (:func:`make_weights_only`), and loads the tag's weights for weights-only loads
  (:func:`load_weights_of_tag`);
* ``engine.save_checkpoint`` writes every file under a temporary name and ``latest`` only after every rank's
  files are in place, and a failed write (a full disk) fails the save on every rank together
  (:func:`ds_muon.integration.atomic_save.install_atomic_save`).
"""
from __future__ import annotations

import functools
import inspect
import weakref

from ..checkpoint.files import LATEST, check_tag, read_tag
from ..checkpoint.safe_load import safe_load
from .atomic_save import install_atomic_save

__all__ = ["install_load_checks", "install_atomic_save", "load_weights_of_tag", "make_weights_only"]


def install_load_checks(engine, zero3: bool = True) -> None:
    """Make ``engine.load_checkpoint`` run :func:`ds_muon.checkpoint.files.check_tag` first, and (``zero3``) load a
    tag's weights for a weights-only load (:func:`load_weights_of_tag`); on this engine only, holding it weakly.
    At ZeRO-1/2 (``zero3`` False) a weights-only load is DeepSpeed's (the module file holds the full weights in the
    model's dtype, at any world size), so its world size is not checked; integrity, layout and code are."""
    engine_ref = weakref.ref(engine)
    load = type(engine).load_checkpoint
    signature = inspect.signature(load)

    @functools.wraps(load)
    def load_checkpoint(*args, **kwargs):
        this = engine_ref()
        bound = signature.bind(this, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        weights_only = a["load_module_only"] or not a["load_optimizer_states"]
        # a ZeRO-1/2 weights-only load is DeepSpeed's: it reads the module file's full weights at any world size
        world = None if not zero3 and weights_only else this.seq_dp_world_size
        check_tag(a["load_dir"], a["tag"], bool(this.load_universal_checkpoint()), world, zero3)
        make_weights_only(this.checkpoint_engine)
        result = load(this, *args, **kwargs)
        if zero3 and weights_only and result[0] is not None and not this.load_universal_checkpoint():
            tag = a["tag"] if a["tag"] is not None else read_tag(a["load_dir"], LATEST)
            load_weights_of_tag(this, a["load_dir"], str(tag))
        return result

    engine.load_checkpoint = load_checkpoint
    install_atomic_save(engine)


def make_weights_only(ckpt_engine) -> None:
    """Make DeepSpeed's ``TorchCheckpointEngine.load`` (``torch.load(weights_only=False)`` in deepspeed 0.19.8) load
    with :func:`ds_muon.checkpoint.safe_load.safe_load` on this checkpoint engine; other checkpoint engines are left
    as they are (their files were checked by :func:`ds_muon.checkpoint.safe_load.check_files` before the load)."""
    if ckpt_engine is None or getattr(ckpt_engine, "_ds_muon_weights_only", False) \
            or type(ckpt_engine).__name__ != "TorchCheckpointEngine":
        return

    def load(path: str, map_location=None):
        return safe_load(path, map_location=map_location)

    ckpt_engine.load, ckpt_engine._ds_muon_weights_only = load, True


def load_weights_of_tag(engine, load_dir: str, tag: str) -> None:
    """Install the fp32 weights of ``load_dir/tag`` (this rank's ZeRO partitions), keeping the live
    optimizer state, loss scaler and step counts: what ``load_checkpoint(tag=..., load_optimizer_states=False)``
    and ``load_module_only=True`` must do.

    DeepSpeed 0.19.8 does neither for ZeRO-3: without the optimizer states it re-derives the fp32
    weights from the live bf16/fp16 ones (so the model keeps whatever it held, e.g. ``latest``'s weights,
    not ``tag``'s), and ``load_module_only`` loads nothing (ZeRO-3's module file holds no weights).

    Raises:
        CheckpointError: the tag does not fit the model (:func:`ds_muon.checkpoint.metadata.zero_state_dict_problems`);
            another data-parallel world size is refused before, by :func:`ds_muon.checkpoint.files.check_tag`.
    """
    opt = engine.optimizer
    live = (opt.loss_scaler, opt.dynamic_loss_scale, opt.overflow)
    engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=False)
    opt.loss_scaler, opt.dynamic_loss_scale, opt.overflow = live
