"""A whole DeepSpeed config as ds_muon reads it: which optimizer, its params, and the sections that matter.

Layer ``config`` (no torch, no deepspeed). :func:`parse_ds_config` is the one entry point for every
optimizer ds_muon serves (``"Muon"``, ``"AdamMini"``): it validates ``optimizer.params`` with that
optimizer's model and checks the DeepSpeed sections with one checker (:func:`section_problems`),
returning a frozen :class:`DsMuonConfig` that is parsed once per ``initialize`` and handed along.

``zero_optimization`` is DeepSpeed's own pydantic model (``extra="forbid"``), so ds_muon adds no keys
there and re-checks nothing DeepSpeed checks; it checks only what matters to ds_muon and DeepSpeed
leaves open. Whether the host can do what the config asks (an NVMe path that exists, libaio) is not
checked here but by :mod:`ds_muon.integration.probes`, once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..errors import ConfigError
from .adam_mini import AdamMiniOptimizerParams, parse_adam_mini_params
from .messages import AUTO_HINT
from .muon import ONLY_TRUE_REASONS, MuonOptimizerParams, parse_muon_params

__all__ = ["MUON", "ADAM_MINI", "SERVED_STAGES", "DsMuonConfig", "optimizer_kind", "parse_ds_config",
           "section_problems", "unserved_modes", "deepspeed_version", "is_number", "NVME_PARAM_OFFLOAD_PROBLEM"]

#: ``optimizer.type`` values ds_muon serves, as ``DsMuonConfig.optimizer`` names them.
MUON = "Muon"
ADAM_MINI = "AdamMini"
#: The ZeRO stages ds_muon's step runs at, per optimizer (stage 0 is DeepSpeed's: no ZeRO optimizer to subclass).
SERVED_STAGES: dict[str, tuple[int, ...]] = {MUON: (1, 2, 3), ADAM_MINI: (1, 2, 3)}

NVME_PARAM_OFFLOAD_PROBLEM = ("zero_optimization.offload_param.device: 'nvme' (parameter offload to NVMe) is not "
                              "supported by ds_muon yet; use offload_param device 'cpu' or none (optimizer offload to "
                              "NVMe is supported: offload_optimizer.device 'nvme')")


@dataclass(frozen=True)
class DsMuonConfig:
    """A DeepSpeed config that ds_muon serves, validated.

    Attributes:
        optimizer: :data:`MUON` or :data:`ADAM_MINI`.
        params: the validated ``optimizer.params``.
        offload_device: ``zero_optimization.offload_optimizer.device`` (``"cpu"``, ``"nvme"``) or None.
    """

    optimizer: str
    params: Union[MuonOptimizerParams, AdamMiniOptimizerParams]
    offload_device: Optional[str] = None

    @property
    def is_muon(self) -> bool:
        return self.optimizer == MUON


def optimizer_kind(ds_config: Any) -> Optional[str]:
    """:data:`MUON` or :data:`ADAM_MINI` when a DeepSpeed config dict's ``optimizer.type`` names one (matched
    case-insensitively, as DeepSpeed does; ``AdamMini`` also as ``adam_mini``/``adam-mini``), else None."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    kind = opt.get("type") if isinstance(opt, dict) else None
    if not isinstance(kind, str):
        return None
    name = kind.lower()
    if name == "muon":
        return MUON
    if name.replace("_", "").replace("-", "") == "adammini":
        return ADAM_MINI
    return None


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, for messages that name one of its limits (read from the package
    metadata: importing deepspeed here would be slow)."""
    try:
        from importlib.metadata import version
        return version("deepspeed")
    except Exception:  # noqa: BLE001 - not installed the usual way
        return "(unknown version)"


def is_number(x: Any) -> bool:
    """A JSON number: an int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _device(section: Any) -> Optional[str]:
    device = section.get("device") if isinstance(section, dict) else None
    return str(getattr(device, "value", device)).lower() if device is not None else None


def section_problems(ds_config: dict, optimizer: str,
                     params: Union[MuonOptimizerParams, AdamMiniOptimizerParams, None]) -> list[str]:
    """The problems of the DeepSpeed sections of ``ds_config`` for ``optimizer`` (one line each).

    * ``zero_optimization.stage`` must be a number 0-3, and the config must be in a mode ds_muon serves
      (:func:`unserved_modes`: stage 0, NVMe parameter offload, ``zenflow``, AutoTP, ... are not);
    * an NVMe ``offload_optimizer`` needs an ``nvme_path``, and a bf16 Muon momentum needs
      ``save_muon_momentum_buffer_in_memory`` there (the swapper stores fp32 state only); a partial offload
      ``ratio`` and ``super_offload`` are refused (neither DeepSpeed's built-in Muon nor ds_muon can run them);
    * ``gradient_clipping`` must be a number >= 0 (0 disables clipping).

    Args:
        params: the optimizer's validated params, or None when they did not validate.
    """
    problems: list[str] = []
    served = "ds_muon" if optimizer == MUON else f"ds_muon's {optimizer}"
    zero = ds_config.get("zero_optimization")
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        problems.append(f"zero_optimization: {zero!r} is invalid: must be an object with \"stage\": 1, 2 or 3")
        zero = {}
    stage = zero.get("stage", None)
    if stage is not None and not (is_number(stage) and stage in (0, 1, 2, 3)):
        problems.append(f"zero_optimization.stage: {stage!r} is invalid: allowed: 0, 1, 2, 3 (a number)")
    problems += unserved_modes(ds_config, optimizer, params=False)  # the params' own check reports those
    problems += _tensor_parallel_problems(ds_config, params)
    offload = zero.get("offload_optimizer")
    device = _device(offload)
    if device == "nvme":
        nvme_path = offload.get("nvme_path")
        if nvme_path is None or (isinstance(nvme_path, str) and not nvme_path.strip()):
            problems.append(f"zero_optimization.offload_optimizer.nvme_path: {nvme_path!r} is invalid: "
                            "offload_optimizer.device is 'nvme', so a directory on a local NVMe drive is required; "
                            "set nvme_path (e.g. \"/local_nvme\"), or use device 'cpu'")
        if (isinstance(params, MuonOptimizerParams) and params.momentum_dtype != "float32"
                and zero.get("save_muon_momentum_buffer_in_memory") is not True):
            problems.append(f"optimizer.params.momentum_dtype: {params.momentum_dtype!r} with NVMe optimizer "
                            "offload needs zero_optimization.save_muon_momentum_buffer_in_memory: true (DeepSpeed's "
                            "swapper stores state in fp32 only); set it, or use momentum_dtype 'float32'")
    if isinstance(offload, dict) and is_number(offload.get("ratio")) and offload["ratio"] != 1.0:
        problems.append(f"zero_optimization.offload_optimizer.ratio: {offload['ratio']!r} is invalid: DeepSpeed "
                        f"{deepspeed_version()}'s ZeRO-3 partial optimizer offload runs only with DeepSpeedCPUAdam as "
                        "the optimizer (DeepSpeedZeroOptimizer_Stage3 asserts 'Hybrid Optimizer Only Supports "
                        f"DeepSpeedCPUAdam'), so neither DeepSpeed's built-in Muon nor {served} can use it; remove "
                        "ratio (or set it to 1.0) to offload the whole optimizer")
    if isinstance(offload, dict) and offload.get("super_offload") and _stage(zero) == 3:  # DeepSpeed: ZeRO-3 only
        problems.append(f"zero_optimization.offload_optimizer.super_offload: true is invalid: DeepSpeed "
                        f"{deepspeed_version()}'s SuperOffload (SuperOffloadOptimizer_Stage3, CUDA only) steps every "
                        f"param group with its own CPU Adam and has no Muon step, so neither DeepSpeed's built-in Muon "
                        f"nor {served} can use it; remove super_offload (offload_optimizer device 'cpu' offloads "
                        f"{served}'s optimizer)")
    if "gradient_clipping" in ds_config:
        clip = ds_config["gradient_clipping"]
        if not is_number(clip) or clip < 0 or clip != clip:
            line = (f"gradient_clipping: {clip!r} is invalid: the global gradient-norm clip threshold must be a "
                    f"number >= 0; allowed: a number >= 0 (0 disables clipping)")
            if clip == "auto":
                line += AUTO_HINT
            problems.append(line)
    return problems


def autotp_size(ds_config: dict) -> int:
    """``tensor_parallel.autotp_size`` of ``ds_config`` (1 when absent or not a number: DeepSpeed's default 0 means
    no AutoTP)."""
    tp = ds_config.get("tensor_parallel")
    size = tp.get("autotp_size") if isinstance(tp, dict) else None
    return int(size) if is_number(size) and size > 1 else 1


def expert_parallel_enabled(ds_config: dict) -> bool:
    """``expert_parallel.enabled`` of ``ds_config`` is true: DeepSpeed's AutoEP swaps the model's MoE blocks."""
    ep = ds_config.get("expert_parallel")
    return isinstance(ep, dict) and ep.get("enabled") is True


def _expert_parallel_unserved(ds_config: dict, optimizer: str, served: str) -> list[str]:
    """AutoEP combinations ds_muon does not serve (one line each; docs/parallelism.md, "AutoEP")."""
    if not expert_parallel_enabled(ds_config):
        return []
    out = []
    if optimizer != MUON:
        out.append(f"expert_parallel: AutoEP is not served by {served}: Adam-mini's block rule gives each stacked "
                   "expert tensor one block, and under AutoEP those are each expert-parallel rank's local experts with "
                   "gate and up apart (w1, w3), not the model's own expert tensors; use optimizer \"Muon\" (which "
                   "serves AutoEP) or set expert_parallel.enabled to false")
    tp_size = autotp_size(ds_config)
    if tp_size > 1:
        out.append(f"expert_parallel: AutoEP with tensor_parallel.autotp_size {tp_size} is not served by {served}: "
                   "DeepSpeed folds the experts over the tensor-parallel ranks there, which ds_muon has not "
                   "parity-tested; use one of the two")
    ckpt = ds_config.get("checkpoint")
    if isinstance(ckpt, dict) and ckpt.get("load_universal") is True:
        out.append(f"checkpoint.load_universal: true with AutoEP (expert_parallel) is not served by {served}: its "
                   "universal conversion joins each parameter's partitions by name, and every expert-parallel rank "
                   "holds other experts under the same names (experts.w1, ...); resume at the world size and "
                   "autoep_size the checkpoint was saved with, without load_universal (loaded exactly)")
    return out


def _tensor_parallel_problems(ds_config: dict, params: Any) -> list[str]:
    """Muon options that do not fit AutoTP's split matrices (one line each, naming the key and the fix)."""
    size = autotp_size(ds_config)
    if size == 1 or not isinstance(params, MuonOptimizerParams):
        return []
    out = []
    if params.qk_clip.enabled:
        out.append(f"optimizer.params.qk_clip: enabled with tensor_parallel.autotp_size {size} is not served by "
                   "ds_muon: AutoTP splits the attention heads across the tensor-parallel ranks, and QK-clip's "
                   "recorder and head rows are not tensor-parallel yet; disable qk_clip or set autotp_size to 1")
    if params.tp_mode == "shard" and (params.per_head_muon or params.muon_splits):
        key = "per_head_muon" if params.per_head_muon else "muon_splits"
        out.append(f"optimizer.params.{key}: with tp_mode 'shard' is not served by ds_muon: the split is declared on "
                   "the full matrix and does not fit a tensor-parallel shard; use tp_mode 'full' (the owner "
                   f"orthogonalizes the full matrix, split as declared) or remove {key}")
    return out


def _stage(zero: dict) -> Any:
    stage = zero.get("stage", 0)
    return stage if stage is not None else 0


def _enabled(ds_config: dict, section: str) -> bool:
    value = ds_config.get(section)
    return isinstance(value, dict) and value.get("enabled") is True


def unserved_modes(ds_config: dict, optimizer: str = MUON, params: bool = True) -> list[str]:
    """The modes of ``ds_config`` that ds_muon does not serve and DeepSpeed's built-in Muon may: one line each,
    naming the key, the reason and the fix. Empty when ds_muon serves the config (or its stage is not a number:
    :func:`section_problems` reports that).

    With ds_muon activated automatically (installed, ``DS_MUON`` unset), a ``"Muon"`` config with such a mode
    is handed to DeepSpeed's built-in exactly as ``DS_MUON=0`` would (:mod:`ds_muon.integration.hooks`); through
    ``ds_muon.initialize`` or ``ds_muon.enable()`` each line is an error.

    * ZeRO stage 0 (or no ``zero_optimization.stage``): DeepSpeed steps the inner optimizer itself, or wraps it
      in its BF16/FP16 optimizer; there is no ZeRO optimizer for ds_muon's step;
    * stage 1 with bf16 and ``data_types.grad_accum_dtype`` fp32 and no optimizer offload: DeepSpeed runs its
      ``BF16_Optimizer`` there, not a ZeRO optimizer;
    * ``offload_optimizer.device`` 'nvme' at stages 1/2 (DeepSpeed runs it as CPU offload; ds_muon's NVMe
      offload is ZeRO-3's), ``elastic_checkpoint`` true at stages 1/2, ``offload_param.device`` 'nvme', ``zenflow``,
      AutoTP (``autotp_size > 1``) at ZeRO stage 3 or with Adam-mini (ds_muon's Muon serves it at stages 1/2);
      AutoEP (``expert_parallel.enabled``) with Adam-mini, with AutoTP or with ``checkpoint.load_universal``
      (ds_muon's Muon serves AutoEP at stages 1-3);
    * with ``params``: the built-in's ``optimizer.params`` modes ds_muon does not implement (``adam_w_mode`` or
      ``fp32_optimizer_states`` false; :func:`ds_muon.config.parse_muon_params` reports them otherwise).
    """
    served = "ds_muon" if optimizer == MUON else f"ds_muon's {optimizer}"
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    stage = _stage(zero)
    if not is_number(stage):
        return []
    out = []
    if stage == 0:
        shown = "missing (DeepSpeed's default is 0)" if zero.get("stage") is None else "0 is invalid"
        builtin = (", or DeepSpeed's built-in Muon for stage 0 (call ds_muon.disable() first if ds_muon.enable() "
                   "is in effect)" if optimizer == MUON else "")
        out.append(f"zero_optimization.stage: {shown}: {served} serves ZeRO stages 1, 2 and 3 (which run on one GPU "
                   f"too); at stage 0 DeepSpeed steps the optimizer without a ZeRO optimizer for {served}'s step to "
                   f"run in. Set zero_optimization.stage to 1, 2 or 3{builtin}")
    offload = zero.get("offload_optimizer")
    offloaded = _device(offload) in ("cpu", "nvme")
    accum = ds_config.get("data_types", {}).get("grad_accum_dtype") if isinstance(ds_config.get("data_types"),
                                                                                  dict) else None
    accum_fp32 = str(accum).lower().removeprefix("torch.") in ("fp32", "float32", "float")  # DeepSpeed's spellings
    if stage == 1 and (_enabled(ds_config, "bf16") or _enabled(ds_config, "bfloat16")) and accum_fp32 \
            and not offloaded:
        out.append(f"data_types.grad_accum_dtype: {accum!r} with bf16 at ZeRO stage 1 is not served by {served}: "
                   "DeepSpeed runs its BF16_Optimizer there, not a ZeRO optimizer; use stage 2 (or 3), or remove "
                   "grad_accum_dtype (bf16 accumulation at stage 1)")
    if stage in (1, 2) and _device(offload) == "nvme":
        out.append(f"zero_optimization.offload_optimizer.device: 'nvme' at ZeRO stage {stage} is not served by "
                   f"{served}: DeepSpeed's ZeRO-1/2 optimizer offloads to CPU memory only (it runs 'nvme' as 'cpu'); "
                   "set device 'cpu', or use stage 3 to offload the optimizer to NVMe")
    if stage in (1, 2) and zero.get("elastic_checkpoint") is True:
        out.append(f"zero_optimization.elastic_checkpoint: true at ZeRO stage {stage} is not served by {served}: "
                   "DeepSpeed then saves the inner optimizer state as a list and trims it to the saved partition, "
                   "which does not fit Muon's momentum and Adam-mini's block moments; remove it (ds_muon's "
                   "to-universal loads at any world size)")
    if _device(zero.get("offload_param")) == "nvme":
        out.append(NVME_PARAM_OFFLOAD_PROBLEM)
    if zero.get("zenflow"):
        out.append(f"zero_optimization.zenflow: is not supported by {served}; remove it")
    tp_size = autotp_size(ds_config)
    if tp_size > 1 and optimizer != MUON:
        out.append(f"tensor_parallel.autotp_size: {tp_size!r} is not served by {served}: its blocks are whole heads "
                   "and whole tensors, which AutoTP splits across the tensor-parallel ranks; use optimizer \"Muon\" "
                   "(which serves AutoTP at ZeRO stages 1 and 2), or set autotp_size to 1")
    elif tp_size > 1 and stage == 3:
        out.append(f"tensor_parallel.autotp_size: {tp_size!r} with ZeRO stage 3 is not served by {served} yet: it "
                   "serves AutoTP at ZeRO stages 1 and 2 (the full-matrix owner exchange over the tensor-parallel x "
                   "data-parallel ranks, docs/parallelism_tp.md); set zero_optimization.stage to 1 or 2, or "
                   "autotp_size to 1")
    out += _expert_parallel_unserved(ds_config, optimizer, served)
    opt_params = (ds_config.get("optimizer") or {}).get("params") if isinstance(ds_config.get("optimizer"), dict) \
        else None
    if params and optimizer == MUON and isinstance(opt_params, dict):
        out += [f"optimizer.params.{key}: false is not served by ds_muon: {reason}"
                for key, reason in ONLY_TRUE_REASONS.items() if opt_params.get(key) is False]
    return out


def _warnings(ds_config: dict, params: Any) -> None:
    """Muon config that is correct but has no effect: a ``UserWarning`` each (the same file is often shared
    between runs that differ only there)."""
    if not isinstance(params, MuonOptimizerParams):
        return
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    if params.foreach is not None and not params.torch_adam:
        warnings.warn(
            "optimizer.params.foreach has no effect without optimizer.params.torch_adam: true (as in DeepSpeed, "
            "it is a flag of torch.optim.AdamW); set torch_adam true to use torch's AdamW, or remove foreach.",
            UserWarning, stacklevel=3)
    if zero.get("save_muon_momentum_buffer_in_memory") is True and _device(zero.get("offload_optimizer")) not in (
            "cpu", "nvme"):
        warnings.warn(
            "zero_optimization.save_muon_momentum_buffer_in_memory is true but the optimizer is not offloaded "
            "(offload_optimizer.device is not 'cpu' or 'nvme'), so it has no effect: the Muon momentum already "
            "stays in accelerator memory. Remove it, or offload the optimizer.",
            UserWarning, stacklevel=3)


def parse_ds_config(ds_config: dict) -> Optional[DsMuonConfig]:
    """Parse the ds_muon-relevant parts of a DeepSpeed config dict.

    Returns None when ``optimizer.type`` is none ds_muon serves (other configs pass through untouched).
    ``zero_optimization.save_muon_momentum_buffer_in_memory: true`` without an optimizer offload, and
    ``foreach`` without ``torch_adam``, earn a ``UserWarning`` (correct but without effect).

    Raises:
        ConfigError: listing every problem of ``optimizer.params`` (:func:`ds_muon.config.parse_muon_params`,
            :func:`ds_muon.config.parse_adam_mini_params`) and of the sections (:func:`section_problems`).
    """
    if not isinstance(ds_config, dict):
        raise ConfigError(f"DeepSpeed config: {type(ds_config).__name__} is invalid: parse_ds_config takes a dict; "
                          "use load_ds_config(path) to read a JSON file")
    optimizer = optimizer_kind(ds_config)
    if optimizer is None:
        return None
    problems: list[str] = []
    params = None
    parse = parse_muon_params if optimizer == MUON else parse_adam_mini_params
    try:
        params = parse(ds_config["optimizer"].get("params"))
    except ConfigError as err:
        problems.extend(err.problems)
    problems += section_problems(ds_config, optimizer, params)
    if problems:
        raise ConfigError(problems)
    _warnings(ds_config, params)
    zero = ds_config.get("zero_optimization") or {}
    return DsMuonConfig(optimizer, params, _device(zero.get("offload_optimizer")))
