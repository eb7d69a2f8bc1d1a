"""``ds_muon.initialize`` and ``ds_muon.enable()``: routing DeepSpeed's ``"Muon"`` to ds_muon (layer ``integration``).

DeepSpeed hooks used (checked against deepspeed 0.19.8; docs/design.md, "Where DeepSpeed is hooked"):

* ``deepspeed.set_optimizer_flags(config, model)`` tags ``param.use_muon`` before the engine is
  built, overwriting any user tag. Replaced (for the configs ds_muon serves only) by ds_muon's validation
  (:func:`ds_muon.integration.validation.validate`, once per ``initialize``; the result rides on DeepSpeed's
  config object) and :func:`ds_muon.model.selection.tag_model`, which respects explicit user tags. It runs
  before the engine exists, so a bad config fails before any accelerator memory is allocated. Under AutoEP
  DeepSpeed calls it again after swapping the MoE blocks (so the swapped parameters get ds_muon's tags); the first
  call refuses AutoEP with a transformers DeepSpeed's AutoEP cannot use
  (:func:`ds_muon.integration.autoep.transformers_problem`).
* ``DeepSpeedEngine._configure_basic_optimizer`` builds the inner optimizer from the config.
  For ``"Muon"`` ds_muon builds :class:`~ds_muon.integration.inner.ZeroMuonInner` (not DeepSpeed's
  ``MuonWithAuxAdam``, so the built-in ZeRO-3 Muon path stays off; at stages 1/2 ds_muon's ZeRO optimizer keeps
  DeepSpeed's own Muon path off: :class:`~ds_muon.integration.builtin_muon.BuiltinMuonSwitch`), for ``"AdamMini"`` :class:`~ds_muon.integration.inner.ZeroAdamMiniInner`.
* ``DeepSpeedEngine._configure_zero_optimizer`` builds the ZeRO optimizer: at stage 3 from
  ``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3`` (imported function-locally), at stages 1/2
  from ``deepspeed.runtime.engine.DeepSpeedZeroOptimizer``. For the duration of that call only, and only when
  the inner optimizer is ds_muon's, that name is replaced by :class:`~ds_muon.integration.zero3.MuonZeroOptimizer`
  or :class:`~ds_muon.integration.zero12.MuonZero12Optimizer`. The engine it builds gets per-instance
  ``load_checkpoint``/``save_checkpoint`` wrappers (:mod:`ds_muon.integration.checkpoint_hooks`).
* ``DeepSpeedEngine._do_optimizer_sanity_check`` decides, for the basic optimizer, which wrapper DeepSpeed builds
  and asserts ``zero_allow_untested_optimizer`` for an unlisted type under ZeRO. Before it, a framework's own Muon
  object passed as ``optimizer=`` (:func:`~ds_muon.integration.validation.client_muon_problem`) is refused with a
  :class:`~ds_muon.errors.ConfigError` naming the config to write, with or without that key.
* ``DeepSpeedEngine._scheduler_from_config`` builds the config's ``scheduler``. On a ds_muon
  optimizer, a scheduler that writes one lr into every param group is wrapped in
  :class:`~ds_muon.integration.schedulers.GroupRatioScheduler` (its value is the Muon lr; each group keeps its
  ratio to it).

Non-Muon configs pass through all five untouched (but for the refusal of a client Muon object). Importing ds_muon
patches nothing.

The zero-code hand-over: with ds_muon activated only by the start-up hook (installed, ``DS_MUON`` unset; no
``ds_muon.initialize``/``enable()`` in the script), a ``"Muon"`` config in a mode ds_muon does not serve
(:func:`ds_muon.config.unserved_modes`: ZeRO stage 0, ...; or an engine with an ``mpu`` that brings tensor or
pipeline parallelism, DeepSpeed's native MoE layers, or AutoEP with sequence parallelism) goes to DeepSpeed's built-in Muon exactly as ``DS_MUON=0`` would, with one rank-0 line
(:data:`HANDOVER_NOTICE`). Through ``ds_muon.initialize`` or ``enable()`` the same modes are a
:class:`~ds_muon.errors.ConfigError` naming the fix.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import warnings
import weakref
from typing import Any, Iterator, Optional

import deepspeed
import deepspeed.runtime.engine as ds_engine
import deepspeed.runtime.zero.stage3 as ds_stage3
import deepspeed.runtime.config as ds_runtime_config
import deepspeed.runtime.zero.utils as ds_zero_utils
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger as ds_logger

from ..config import MUON, load_ds_config, optimizer_kind, unserved_modes
from ..config.sections import deepspeed_version
from ..errors import ConfigError
from ..import_hooks import after_import
from ..model.adam_mini_blocks import adam_mini_param_groups, adam_mini_plan, adam_mini_summary
from ..model.attention import FALCON_MODULE
from ..model.param_groups import check_zero3_parameters, split_param_groups
from ..model.selection import NO_MUON_WARNING, SelectionRules, tag_model
from .autoep import engine_problem, transformers_problem
from .checkpoint_hooks import install_load_checks
from .deepspeed_version import require_supported_deepspeed
from .frameworks import ZERO_STAGE_FIX, detect_framework, for_framework
from .inner import DsMuonInner, ZeroAdamMiniInner, ZeroMuonInner
from .parallelism import mpu_problem, qk_clip_sp_problem, sequence_parallel_size
from .schedulers import GroupRatioScheduler, broadcasts_one_lr
from .validation import client_muon_problem, hand_over, is_parsed, parsed_config, validated_once
from .zero12 import MuonZero12Optimizer
from .overlap import overlap_reduce_bucket_size
from .zero3 import MuonZeroOptimizer

#: DeepSpeed's lower-cased name of the "AdamMini" optimizer type (its sanity check accepts only names it knows).
ADAM_MINI_TYPE = "adammini"

AUTO_NOTICE = ("ds_muon is active: \"type\": \"Muon\" in this DeepSpeed config runs ds_muon's ZeRO Muon "
               "(activated automatically because ds_muon is installed). Set DS_MUON=0 to use DeepSpeed's "
               "built-in Muon instead.")
HANDOVER_NOTICE = ("ds_muon: this \"type\": \"Muon\" config runs DeepSpeed's built-in Muon, exactly as with DS_MUON=0, "
                   "because ds_muon does not serve it: {reasons}. (ds_muon was activated automatically because it is "
                   "installed; set DS_MUON=0 to silence this line; through ds_muon.initialize this is an error.)")
#: The inner optimizers ds_muon builds (DeepSpeed asks for zero_allow_untested_optimizer for any other type).
INNER_TYPES = (ZeroMuonInner, ZeroAdamMiniInner)


class _Patches:
    """The DeepSpeed names ds_muon replaces while it is enabled, and who enabled it.

    Attributes:
        lock: held while patches change, and while a ZeRO optimizer is built with a swapped class name.
        depth: nesting of :func:`enable`/:func:`disable`; the first enable installs every patch, the last
            disable restores DeepSpeed exactly as it was.
        auto: the start-up hook holds one level (:func:`auto_enable`); released with the last level.
        auto_notice_done: :data:`AUTO_NOTICE` was logged (once per process).

    Args:
        replaced: ``(owner, attribute, replacement)``: each attribute is set to its replacement.
        listed: ``(module, list attribute, entries)``: each entry is appended to the list unless present (and
            removed again by the last disable).
    """

    def __init__(self, replaced: tuple, listed: tuple) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.auto = False
        self.auto_notice_done = False
        self._replaced, self._listed = replaced, listed
        self._originals: dict[str, Any] = {}
        self._added: list[tuple[list, Any]] = []  # (registry, entry) appended by enable, removed by the last disable

    def original(self, name: str) -> Any:
        """DeepSpeed's own value of the replaced attribute ``name`` (while enabled).

        Raises:
            KeyError: ds_muon is not enabled.
        """
        return self._originals[name]

    def may_hand_over(self) -> bool:
        """Only the start-up hook enabled ds_muon (not ``ds_muon.initialize`` or the script's ``enable()``)."""
        return self.auto and self.depth == 1

    def take_auto_notice(self) -> bool:
        """True once per process, when only the start-up hook enabled ds_muon: log :data:`AUTO_NOTICE` now."""
        if not self.may_hand_over() or self.auto_notice_done:
            return False
        self.auto_notice_done = True
        return True

    def hold_auto(self) -> bool:
        """Mark the start-up hook's level; False when it is held already (then nothing is to enable)."""
        with self.lock:
            if self.auto:
                return False
            self.auto = True
            return True

    def enable(self) -> None:
        """One level more; the first installs every patch."""
        with self.lock:
            if self.depth == 0:
                for owner, name, replacement in self._replaced:
                    self._originals[name] = getattr(owner, name)
                    setattr(owner, name, replacement)
                for module, name, entries in self._listed:
                    registry = getattr(module, name)
                    for e in entries:
                        if e not in registry:
                            registry.append(e)
                            self._added.append((registry, e))
            self.depth += 1

    def disable(self) -> None:
        """One level less (none left: nothing); the last restores every original and releases ``auto``."""
        with self.lock:
            if self.depth == 0:
                return
            self.depth -= 1
            if self.depth > 0:
                return
            for owner, name, _ in self._replaced:
                setattr(owner, name, self._originals.pop(name))
            for registry, e in self._added:
                if e in registry:
                    registry.remove(e)
            self._added.clear()
            self.auto = False


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _hand_over(config_class, reasons: list[str]) -> None:
    hand_over(config_class)
    if _is_rank0():
        ds_logger.warning(HANDOVER_NOTICE.format(reasons="; ".join(reasons)))


def _handover_reasons(config_class) -> list[str]:
    """Why a ``"Muon"`` config goes to DeepSpeed's built-in under zero-code activation
    (:func:`ds_muon.config.unserved_modes`), or ``[]``: always ``[]`` when the script enabled ds_muon itself
    or the config was already validated (``ds_muon.initialize``)."""
    params = getattr(config_class, "_param_dict", None)
    if not (_PATCHES.may_hand_over() and not is_parsed(config_class) and isinstance(params, dict)
            and optimizer_kind(params) == MUON):
        return []
    return unserved_modes(params)


def _parsed_config_naming_the_fix(config_class):
    """:func:`ds_muon.integration.validation.parsed_config`; its :class:`~ds_muon.errors.ConfigError` gets one
    line per way out appended: where the detected framework sets the ZeRO stage, and ``DS_MUON=0`` when only
    the start-up hook enabled ds_muon."""
    try:
        return parsed_config(config_class)
    except ConfigError as err:
        notes = []
        if any(p.startswith("zero_optimization.stage") for p in err.problems):  # where to set it depends on
            framework = detect_framework()                                        # who builds the engine
            notes.append(f"for this {framework} setup: {for_framework(ZERO_STAGE_FIX, framework)}")
        if _PATCHES.may_hand_over():
            notes.append("ds_muon was activated automatically because it is installed; set DS_MUON=0 to use "
                         "DeepSpeed's built-in Muon instead")
        if notes:
            err.args = ("\n".join([str(err)] + [f"({n})" for n in notes]),) + err.args[1:]
        raise


def _check_model(config_class, model) -> None:
    """Refusals about the model before DeepSpeed sees it: AutoEP with a transformers DeepSpeed's AutoEP cannot use
    (whatever the optimizer: no hand-over), 0-D or empty parameters (a clear error before DeepSpeed's own)."""
    autoep = transformers_problem(config_class, model)
    if autoep is not None:
        raise ConfigError(autoep)
    check_zero3_parameters(model)


def _log_adam_mini_plan(model, cfg) -> None:
    """Rank 0 logs Adam-mini's block plan of ``model``."""
    if _is_rank0():
        log_info(adam_mini_summary(adam_mini_plan(model, cfg.params.block_rule, cfg.params.decay_norms_and_biases)))


def _tag_and_log_selection(model, cfg) -> None:
    """Tag ``param.use_muon`` (:func:`ds_muon.model.selection.tag_model`, explicit user tags kept); rank 0 logs the
    split summary on DeepSpeed's logger (where DeepSpeed's start-up lines show) and warns when no trainable
    parameter uses Muon."""
    selection = tag_model(model, SelectionRules.from_params(cfg.params), log=False)
    if not _is_rank0():
        return
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    log_info(selection.summary(frozen))
    if not any(u for n, u in selection.use_muon.items() if n not in frozen):
        ds_logger.warning(NO_MUON_WARNING)


def _set_optimizer_flags(config_class, model) -> None:
    """Replaces ``deepspeed.set_optimizer_flags`` (module docstring): hand over, or validate, check the model and
    tag it with ds_muon's selection; configs that are not ds_muon's go to DeepSpeed's."""
    reasons = _handover_reasons(config_class)
    if reasons:
        _hand_over(config_class, reasons)
        return _PATCHES.original("set_optimizer_flags")(config_class, model)
    cfg = _parsed_config_naming_the_fix(config_class)
    if cfg is None:
        return _PATCHES.original("set_optimizer_flags")(config_class, model)
    _check_model(config_class, model)
    if not cfg.is_muon:
        _log_adam_mini_plan(model, cfg)
        return _PATCHES.original("set_optimizer_flags")(config_class, model)
    if _PATCHES.take_auto_notice() and _is_rank0():
        ds_logger.warning(AUTO_NOTICE)
    _tag_and_log_selection(model, cfg)


def log_info(message: str) -> None:
    """Log ``message`` at INFO on DeepSpeed's logger, shown whenever that logger's level allows INFO.

    DeepSpeed's stdout handler is created at WARNING and stays there when only the logger's level
    is lowered, which is what HF Trainer's ``log_level="info"`` (``ds_logger.setLevel``) and a plain
    ``logging.getLogger("DeepSpeed").setLevel(logging.INFO)`` do. The record is therefore handed to
    DeepSpeed's handlers directly once the logger itself is enabled for INFO (their filters and
    formatters still apply); ``deepspeed.utils.logging.set_log_level_from_string("info")`` works too.
    """
    if not ds_logger.isEnabledFor(logging.INFO):
        return
    fn, lno, func, _ = ds_logger.findCaller(False, 2)
    record = ds_logger.makeRecord(ds_logger.name, logging.INFO, fn, lno, message, (), None, func)
    if not ds_logger.handlers:  # someone removed DeepSpeed's handler: fall back to the usual path
        ds_logger.handle(record)
    for handler in ds_logger.handlers:
        handler.handle(record)


def _autotp_mpu(engine: DeepSpeedEngine) -> bool:
    """The engine's ``mpu`` is the one AutoTP sets (``tensor_parallel.autotp_size > 1``: DeepSpeed 0.19.8's
    ``_configure_tensor_parallel_states`` makes ``deepspeed.utils.groups`` the mpu), which ds_muon serves at ZeRO
    stages 1/2 (:mod:`ds_muon.integration.tensor_parallel`)."""
    from deepspeed.utils import groups
    return engine.mpu is groups and engine.autotp_size() > 1


def _engine_problem(engine: DeepSpeedEngine) -> tuple[Optional[str], bool]:
    """What ds_muon cannot serve about this engine (its config served), and whether DeepSpeed's built-in Muon
    could: ``(message naming the fix, built-in could)``, or ``(None, False)``.

    * an ``mpu`` with tensor or pipeline parallelism (:func:`ds_muon.integration.parallelism.mpu_problem`), other
      than AutoTP's own (served at stages 1/2: docs/parallelism_tp.md): Muon must orthogonalize whole matrices,
      not tensor-parallel slices (an mpu with sequence parallelism only, as DeepSpeed-Ulysses passes, is served:
      docs/parallelism.md);
    * DeepSpeed's native MoE layers (``deepspeed.moe.layer.MoE``): at stage 3 DeepSpeed itself refuses them
      (deepspeed 0.19.8, ``DeepSpeedEngine._validate_zero3_moe_compatibility``: "Native DeepSpeed MoE is not
      supported with ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2."); at stages 1/2 their expert
      parameters are partitioned over the expert-data-parallel group, which ds_muon has not parity-tested;
    * AutoEP layers (``expert_parallel``) are served (:mod:`ds_muon.integration.autoep`), except with sequence
      parallelism (:func:`ds_muon.integration.autoep.engine_problem`: not parity-tested).
    """
    mpu = None if _autotp_mpu(engine) else mpu_problem(engine.mpu)
    if mpu is not None:
        return mpu, True
    if not engine.has_moe_layers:
        return None, False
    from deepspeed.moe.layer import MoE
    native = [name for name, m in engine.module.named_modules() if isinstance(m, MoE)]
    use_instead = "Use stacked expert weights instead (e.g. a Hugging Face MoE model: each expert is a Muon matrix)"
    if native and engine.zero_optimization_stage() == 3:
        return (f"the model holds DeepSpeed's native MoE layers ({native[0]!r}{', ...' if len(native) > 1 else ''}), "
                f"which DeepSpeed {deepspeed_version()} does not support with ZeRO stage 3 (\"Native DeepSpeed MoE is "
                f"not supported with ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2.\"). {use_instead}", False)
    if native:
        return (f"the model holds DeepSpeed's native MoE layers ({native[0]!r}{', ...' if len(native) > 1 else ''}), "
                "whose expert-parallel partitions ds_muon does not serve yet (not parity-tested). "
                f"{use_instead}", True)
    autoep = engine_problem(sequence_parallel_size())
    return (autoep, True) if autoep is not None else (None, False)


def _configure_basic_optimizer(self: DeepSpeedEngine, model_parameters):
    cfg = parsed_config(self._config)
    if cfg is None:
        return _PATCHES.original("_configure_basic_optimizer")(self, model_parameters)
    problem, builtin_could = _engine_problem(self)
    if problem is not None:
        if builtin_could and cfg.is_muon and _PATCHES.may_hand_over():
            _hand_over(self._config, [problem])
            _PATCHES.original("set_optimizer_flags")(self._config, self.module)  # DeepSpeed's own use_muon tags
            return _PATCHES.original("_configure_basic_optimizer")(self, model_parameters)
        raise ConfigError(problem)
    qk_sp = qk_clip_sp_problem(cfg.is_muon and cfg.params.qk_clip.enabled, sequence_parallel_size())
    if qk_sp is not None:  # the built-in has no QK-clip: no hand-over
        raise ConfigError(qk_sp)
    # DeepSpeed's own choice of AdamW class: torch.optim.AdamW (torch_adam, foreach), else FusedAdam, or
    # DeepSpeedCPUAdam under optimizer offload.
    adam_cls, adam_kwargs = self.get_optimizer_configuration(cfg.params.adamw_implementation(), True)

    def adamw_factory(adam_groups: list[dict]):
        return adam_cls(adam_groups, **adam_kwargs)

    if not cfg.is_muon:  # AdamMini: blocks from the engine's module
        groups = adam_mini_param_groups(self.module, cfg.params.group_defaults(), cfg.params.block_rule,
                                        cfg.params.decay_norms_and_biases)
        return ZeroAdamMiniInner(groups, adamw_factory, cfg.params)
    groups = split_param_groups(model_parameters, cfg.params.muon_group_defaults(), cfg.params.adamw_group_defaults(),
                                decay_norms_and_biases=cfg.params.decay_norms_and_biases)
    return ZeroMuonInner(groups, adamw_factory, cfg.params)


def _do_optimizer_sanity_check(self: DeepSpeedEngine, basic_optimizer):
    # a framework's own Muon object under ZeRO: refused here, before DeepSpeed's "untested ZeRO Optimizer" assertion
    # (so with or without zero_allow_untested_optimizer) and before any partitioning, not at step 1
    if self.zero_optimization():
        problem = client_muon_problem(basic_optimizer, self.zero_optimization_stage())
        if problem is not None:
            raise ConfigError(problem)
    return _PATCHES.original("_do_optimizer_sanity_check")(self, basic_optimizer)


def _overlap_bucket(engine: DeepSpeedEngine, optimizer: DsMuonInner, stage: int) -> Optional[int]:
    """Where the overlapped Muon step will run and the config leaves ``zero_optimization.reduce_bucket_size`` unset,
    the ZeRO optimizer gets ds_muon's smaller bucket (:func:`~ds_muon.integration.overlap.overlap_reduce_bucket_size`;
    ``engine.zero_reduce_bucket_size()`` then returns it). Returns the value it replaced (elements), or None."""
    zero_config = engine._config.zero_config
    size = overlap_reduce_bucket_size(zero_config, getattr(optimizer, "config", None), stage,
                                      get_accelerator().device_name(), dist.get_world_size())
    if size is None:
        return None
    replaced = int(zero_config.reduce_bucket_size)
    zero_config.reduce_bucket_size = size
    return replaced


def _say_overlap_bucket(engine: DeepSpeedEngine, zero_optimizer, replaced: Optional[int]) -> None:
    """Once on rank 0, after the ZeRO optimizer is built: the reduce bucket ds_muon chose, and whether the overlapped
    step it was chosen for runs (it may not: no Muon sub-group, or expert-parallel exchange groups at W >= 2)."""
    if replaced is None or dist.get_rank() != 0:
        return
    size = engine.zero_reduce_bucket_size()
    if getattr(zero_optimizer, "speculative", None) is not None:
        why = "so that the overlapped Muon step (optimizer.params.overlap_backward) starts early in backward"
    else:
        why = ("for the overlapped Muon step (optimizer.params.overlap_backward), which does not run in this job "
               "(docs/design.md, 'The overlapped step')")
    ds_logger.info(f"ds_muon: zero_optimization.reduce_bucket_size is not set; using {size:.0e} elements instead of "
                   f"DeepSpeed's default {replaced:.0e} {why}; set the key to choose another value")


def _configure_zero_optimizer(self: DeepSpeedEngine, optimizer):
    if not isinstance(optimizer, DsMuonInner):
        return _PATCHES.original("_configure_zero_optimizer")(self, optimizer)
    stage = self.zero_optimization_stage()
    if stage not in (1, 2, 3):  # the config checks keep stage 0 away; DeepSpeed calls this for ZeRO only
        raise ConfigError(f"zero_optimization.stage is {stage}; ds_muon serves ZeRO stages 1, 2 and 3")
    if stage == 3 and self.super_offload():  # DeepSpeed builds SuperOffload at stage 3 only
        raise ConfigError("zero_optimization.super_offload is not supported by ds_muon; turn it off")
    replaced_bucket = _overlap_bucket(self, optimizer, stage)
    # Held under the lock: another thread's non-Muon initialize must not see the swapped class.
    if stage == 3:
        with _PATCHES.lock, _swapped(ds_stage3, "DeepSpeedZeroOptimizer_Stage3", MuonZeroOptimizer):
            zero_optimizer = _PATCHES.original("_configure_zero_optimizer")(self, optimizer)
        # MuonZeroOptimizer's ZeRO checkpoint holds the real tensors of NVMe-swapped sub-groups and loads
        # them through the swapper, so the engine's NVMe special case (copy the raw swap files, skip the
        # optimizer-state load) is turned off for this engine; it only guards checkpoint save/load.
        self.zero_nvme_offload_optimizer = lambda: False
    else:
        def zero12(*args, **kwargs):  # DeepSpeed's ZeRO-1/2 optimizer is not given the module; ds_muon's needs it
            return MuonZero12Optimizer(*args, module=self.module, **kwargs)

        with _PATCHES.lock, _swapped(ds_engine, "DeepSpeedZeroOptimizer", zero12):
            zero_optimizer = _PATCHES.original("_configure_zero_optimizer")(self, optimizer)
    _say_overlap_bucket(self, zero_optimizer, replaced_bucket)
    if self.monitor.enabled:  # per-step Muon figures go to DeepSpeed's own monitor, not to a logger of ours
        engine = weakref.ref(self)

        def samples_after_this_step() -> int | None:  # the engine adds the batch after optimizer.step()
            e = engine()
            return None if e is None else e.global_samples + e.train_batch_size()

        zero_optimizer.attach_monitor(self.monitor, samples_after_this_step)
    # clear errors for checkpoints that do not fit, crash-safe saves (ds_muon.integration.checkpoint_hooks)
    install_load_checks(self, zero3=stage == 3)
    return zero_optimizer


def _scheduler_from_config(self: DeepSpeedEngine, optimizer):
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, ZeroMuonInner) or not broadcasts_one_lr(self.scheduler_name(), self.scheduler_params()):
        return _PATCHES.original("_scheduler_from_config")(self, optimizer)
    muon_lr = inner.config.muon_group_defaults()["lr"]
    ratios = [group["lr"] / muon_lr for group in inner.param_groups]  # before the scheduler writes any
    return GroupRatioScheduler(_PATCHES.original("_scheduler_from_config")(self, optimizer), inner, ratios)


@contextlib.contextmanager
def _swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _register_attention() -> None:
    """:func:`ds_muon.model.hf_attention.register_attention`, or a warning: it runs inside the user's transformers import."""
    try:
        from ..model.hf_attention import register_attention
        register_attention()
    except ImportError as err:  # a transformers without AttentionInterface / AttentionMaskInterface (< 4.48)
        ds_logger.info(f"ds_muon: attn_implementation='ds_muon_sdpa' not registered ({err})")
    except Exception as err:  # never break the user's `import transformers...`
        warnings.warn(f"ds_muon: could not register attn_implementation='ds_muon_sdpa' ({type(err).__name__}: "
                      f"{err}); call ds_muon.register_attention() to see the full error", RuntimeWarning,
                      stacklevel=2)


def _guard_falcon() -> None:
    """:func:`ds_muon.model.hf_attention.guard_falcon`, right after Falcon's modeling file is imported (a clear
    error for attn_implementation='ds_muon_sdpa' there); never raises (it runs inside the user's import)."""
    try:
        from ..model.hf_attention import guard_falcon
        guard_falcon()
    except Exception as err:  # noqa: BLE001 - never break the user's import
        ds_logger.info(f"ds_muon: Falcon's attention-class table not guarded ({type(err).__name__}: {err})")


def enable() -> None:
    """From now on, ``deepspeed.initialize`` with optimizer ``"Muon"`` (or ``"AdamMini"``) at ZeRO stage 1, 2 or 3
    uses ds_muon.

    For frameworks that call ``deepspeed.initialize`` themselves (HF Trainer, Accelerate). Other
    configs are untouched. Calls nest: each ``enable()`` needs its ``disable()``. Raises
    :class:`~ds_muon.errors.DeepSpeedVersionError` (patching nothing) where the installed DeepSpeed is outside
    :data:`ds_muon.errors.SUPPORTED_DEEPSPEED`. Also registers
    ``attn_implementation="ds_muon_sdpa"`` (:func:`ds_muon.model.hf_attention.register_attention`; not undone
    by :func:`disable`): at once when transformers' modeling code (``transformers.modeling_utils``) is
    already imported, else right after its import. ``enable()`` never imports transformers itself
    (``import deepspeed`` runs it, from the start-up hook).
    """
    require_supported_deepspeed()  # DeepSpeedVersionError naming the supported range, before anything is patched
    after_import("transformers.modeling_utils", _register_attention)
    after_import(FALCON_MODULE, _guard_falcon)
    _PATCHES.enable()


def disable() -> None:
    """Undo one :func:`enable`; the last one restores DeepSpeed exactly as it was."""
    _PATCHES.disable()


def auto_enable() -> None:
    """:func:`enable` once, from the start-up hook (see :mod:`ds_muon._autoload`).

    Rank 0 then logs :data:`AUTO_NOTICE` (at WARNING, so it shows at DeepSpeed's default level)
    the first time a Muon config is built. Idempotent while its level is held; explicit
    :func:`enable`/:func:`disable` pairs nest on top of it, and the :func:`disable` that restores DeepSpeed
    releases it.
    """
    with _PATCHES.lock:
        if _PATCHES.hold_auto():
            enable()


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _PATCHES.depth > 0


@contextlib.contextmanager
def enable_scope() -> Iterator[None]:
    """``with ds_muon.enable_scope(): ...`` -- :func:`enable` for the duration of the block (:func:`disable` at its
    end, also on an exception); nests like :func:`enable`. Whether ds_muon is enabled: :func:`is_enabled`."""
    enable()
    try:
        yield
    finally:
        disable()


def enabled() -> contextlib.AbstractContextManager:
    """Deprecated alias of :func:`enable_scope` (its name read as a predicate; the predicate is :func:`is_enabled`).

    Warns with a ``DeprecationWarning`` and returns :func:`enable_scope`'s context manager."""
    warnings.warn("ds_muon.enabled() is deprecated: use ds_muon.enable_scope() (the context manager) or "
                  "ds_muon.is_enabled() (the predicate)", DeprecationWarning, stacklevel=2)
    return enable_scope()


def _find_config(args: Any, kwargs: dict) -> Any:
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return getattr(args, "deepspeed_config", None)


def initialize(args: Any = None, model=None, *rest: Any, **kwargs: Any):
    """``deepspeed.initialize`` with ds_muon serving ``"optimizer": {"type": "Muon"}`` at ZeRO stages 1, 2 and 3.

    Same signature and return value as ``deepspeed.initialize``:
    ``(engine, optimizer, training_dataloader, lr_scheduler)``. The config is validated first (once: the
    engine hooks reuse the result), so a bad key or value raises :class:`ds_muon.errors.ConfigError` (naming
    the key and the allowed values) before DeepSpeed allocates anything; a DeepSpeed outside
    :data:`ds_muon.errors.SUPPORTED_DEEPSPEED` raises :class:`ds_muon.errors.DeepSpeedVersionError` first.
    """
    config = _find_config(args, kwargs)
    with enable_scope(), validated_once(load_ds_config(config) if config is not None else None):
        return deepspeed.initialize(args, model, *rest, **kwargs)


initialize.__signature__ = inspect.signature(deepspeed.initialize)  # same parameters, our docstring

#: Everything :func:`enable` changes in DeepSpeed, owned by one object (nothing is changed at import).
_PATCHES = _Patches(
    replaced=((deepspeed, "set_optimizer_flags", _set_optimizer_flags),
              (DeepSpeedEngine, "_configure_basic_optimizer", _configure_basic_optimizer),
              (DeepSpeedEngine, "_configure_zero_optimizer", _configure_zero_optimizer),
              (DeepSpeedEngine, "_scheduler_from_config", _scheduler_from_config),
              (DeepSpeedEngine, "_do_optimizer_sanity_check", _do_optimizer_sanity_check)),
    # DeepSpeed asks for zero_allow_untested_optimizer unless the inner optimizer's type is listed, and its sanity
    # check accepts only optimizer names it knows (lower-cased by its config).
    listed=((ds_zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", INNER_TYPES),
            (ds_runtime_config, "DEEPSPEED_OPTIMIZERS", (ADAM_MINI_TYPE,))))
