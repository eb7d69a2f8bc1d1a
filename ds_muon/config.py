"""Configuration of ds_muon: what a DeepSpeed config may say to it, checked before anything runs.

The config surface
------------------
ds_muon reads two places of an ordinary DeepSpeed config (``ds_config.json``):

``optimizer`` -- ``{"type": "Muon", "params": {...}}``.
    The type is matched case-insensitively, as DeepSpeed does. ``params`` is modelled by
    :class:`MuonOptimizerParams` (pydantic v2, ``extra="forbid"``): every key has a type, bounds,
    a default, and a description stating its unit and its source. DeepSpeed does not validate
    ``optimizer.params`` at all, so ds_muon validates it strictly: an unknown key is an error with
    a "did you mean" hint, a key DeepSpeed's built-in Muon rejects too (``max_grad_norm``) is an error
    that says so, and a value of the wrong type is not coerced
    (``"nesterov": "yes"`` is an error, not ``True``).

    The keys DeepSpeed's built-in Muon accepts keep its meaning, so an existing config works
    unchanged: ``lr``, ``momentum``, ``weight_decay``, ``muon_lr``, ``adam_lr``, ``betas``, ``eps``,
    ``ns_method``, ``adam_w_mode``, ``torch_adam``, ``foreach``, ``fp32_optimizer_states``, ``per_head_muon`` (see
    ``DeepSpeedEngine._configure_basic_optimizer``, ``get_optimizer_configuration`` and
    ``_muon_param_groups`` in deepspeed 0.18.9-0.19.8: ``lr``/``weight_decay`` are shared by both
    halves, ``muon_lr``/``adam_lr`` override ``lr`` per half, ``betas``/``eps`` go to the AdamW
    half, ``momentum``/``ns_method`` to the Muon half, ``torch_adam``/``foreach`` pick
    ``torch.optim.AdamW`` for the AdamW half; ``fp32_optimizer_states`` and ``adam_w_mode`` only
    accept ``true``, what ds_muon does). The one visible difference is the default
    ``ns_method``: DeepSpeed's is ``"gram"``, ours is ``"standard"`` until measurement picks one.
    ds_muon adds ``nesterov``, ``ns_steps``, ``ns_dtype``, ``update_scale``,
    ``adam_weight_decay``, ``exchange_dtype``, ``muon_params``, ``adamw_params`` and ``muon_splits``, and accepts
    ``adam_betas``/``adam_eps`` as aliases of ``betas``/``eps`` (design.md section 1 uses them).

``zero_optimization`` -- DeepSpeed's own pydantic model (``extra="forbid"``) validates it, so
    ds_muon adds no keys there and re-checks nothing DeepSpeed checks. It only checks what
    matters to ds_muon and DeepSpeed leaves open: ``stage`` must be 3; an NVMe
    ``offload_optimizer`` needs an ``nvme_path`` (DeepSpeed accepts ``None`` and fails later);
    ``save_muon_momentum_buffer_in_memory`` without an optimizer offload only earns a warning
    (see :func:`validate_ds_config`). The top-level ``gradient_clipping`` must be a number >= 0.

Entry points
------------
* :func:`parse_muon_params` -- ``optimizer.params`` dict -> :class:`MuonOptimizerParams`.
* :func:`validate_ds_config` -- a whole DeepSpeed config dict; ``None`` for non-Muon configs.
* :func:`load_ds_config` -- a path to a JSON file (or a dict) -> dict.

Every problem raises :class:`ConfigError` (a ``ValueError``) whose message has one line per
problem: the key path, the offending value, and what is allowed or how to fix it.
JSON Schema generated from these models lives in ``ds_config_schemas/`` (``python -m
ds_muon.schema``); a test fails when it drifts from this module.

This module imports neither torch nor deepspeed, so it is cheap to import and to test.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
import types
import typing
import warnings
from typing import Annotated, Any, Literal, Optional, Union

import annotated_types
from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

__all__ = [
    "ConfigError",
    "MuonOptimizerParams",
    "QKClipParams",
    "parse_muon_params",
    "validate_ds_config",
    "load_ds_config",
    "OPTIMIZER_PARAMS_PATH",
    "UNSUPPORTED_BUILTIN_KEYS",
]

OPTIMIZER_PARAMS_PATH = "optimizer.params"
MUON_TYPE = "muon"

# Keys DeepSpeed's built-in Muon path reads from optimizer.params that ds_muon does not support,
# with the reason and the fix. (DeepSpeed 0.18.9-0.19.8: _configure_basic_optimizer rejects max_grad_norm.
# The other keys it reads -- lr, muon_lr, adam_lr, momentum, weight_decay, ns_method, betas, eps,
# adam_w_mode, per_head_muon (deepspeed/__init__.py), and the ones get_optimizer_configuration pops:
# torch_adam, foreach, fp32_optimizer_states -- are fields.)
UNSUPPORTED_BUILTIN_KEYS: dict[str, str] = {
    "max_grad_norm": ("is not an optimizer parameter (DeepSpeed rejects it too); set the top-level "
                      "'gradient_clipping' of the DeepSpeed config instead"),
}

_AUTO_HINT = (" ('auto' is a placeholder the Hugging Face DeepSpeed integration fills in; validate the "
              "config after it has done so, or write the number)")


class ConfigError(ValueError):
    """A ds_muon configuration problem.

    ``str(err)`` names each offending key path, its value, and what is allowed / the fix, one line
    per problem. ``err.problems`` holds those lines as a list.
    """

    def __init__(self, problems: Union[str, list[str]], header: Optional[str] = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if header is None and len(self.problems) > 1:
            header = f"invalid ds_muon configuration ({len(self.problems)} problems):"
        lines = ([header] if header else []) + [("  " if header else "") + p for p in self.problems]
        super().__init__("\n".join(lines))


def _custom(reason: str, **ctx: Any) -> PydanticCustomError:
    # `reason` is a template for pydantic; escape braces so it is taken literally.
    ctx["reason"] = reason
    return PydanticCustomError("ds_muon", reason.replace("{", "{{").replace("}", "}}"), ctx)


_Beta = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]

# name -> alias (accepted on input, not both at once).
_ALIASES: dict[str, str] = {"betas": "adam_betas", "eps": "adam_eps"}


def _add_aliases_to_schema(schema: dict[str, Any]) -> None:
    """Make the generated JSON Schema accept each alias, and reject a name together with its alias."""
    props = schema.get("properties", {})
    exclusions = []
    for name, alias in _ALIASES.items():
        if name in props:
            entry = copy.deepcopy(props[name])
            entry["title"] = alias.replace("_", " ").title()
            entry["description"] = f"Alias of '{name}', same meaning; give one or the other, not both."
            props[alias] = entry
            exclusions.append({"not": {"required": [name, alias]}})
    if exclusions:
        schema["allOf"] = exclusions


# Built-in keys whose only value ds_muon implements is true, and why.
_ONLY_TRUE_REASONS = {
    "adam_w_mode": ("ds_muon only implements decoupled weight decay (AdamW) for its AdamW half; Adam with L2 "
                    "regularization (adam_w_mode=false) is not supported"),
    "fp32_optimizer_states": ("ds_muon keeps the Adam moments in fp32 whatever the model dtype (in DeepSpeed this key "
                              "only sets DeepSpeedCPUAdam's moment dtype), and lower-precision Adam moments are not "
                              "supported; for bf16 Muon momentum set momentum_dtype 'bfloat16' instead"),
}


_BlockSize = Annotated[int, Field(ge=1)]


def _split_schema(schema: dict[str, Any]) -> None:
    """JSON Schema of a split: the object form, or a bare list (row block sizes), as the model accepts."""
    obj = dict(schema, minProperties=1)
    schema.clear()
    schema.update(title=obj.pop("title"), description=obj.pop("description"), anyOf=[
        {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1,
         "description": "Row block sizes in order (the same as {\"rows\": [...]})."}, obj])


class MuonSplit(BaseModel):
    """A declared split of each matrix of a parameter: contiguous row and/or column block sizes."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, title="ds_muon matrix split",
                              json_schema_extra=_split_schema)

    rows: Optional[list[_BlockSize]] = Field(
        None, min_length=1,
        description="Row block sizes in order (elements, each >= 1, summing to the matrix's rows); null: rows not cut.")
    cols: Optional[list[_BlockSize]] = Field(
        None, min_length=1,
        description=("Column block sizes in order (elements, each >= 1, summing to the matrix's columns); null: "
                     "columns not cut."))

    @model_validator(mode="before")
    @classmethod
    def _list_means_rows(cls, data: Any) -> Any:
        return {"rows": data} if isinstance(data, list) else data

    @model_validator(mode="after")
    def _not_empty(self) -> "MuonSplit":
        if self.rows is None and self.cols is None:
            raise _custom("a split needs 'rows' and/or 'cols'", allowed="{\"rows\": [...]} and/or {\"cols\": [...]}")
        return self


class QKClipParams(BaseModel):
    """MuonClip's QK-clip (Kimi K2 technical report, arXiv 2507.20534, section 2.1): after each optimizer step,
    every attention head whose largest pre-softmax logit of the step exceeded ``threshold`` gets its query and
    key weights scaled down so that logit would be ``threshold`` (docs/qk_clip.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, title="ds_muon QK-clip")

    enabled: bool = Field(
        False,
        description=("Apply QK-clip after every optimizer step. The attention must report its per-head max logits "
                     "(attn_implementation='ds_muon_sdpa' for Hugging Face models, ds_muon.record_max_logits in a "
                     "custom attention). Source: Kimi K2 (arXiv 2507.20534) MuonClip."))
    threshold: float = Field(
        100.0, gt=0, allow_inf_nan=False,
        description=("tau: the largest allowed pre-softmax attention logit q.k*scaling (dimensionless, after RoPE, "
                     "as the softmax sees it). A head whose step max S exceeds it gets gamma = tau/S. Source: Kimi K2 "
                     "(tau = 100 there)."))
    alpha: float = Field(
        0.5, ge=0, le=1, allow_inf_nan=False,
        description=("Balance of the clip between query and key: W_q rows of the head *= gamma^alpha, W_k rows of "
                     "its key head *= gamma^(1-alpha) (dimensionless). Source: Kimi K2 (alpha = 0.5 there)."))
    monitor_per_head: bool = Field(
        True,
        description=("Also write each query head's max logit of the step to DeepSpeed's monitor "
                     "(Train/ds_muon/qk_clip/max_logit/<module>/head_<h>: layers x heads events per step, besides the "
                     "per-layer and whole-model maxima and the clipped-head count, which are always written). Turn "
                     "off for models with thousands of heads. Source: ds_muon."))


class MuonOptimizerParams(BaseModel):
    """The params of "optimizer": {"type": "Muon", "params": {...}} in a DeepSpeed config, as ds_muon reads them.

    Muon updates the hidden >=2-D weight matrices; AdamW updates everything else (embeddings, the
    output head, norms, biases). Keys shared with DeepSpeed's built-in Muon keep its meaning.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        populate_by_name=True,
        strict=True,  # no silent coercion: "0.02" is not a number, "yes" is not a bool
        title="ds_muon Muon optimizer params",
        json_schema_extra=_add_aliases_to_schema,
    )

    # ---- learning rates -------------------------------------------------------------------
    lr: float = Field(
        0.02, gt=0, allow_inf_nan=False,
        description=("Shared learning rate (unit: step size per optimizer step, multiplying the scaled "
                     "orthogonalized update for Muon parameters and the Adam update for AdamW parameters). "
                     "Both halves use it unless muon_lr / adam_lr override it. Source: DeepSpeed built-in "
                     "Muon 'lr', same meaning; default 0.02 as in Keller Jordan's Muon."))
    muon_lr: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False,
        description=("Learning rate of the Muon parameters (unit: as lr); null means use lr. Source: DeepSpeed "
                     "built-in Muon 'muon_lr', same meaning."))
    adam_lr: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False,
        description=("Learning rate of the AdamW parameters (unit: as lr); null means use lr. Source: DeepSpeed "
                     "built-in Muon 'adam_lr', same meaning."))

    # ---- Muon -------------------------------------------------------------------------------
    momentum: float = Field(
        0.95, ge=0, lt=1, allow_inf_nan=False,
        description=("Muon momentum coefficient beta (dimensionless): m <- beta*m + (1-beta)*g, kept (in "
                     "momentum_dtype) on the rank that holds the shard. Source: DeepSpeed built-in Muon 'momentum', same meaning; "
                     "default 0.95 as in Keller Jordan's Muon."))
    momentum_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=("Storage dtype of the Muon momentum (the only Muon optimizer state). 'float32' (default) keeps "
                     "it exact; 'bfloat16' halves its memory (2 bytes per Muon element instead of 4, as DeepSpeed's "
                     "built-in Muon, which keeps it in the model's dtype): the update is still computed in fp32 and "
                     "only the stored momentum is rounded. With NVMe optimizer offload it needs "
                     "zero_optimization.save_muon_momentum_buffer_in_memory (the swapper stores fp32 state only). "
                     "Source: ds_muon; the effect on the main job's loss is in docs/benchmarks.md."))
    nesterov: bool = Field(
        True,
        description=("Nesterov momentum for Muon: orthogonalize lerp(g, m, beta) instead of m. Source: Keller "
                     "Jordan's Muon (nesterov=True there; DeepSpeed's built-in Muon always uses it)."))
    ns_method: Literal["standard", "gram", "polar_express"] = Field(
        "standard",
        description=("Newton-Schulz iteration that orthogonalizes the update: 'standard' = Keller Jordan's quintic "
                     "iteration, 'gram' = Gram-matrix Newton-Schulz (as in DeepSpeed's built-in Muon), "
                     "'polar_express' = Polar Express (Amsel et al., arXiv:2505.16932, per-step optimal "
                     "coefficients). Source: DeepSpeed built-in Muon 'ns_method' ('standard', 'gram'), extended. "
                     "Default 'standard', chosen by whole-step measurement (docs/benchmarks.md: 'gram' was 2 ms "
                     "faster at W=2 and 12 ms slower at W=4 on the 934M model); DeepSpeed's built-in default is "
                     "'gram'."))
    ns_steps: int = Field(
        5, ge=1, le=100,
        description="Number of Newton-Schulz iterations (count). Source: Keller Jordan's Muon (ns_steps=5).")
    ns_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description=("Floating-point dtype the Newton-Schulz iteration computes in. 'auto': float32 on CPU; on an "
                     "accelerator float16 for ns_method 'gram' and bfloat16 otherwise. Source: ds_muon (the "
                     "built-in Muon fixes bf16, fp16 for gram)."))
    ns_compile: bool = Field(
        True,
        description=("Compile the Newton-Schulz iteration with torch.compile (dynamic shapes) when it runs on a CUDA "
                     "device, and run the element-wise momentum step and update apply of the ZeRO-3 Muon step as "
                     "one compiled pass each there; on CPU all of it runs eagerly. Source: ds_muon; the gains are "
                     "measured by benchmarks/step_time.py and benchmarks/elementwise.py."))
    ns_autotune: bool = Field(
        False,
        description=("With ns_compile on CUDA, compile Newton-Schulz as heavyball does: torch.compile mode "
                     "'max-autotune-no-cudagraphs' with static shapes (one graph per (batch, rows, cols) of the owner "
                     "plan, 4-9 s of Triton autotuning each on the first step). Measured on one H200, bf16, 5 steps: "
                     "83-85% of the matmul rate against 77-80% without (docs/benchmarks.md). Pays on long runs; "
                     "off by default for the start-up time. Source: ds_muon, benchmarks/step_time.py --ns-micro."))
    update_scale: Literal["shape", "rms_match"] = Field(
        "shape",
        description=("Dimensionless multiplier of the orthogonalized update of a (rows, cols) matrix (conv "
                     "weights as (out, in*k*k)): 'shape' = sqrt(max(1, rows/cols)); 'rms_match' = "
                     "0.2*sqrt(max(rows, cols)), which matches AdamW's update RMS so AdamW's lr and weight decay "
                     "carry over. Source: 'shape' from Keller Jordan's Muon, 'rms_match' from Moonlight (Liu et "
                     "al., arXiv:2502.16982)."))

    # ---- weight decay ----------------------------------------------------------------------
    weight_decay: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description=("Decoupled weight decay coefficient (unit: fraction per unit of lr per step: p <- "
                     "p*(1 - lr*weight_decay)). Applies to both halves unless adam_weight_decay overrides it for "
                     "AdamW parameters. Source: DeepSpeed built-in Muon 'weight_decay', same meaning."))
    adam_weight_decay: Optional[float] = Field(
        None, ge=0, allow_inf_nan=False,
        description=("Decoupled weight decay of the AdamW parameters (unit: as weight_decay); null means use "
                     "weight_decay. Source: ds_muon."))

    # ---- AdamW -------------------------------------------------------------------------------
    betas: tuple[_Beta, _Beta] = Field(
        (0.9, 0.999),
        validation_alias=AliasChoices("betas", "adam_betas"),
        strict=False,  # a JSON list is the natural spelling of the pair; the items stay strict
        description=("AdamW coefficients [beta1, beta2] (dimensionless) of the running averages of the gradient "
                     "and its square. Also accepted as 'adam_betas'. Source: DeepSpeed built-in Muon 'betas' "
                     "(passed to its AdamW half), same meaning; default as torch.optim.AdamW."))
    eps: float = Field(
        1e-8, gt=0, allow_inf_nan=False,
        validation_alias=AliasChoices("eps", "adam_eps"),
        description=("AdamW denominator epsilon (unit: gradient units). Also accepted as 'adam_eps'. Source: "
                     "DeepSpeed built-in Muon 'eps', same meaning; default as torch.optim.AdamW."))
    adam_w_mode: bool = Field(
        True,
        json_schema_extra={"const": True},
        description=("Decoupled weight decay for the AdamW half (AdamW rather than Adam with L2). Only true is "
                     "supported. Source: DeepSpeed built-in Muon 'adam_w_mode'."))
    torch_adam: bool = Field(
        False,
        description=("Step the AdamW half with torch.optim.AdamW instead of DeepSpeed's FusedAdam (accelerator) / "
                     "DeepSpeedCPUAdam (optimizer offload). Source: DeepSpeed built-in Muon 'torch_adam' "
                     "(DeepSpeedEngine.get_optimizer_configuration), same meaning."))
    foreach: Optional[bool] = Field(
        None,
        description=("torch.optim.AdamW's 'foreach' flag (null: torch's default) for the AdamW half; it only has "
                     "an effect with torch_adam true, as in DeepSpeed (without it a warning says so). Source: "
                     "DeepSpeed built-in Muon 'foreach', same meaning."))
    fp32_optimizer_states: bool = Field(
        True,
        json_schema_extra={"const": True},
        description=("Keep the Adam moments in fp32. ds_muon always does, whatever the model dtype, so true "
                     "changes nothing and false is refused (Muon momentum's dtype is momentum_dtype). Source: "
                     "DeepSpeed built-in Muon 'fp32_optimizer_states' (passed to DeepSpeedCPUAdam)."))

    # ---- communication -----------------------------------------------------------------------
    exchange_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description=("Dtype of the Muon update in the owner all_to_all exchange (to the matrix owner and back). "
                     "'auto': the Newton-Schulz compute dtype if that is bfloat16, else float32. Source: ds_muon."))
    exchange_bucket_mb: float = Field(
        256.0, gt=0, le=1_048_576, allow_inf_nan=False,
        description=("Size of one owner-exchange bucket (unit: MiB of full Muon matrices in the exchange dtype; a "
                     "matrix larger than this is a bucket of its own). A sub-group's matrices are exchanged and "
                     "orthogonalized bucket by bucket, the next bucket's all_to_all overlapping the current one's "
                     "Newton-Schulz; at most 3 buckets hold buffers at once. Per rank that is 3 x (this rank's chunks of "
                     "a bucket + its owned matrices of a bucket) plus one batch of owned matrices in the NS dtype: "
                     "about 6 x exchange_bucket_mb / W MiB when a bucket has at least W matrices, up to about "
                     "3 x exchange_bucket_mb MiB when it has few large ones. Source: ds_muon."))

    # ---- faults ------------------------------------------------------------------------------
    max_consecutive_skipped_steps: int = Field(
        50, ge=0, le=1_000_000,
        description=("Stop the run (RuntimeError naming the first parameter that holds a non-finite gradient) after "
                     "this many consecutive optimizer steps skipped because the global gradient norm was NaN or Inf "
                     "(unit: optimizer steps; 0: never stop). Every skipped step is logged and counted "
                     "(skipped_step_count, the monitor's Train/ds_muon/skipped_steps). fp16's dynamic loss scaler "
                     "skips a few steps while it finds its scale, which counts too. Source: ds_muon."))

    # ---- which parameters use Muon -----------------------------------------------------------
    muon_params: list[str] = Field(
        default_factory=list,
        description=("fnmatch-style glob patterns (case-sensitive) over model.named_parameters() names that put a "
                     "parameter in the Muon half. An explicit param.use_muon attribute still wins, and adamw_params "
                     "is checked first. Source: ds_muon."))
    adamw_params: list[str] = Field(
        default_factory=list,
        description=("fnmatch-style glob patterns (case-sensitive) over model.named_parameters() names that put a "
                     "parameter in the AdamW half; checked before muon_params, so a name matched by both goes to "
                     "AdamW. An explicit param.use_muon attribute still wins. Source: ds_muon."))

    per_head_muon: bool = Field(
        False,
        description=("Orthogonalize attention projections one head at a time: the Q, K and V projections (separate "
                     "q_proj/k_proj/v_proj, fused qkv_proj/c_attn/query_key_value, GQA included, and MLA's "
                     "q_b_proj/kv_b_proj) are split into per-head blocks of head_dim rows, each orthogonalized and "
                     "scaled on its own; the head geometry comes from the attention module (num_heads, num_key_value_heads, "
                     "head_dim, or its own config: a vision tower's), else from the model's text config "
                     "(num_attention_heads, num_key_value_heads, head_dim). When no projection matches, start-up fails naming what was "
                     "examined. Source: DeepSpeed built-in Muon 'per_head_muon', same meaning; ds_muon also splits "
                     "fused QKV projections per head (the built-in leaves them whole)."))
    muon_splits: dict[str, MuonSplit] = Field(
        default_factory=dict,
        description=("Declared matrix views: fnmatch-style glob pattern (over model.named_parameters() names) -> "
                     "block sizes. A list [a, b, ...] cuts each matrix of a matching Muon parameter into row blocks "
                     "of those sizes (elements; they must sum to its rows); {\"rows\": [...], \"cols\": [...]} cuts "
                     "rows and/or columns. For a stacked (E, rows, cols) parameter the split applies to each of the E "
                     "matrices. Each block is orthogonalized and scaled on its own. A param.muon_split attribute wins; "
                     "a declared split replaces the automatic ones (experts' gate/up, fused QKV, per head); a pattern "
                     "that matches no Muon parameter is an error. Source: ds_muon (Megatron's split_qkv, Dion's "
                     "split sizes)."))

    qk_clip: QKClipParams = Field(
        default_factory=QKClipParams,
        description=("MuonClip's QK-clip: {\"enabled\": bool, \"threshold\": tau > 0, \"alpha\": in [0, 1], "
                     "\"monitor_per_head\": bool}. After the "
                     "optimizer step, for each attention head h whose max logit S_h of the step (all micro-batches, "
                     "all data-parallel ranks) exceeds tau: gamma = tau/S_h, the head's W_q rows (and q bias) *= "
                     "gamma^alpha, its key head's W_k rows (and k bias) *= gamma_kv^(1-alpha), gamma_kv from the "
                     "largest S over the query heads sharing that key head (GQA). Source: Kimi K2 (arXiv 2507.20534, "
                     "section 2.1); see docs/qk_clip.md."))

    # ---- validators --------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _name_and_alias_not_both(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, alias in _ALIASES.items():
                if name in data and alias in data:
                    raise _custom(
                        f"both '{name}' and its alias '{alias}' are given",
                        key=alias, value=data[alias],
                        allowed=f"one of '{name}' or '{alias}', not both (they mean the same)")
        return data

    @field_validator("adam_w_mode", "fp32_optimizer_states")
    @classmethod
    def _only_true(cls, value: bool, info) -> bool:
        if value is not True:
            raise _custom(_ONLY_TRUE_REASONS[info.field_name], allowed="true (or leave the key out)")
        return value

    @field_validator("muon_params", "adamw_params")
    @classmethod
    def _patterns_non_empty(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern.strip():
                raise _custom("a pattern is empty", allowed="non-empty fnmatch glob patterns such as '*.mlp.*.weight'")
        return value

    @field_validator("muon_splits")
    @classmethod
    def _split_patterns_non_empty(cls, value: dict) -> dict:
        if any(not pattern.strip() for pattern in value):
            raise _custom("a pattern is empty", allowed="non-empty fnmatch glob patterns such as '*.attn.wqkv.weight'")
        return value

    def declared_splits(self) -> dict[str, dict]:
        """``muon_splits`` as ``{pattern: {"rows": [...] or None, "cols": [...] or None}}``."""
        return {k: v.model_dump() for k, v in self.muon_splits.items()}

    @model_validator(mode="after")
    def _patterns_disjoint(self) -> "MuonOptimizerParams":
        both = sorted(set(self.muon_params) & set(self.adamw_params))
        if both:
            raise _custom(f"pattern(s) {both} are in both muon_params and adamw_params",
                          key="adamw_params", value=self.adamw_params,
                          allowed="each pattern in one list only")
        return self

    @model_validator(mode="after")
    def _autotune_needs_compile(self) -> "MuonOptimizerParams":
        if self.ns_autotune and not self.ns_compile:
            raise _custom("ns_autotune tunes the compiled Newton-Schulz, but ns_compile is false",
                          key="ns_autotune", value=True, allowed="false, or set ns_compile: true")
        return self

    # ---- resolved settings -------------------------------------------------------------------
    def muon_group_defaults(self) -> dict[str, Any]:
        """Settings of the Muon param group(s), with muon_lr resolved."""
        return {
            "lr": self.muon_lr if self.muon_lr is not None else self.lr,
            "momentum": self.momentum,
            "momentum_dtype": self.momentum_dtype,
            "nesterov": self.nesterov,
            "ns_method": self.ns_method,
            "ns_steps": self.ns_steps,
            "ns_dtype": self.ns_dtype,
            "update_scale": self.update_scale,
            "weight_decay": self.weight_decay,
            "exchange_dtype": self.exchange_dtype,
        }

    def adamw_implementation(self) -> dict[str, Any]:
        """The keys ``DeepSpeedEngine.get_optimizer_configuration`` reads to pick the AdamW class:
        ``{"torch_adam": bool, "foreach": Optional[bool]}``."""
        return {"torch_adam": self.torch_adam, "foreach": self.foreach}

    def adamw_group_defaults(self) -> dict[str, Any]:
        """Settings of the AdamW param group(s), with adam_lr and adam_weight_decay resolved."""
        return {
            "lr": self.adam_lr if self.adam_lr is not None else self.lr,
            "betas": tuple(self.betas),
            "eps": self.eps,
            "weight_decay": self.adam_weight_decay if self.adam_weight_decay is not None else self.weight_decay,
        }

    def resolved_exchange_dtype(self, ns_compute_dtype: Any) -> str:
        """The exchange dtype name ('bfloat16' or 'float32') with 'auto' resolved.

        ``ns_compute_dtype`` is the resolved Newton-Schulz dtype, as a ``torch.dtype`` or its name
        (``ds_muon.newton_schulz.resolve_ns_dtype`` owns the 'auto' rule for ``ns_dtype``).
        """
        return resolve_exchange_dtype(self.exchange_dtype, ns_compute_dtype)


def resolve_exchange_dtype(exchange_dtype: str, ns_compute_dtype: Any) -> str:
    """``'bfloat16'`` or ``'float32'``: ``exchange_dtype`` with ``'auto'`` resolved against the
    Newton-Schulz compute dtype (a ``torch.dtype`` or its name): bf16 on the wire only when NS itself
    computes in bf16 (an fp16 Gram NS gets an fp32 exchange: bf16 would lose more than fp16 keeps)."""
    if exchange_dtype != "auto":
        return exchange_dtype
    name = str(ns_compute_dtype).removeprefix("torch.")
    return "bfloat16" if name in ("bfloat16", "bf16") else "float32"


# ------------------------------------------------------------------------------------------------
# Turning pydantic errors into readable ones
# ------------------------------------------------------------------------------------------------
def _fmt_num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _allowed_for_field(name: str, model: Any = None) -> str:
    """A human description of what field ``name`` of ``model`` (default :class:`MuonOptimizerParams`) accepts,
    derived from its annotation and bounds."""
    model = model or MuonOptimizerParams
    if name == "qk_clip" and model is MuonOptimizerParams:
        return ("an object with keys " + ", ".join(f"{k} ({_allowed_for_field(k, QKClipParams)})"
                                                   for k in QKClipParams.model_fields))
    if name in ("betas",):
        return "a pair [beta1, beta2] of numbers, each in [0, 1)"
    if name == "muon_splits":
        return ("an object mapping glob patterns to a list of row block sizes (ints >= 1) or to "
                "{\"rows\": [...], \"cols\": [...]}")
    field = model.model_fields.get(name)
    if field is None:
        return f"see the {model.__name__} documentation"
    ann = field.annotation
    optional = False
    origin = typing.get_origin(ann)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = len(args) < len(typing.get_args(ann))
        ann = args[0] if len(args) == 1 else ann
    if typing.get_origin(ann) is Literal:
        text = "one of " + ", ".join(repr(v) for v in typing.get_args(ann))
    elif ann is bool:
        text = "true or false"
    elif ann in (int, float):
        lo = hi = None
        for m in field.metadata:
            if isinstance(m, annotated_types.Gt):
                lo = ("(", m.gt)
            elif isinstance(m, annotated_types.Ge):
                lo = ("[", m.ge)
            elif isinstance(m, annotated_types.Lt):
                hi = (")", m.lt)
            elif isinstance(m, annotated_types.Le):
                hi = ("]", m.le)
        kind = "an integer" if ann is int else "a number"
        if lo and hi:
            text = f"{kind} in {lo[0]}{_fmt_num(lo[1])}, {_fmt_num(hi[1])}{hi[0]}"
        elif lo:
            text = f"{kind} {'>' if lo[0] == '(' else '>='} {_fmt_num(lo[1])}"
        elif hi:
            text = f"{kind} {'<' if hi[0] == ')' else '<='} {_fmt_num(hi[1])}"
        else:
            text = kind
    elif typing.get_origin(ann) is list:
        text = "a list of fnmatch glob pattern strings"
    else:
        text = "see the MuonOptimizerParams documentation"
    if optional:
        text += " or null"
    return text


def _known_keys(model: Any = None) -> list[str]:
    if model is not None and model is not MuonOptimizerParams:
        return list(model.model_fields)
    return list(MuonOptimizerParams.model_fields) + list(_ALIASES.values())


def _alias_to_field(key: str) -> str:
    for name, alias in _ALIASES.items():
        if key == alias:
            return name
    return key


def _suggest(key: str, model: Any = None) -> list[str]:
    candidates = _known_keys(model)
    norm = key.strip().lower().replace("-", "_").replace(" ", "_")
    if norm in candidates and norm != key:
        return [norm]
    return difflib.get_close_matches(norm, candidates, n=2, cutoff=0.6)


def _loc_path(path: str, loc: tuple) -> str:
    out = path
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _unknown_key_line(path: str, key: str, value: Any, model: Any = None) -> str:
    where = _loc_path(path, (key,))
    if key in UNSUPPORTED_BUILTIN_KEYS:
        return f"{where}: {value!r} is not accepted: '{key}' {UNSUPPORTED_BUILTIN_KEYS[key]}"
    line = f"{where}: unknown key (value {value!r})"
    suggestions = _suggest(key, model)
    if suggestions:
        line += "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
    line += (" Known keys: " if suggestions else "; known keys: ") + ", ".join(_known_keys(model))
    return line


def _error_lines(err: ValidationError, path: str, model: Any = None) -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        loc = tuple(e.get("loc", ()))
        ctx = e.get("ctx") or {}
        if e["type"] == "extra_forbidden" and len(loc) == 1:
            lines.append(_unknown_key_line(path, str(loc[0]), e.get("input"), model))
            continue
        if loc[:1] == ("qk_clip",) and len(loc) >= 2:  # a key of the nested qk_clip object
            sub, value = str(loc[1]), e.get("input")
            known = ", ".join(QKClipParams.model_fields)
            if e["type"] == "extra_forbidden":
                hint = difflib.get_close_matches(sub, list(QKClipParams.model_fields), n=1, cutoff=0.6)
                lines.append(f"{_loc_path(path, loc)}: unknown key (value {value!r})"
                             + (f"; did you mean {hint[0]!r}?" if hint else "") + f" Known keys: {known}")
            else:
                lines.append(f"{_loc_path(path, loc)}: {value!r} is invalid: {e.get('msg', 'invalid')}; allowed: "
                             f"{_allowed_for_field(sub, QKClipParams)}")
            continue
        if "key" in ctx:  # a model-level ds_muon check that names its key
            loc = (ctx["key"],)
        value = ctx["value"] if "value" in ctx else e.get("input")
        if e["type"] == "model_type" and not loc:
            lines.append(f"{path}: {value!r} is invalid: must be an object (a dict of optimizer settings)")
            continue
        field = _alias_to_field(str(loc[0])) if loc else ""
        reason = ctx.get("reason", e.get("msg", "invalid"))
        allowed = ctx.get("allowed") or _allowed_for_field(field, model)
        line = f"{_loc_path(path, loc)}: {value!r} is invalid: {reason}; allowed: {allowed}"
        if value == "auto" and "auto" not in allowed:
            line += _AUTO_HINT
        lines.append(line)
    return lines


# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------
def parse_muon_params(params: Optional[dict], path: str = OPTIMIZER_PARAMS_PATH) -> MuonOptimizerParams:
    """Validate the ``optimizer.params`` of a Muon config. ``None`` (no params) means all defaults.

    Raises ConfigError naming ``<path>.<key>`` for each problem.
    """
    if params is None:
        params = {}
    if isinstance(params, MuonOptimizerParams):
        return params
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: {params!r} is invalid: must be an object (a dict of optimizer settings)")
    bad_keys = [k for k in params if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError([f"{path}: key {k!r} is invalid: keys must be strings" for k in bad_keys])
    try:
        return MuonOptimizerParams.model_validate(params)
    except ValidationError as err:
        raise ConfigError(_error_lines(err, path)) from None


def _is_muon(ds_config: dict) -> bool:
    opt = ds_config.get("optimizer")
    if not isinstance(opt, dict):
        return False
    kind = opt.get("type")
    return isinstance(kind, str) and kind.lower() == MUON_TYPE


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _async_io_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe swapping) is prebuilt in this DeepSpeed install, or can
    be JIT-built here (needs libaio and its headers)."""
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get("async_io"):
            return True
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception:  # noqa: BLE001 - an unusual DeepSpeed build; let DeepSpeed report it later
        return True
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


#: A JIT build lock of DeepSpeed's async_io op is taken for stale when nothing in its build directory
#: changed for this long (s). A live build writes an object file every few minutes even on 2 cores.
AIO_BUILD_STALE_S = 1800


def _async_io_build_lock_problem() -> Optional[str]:
    """A stale JIT build lock of DeepSpeed's async_io op, which would make NVMe offload hang.

    Unless async_io is prebuilt, DeepSpeed loads it through ``torch.utils.cpp_extension.load``, which
    takes a ``FileBaton`` (the file ``<TORCH_EXTENSIONS_DIR>/async_io/lock``) even when the op is
    already built, and waits without a deadline while that file exists. A build killed mid-way (a
    timed-out test, Ctrl-C, OOM) leaves the file behind, and every later NVMe run then hangs inside
    ``deepspeed.initialize``. Returns the problem when the lock exists and nothing in the build
    directory changed for :data:`AIO_BUILD_STALE_S` seconds, else None (a fresh lock is a build in
    progress, e.g. by another rank, which DeepSpeed waits for)."""
    import time
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get("async_io"):
            return None
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from torch.utils.cpp_extension import _get_build_directory
        build_dir = _get_build_directory(AsyncIOBuilder.NAME, verbose=False)
        lock = os.path.join(build_dir, "lock")
        if not os.path.exists(lock):
            return None
        idle = time.time() - max(os.stat(os.path.join(build_dir, f)).st_mtime for f in os.listdir(build_dir))
    except Exception:  # noqa: BLE001 - an unusual DeepSpeed/torch layout: nothing to check
        return None
    if idle < AIO_BUILD_STALE_S:
        return None
    return (f"zero_optimization.offload_optimizer.device: 'nvme' needs DeepSpeed's async_io op, whose JIT build "
            f"lock {lock} exists although nothing in {build_dir} changed for {idle / 60:.0f} min: a build that was "
            f"killed leaves it, and DeepSpeed {_deepspeed_version()} (torch.utils.cpp_extension.load's FileBaton) "
            f"then waits for it forever. If no process is building async_io, delete {lock}; or prebuild the op "
            f"(DS_BUILD_AIO=1 pip install deepspeed), or point TORCH_EXTENSIONS_DIR at another directory")


def _deepspeed_version() -> str:
    """The installed DeepSpeed's version, for messages that name one of its limits (read from the
    package metadata: importing deepspeed here would be slow)."""
    try:
        from importlib.metadata import version
        return version("deepspeed")
    except Exception:  # noqa: BLE001 - not installed the usual way
        return "(unknown version)"


def _o_direct_problem(path: str) -> Optional[str]:
    """DeepSpeed's async_io opens swap files with O_DIRECT, which tmpfs and some overlay/FUSE
    filesystems refuse (EINVAL) at the first swap. Probe it with a small file; None when it works."""
    if not hasattr(os, "O_DIRECT"):
        return None
    probe = os.path.join(path, f".ds_muon_o_direct_probe_{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError as err:
        return f"cannot open files there with O_DIRECT ({err.strerror}), which DeepSpeed's async_io needs"
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return None


def _nvme_path_problems(section: str, nvme_path: Any) -> list[str]:
    """An NVMe swap directory must be given, exist, and be writable by this process (DeepSpeed only
    fails later, at the first swap, or silently creates a mistyped mount point on the root disk)."""
    key = f"zero_optimization.{section}.nvme_path"
    if nvme_path is None or (isinstance(nvme_path, str) and not nvme_path.strip()):
        return [f"{key}: {nvme_path!r} is invalid: {section}.device is 'nvme', so a directory on a local NVMe "
                f"drive is required; set nvme_path (e.g. \"/local_nvme\"), or use device 'cpu'"]
    path = os.fspath(nvme_path)
    if not os.path.isdir(path):
        return [f"{key}: {path!r} does not exist or is not a directory: create it (mkdir -p {path}) on every node, "
                f"or point nvme_path at the mounted NVMe drive"]
    if not os.access(path, os.W_OK | os.X_OK):
        return [f"{key}: {path!r} is not writable by this process: DeepSpeed writes its swap files there; "
                f"fix its permissions, or choose a writable directory"]
    problem = _o_direct_problem(path)
    if problem:
        return [f"{key}: {path!r}: {problem} (tmpfs and some overlay filesystems do not support it); point "
                f"nvme_path at a directory on a local disk (ext4, xfs)"]
    return []


# Muon and AdamMini alike
NVME_PARAM_OFFLOAD_PROBLEM = ("zero_optimization.offload_param.device: 'nvme' (parameter offload to NVMe) is not "
                              "supported by ds_muon yet; use offload_param device 'cpu' or none (optimizer offload to "
                              "NVMe is supported: offload_optimizer.device 'nvme')")


def _nvme_offload_problems(offload: dict) -> list[str]:
    """Problems of an ``offload_optimizer`` with ``device: nvme`` (Muon and AdamMini): ``nvme_path`` must
    exist, be writable and support O_DIRECT; libaio must be there for DeepSpeed's async_io op, and no
    stale JIT build lock of that op (:func:`_async_io_build_lock_problem`). One line per problem."""
    problems = list(_nvme_path_problems("offload_optimizer", offload.get("nvme_path")))
    if not _async_io_available():
        problems.append("zero_optimization.offload_optimizer.device: 'nvme' needs DeepSpeed's async_io op, which "
                        "cannot be built here: libaio is missing; install it (Debian/Ubuntu: apt-get install "
                        "libaio-dev; RHEL: yum install libaio-devel), or use device 'cpu'")
    lock_problem = _async_io_build_lock_problem()
    if lock_problem is not None:
        problems.append(lock_problem)
    return problems


def validate_ds_config(ds_config: dict) -> Optional[MuonOptimizerParams]:
    """Check the ds_muon-relevant parts of a DeepSpeed config dict.

    Returns None when the optimizer type is not Muon (case-insensitive), so other configs pass
    through untouched. For a Muon config returns the validated :class:`MuonOptimizerParams`, or
    raises ConfigError listing every problem found:

    * ``optimizer.params`` as in :func:`parse_muon_params`;
    * ``zero_optimization.stage`` must be 3;
    * an NVMe ``offload_optimizer`` needs a ``nvme_path`` that exists, is writable and supports
      O_DIRECT, libaio for DeepSpeed's async_io op, and no stale JIT build lock of that op
      (:func:`_async_io_build_lock_problem`: DeepSpeed would wait for it forever); ``offload_param``
      to NVMe is refused;
    * ``gradient_clipping`` must be a number >= 0 (0 disables clipping).

    ``zero_optimization.save_muon_momentum_buffer_in_memory: true`` without an optimizer offload
    (``offload_optimizer.device`` "cpu" or "nvme") has no effect: the momentum already lives in
    accelerator memory. That is a ``UserWarning``, not an error, because the config is still
    correct and the same file is often shared between offloaded and non-offloaded runs.

    Everything else in ``zero_optimization`` is left to DeepSpeed's own pydantic model.
    """
    if not isinstance(ds_config, dict):
        raise ConfigError(f"DeepSpeed config: {type(ds_config).__name__} is invalid: validate_ds_config takes a "
                          f"dict; use load_ds_config(path) to read a JSON file")
    if not _is_muon(ds_config):
        return None

    problems: list[str] = []
    params: Optional[MuonOptimizerParams] = None
    try:
        params = parse_muon_params(ds_config["optimizer"].get("params"))
    except ConfigError as err:
        problems.extend(err.problems)

    zero = ds_config.get("zero_optimization")
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        problems.append(f"zero_optimization: {zero!r} is invalid: must be an object with \"stage\": 3")
        zero = {}
    stage = zero.get("stage", None)
    if not (_is_number(stage) and stage == 3):
        shown = "missing (DeepSpeed's default is 0)" if stage is None else f"{stage!r} is invalid"
        problems.append(f"zero_optimization.stage: {shown}: ds_muon serves ZeRO stage 3 (which runs on one GPU "
                        f"too); set zero_optimization.stage to 3, or use DeepSpeed's built-in Muon for stages 0-2 (call "
                        f"ds_muon.disable() first if ds_muon.enable() is in effect)")

    offload = zero.get("offload_optimizer")
    device = None
    if isinstance(offload, dict):
        device = offload.get("device")
        device = str(getattr(device, "value", device)).lower() if device is not None else None
        if device == "nvme":
            problems.extend(_nvme_offload_problems(offload))
            if (params is not None and params.momentum_dtype != "float32"
                    and zero.get("save_muon_momentum_buffer_in_memory") is not True):
                problems.append(f"optimizer.params.momentum_dtype: {params.momentum_dtype!r} with NVMe optimizer "
                                "offload needs zero_optimization.save_muon_momentum_buffer_in_memory: true (DeepSpeed's "
                                "swapper stores state in fp32 only); set it, or use momentum_dtype 'float32'")
    offload_param = zero.get("offload_param")
    param_device = offload_param.get("device") if isinstance(offload_param, dict) else None
    if str(getattr(param_device, "value", param_device)).lower() == "nvme":
        problems.append(NVME_PARAM_OFFLOAD_PROBLEM)

    if isinstance(offload, dict) and _is_number(offload.get("ratio")) and offload["ratio"] != 1.0:
        problems.append(f"zero_optimization.offload_optimizer.ratio: {offload['ratio']!r} is invalid: DeepSpeed "
                        f"{_deepspeed_version()}'s ZeRO-3 partial optimizer offload runs only with DeepSpeedCPUAdam as "
                        "the optimizer (DeepSpeedZeroOptimizer_Stage3 asserts 'Hybrid Optimizer Only Supports "
                        "DeepSpeedCPUAdam'), so neither DeepSpeed's built-in Muon nor ds_muon can use it; remove "
                        "ratio (or set it to 1.0) to offload the whole optimizer")
    if zero.get("zenflow"):
        problems.append("zero_optimization.zenflow: is not supported by ds_muon; remove it")
    if isinstance(offload, dict) and offload.get("super_offload"):
        problems.append(f"zero_optimization.offload_optimizer.super_offload: true is invalid: DeepSpeed "
                        f"{_deepspeed_version()}'s SuperOffload (SuperOffloadOptimizer_Stage3, CUDA only) steps every "
                        "param group with its own CPU Adam and has no Muon step, so neither DeepSpeed's built-in Muon "
                        "nor ds_muon can use it; remove super_offload (offload_optimizer device 'cpu' offloads "
                        "ds_muon's optimizer)")
    tp = ds_config.get("tensor_parallel")
    if isinstance(tp, dict) and _is_number(tp.get("autotp_size")) and tp["autotp_size"] > 1:
        problems.append(f"tensor_parallel.autotp_size: {tp['autotp_size']!r} is invalid: ds_muon orthogonalizes "
                        "whole matrices and does not support tensor parallelism yet; set autotp_size to 1")

    if params is not None and params.foreach is not None and not params.torch_adam:
        warnings.warn(
            "optimizer.params.foreach has no effect without optimizer.params.torch_adam: true (as in DeepSpeed, "
            "it is a flag of torch.optim.AdamW); set torch_adam true to use torch's AdamW, or remove foreach.",
            UserWarning, stacklevel=2)
    if zero.get("save_muon_momentum_buffer_in_memory") is True and device not in ("cpu", "nvme"):
        warnings.warn(
            "zero_optimization.save_muon_momentum_buffer_in_memory is true but the optimizer is not offloaded "
            "(offload_optimizer.device is not 'cpu' or 'nvme'), so it has no effect: the Muon momentum already "
            "stays in accelerator memory. Remove it, or offload the optimizer.",
            UserWarning, stacklevel=2)

    if "gradient_clipping" in ds_config:
        clip = ds_config["gradient_clipping"]
        if not _is_number(clip) or clip < 0 or clip != clip:
            line = (f"gradient_clipping: {clip!r} is invalid: the global gradient-norm clip threshold must be a "
                    f"number >= 0; allowed: a number >= 0 (0 disables clipping)")
            if clip == "auto":
                line += _AUTO_HINT
            problems.append(line)

    if problems:
        raise ConfigError(problems)
    return params


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r} in the DeepSpeed config; JSON would silently keep only "
                              f"the last value, so remove one")
        out[key] = value
    return out


def load_ds_config(path_or_dict: Union[str, os.PathLike, dict]) -> dict:
    """Return the DeepSpeed config as a dict: a deep copy of a dict, or the parsed JSON file at a path.

    Duplicate keys in the file are an error (plain ``json`` would keep the last one silently).
    """
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(f"DeepSpeed config: {path_or_dict!r} is invalid: pass a dict or the path of a JSON file")
    path = os.fspath(path_or_dict)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=_no_duplicate_keys)
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config: file {path!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config: {path!r} is not valid JSON: {err.msg} at line {err.lineno}, "
                          f"column {err.colno}") from None
    except ConfigError as err:
        raise ConfigError(f"DeepSpeed config {path!r}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config: {path!r} holds a JSON {type(data).__name__}, not an object")
    return data


# ------------------------------------------------------------------------------------------------
# Adam-mini: "optimizer": {"type": "AdamMini", "params": {...}}
# ------------------------------------------------------------------------------------------------
ADAM_MINI_TYPE = "adammini"


class AdamMiniOptimizerParams(BaseModel):
    """The params of "optimizer": {"type": "AdamMini", "params": {...}} in a DeepSpeed config.

    Adam-mini (Zhang et al., arXiv:2406.16793) keeps one second moment per block of a parameter instead
    of one per element; the blocks and the math are in :mod:`ds_muon.adam_mini`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, title="ds_muon AdamMini optimizer params")

    lr: float = Field(
        1e-3, gt=0, allow_inf_nan=False,
        description=("Learning rate (unit: step size per optimizer step, multiplying the bias-corrected Adam "
                     "update). Source: Adam-mini reference 'lr' (same meaning; use AdamW's value)."))
    betas: tuple[_Beta, _Beta] = Field(
        (0.9, 0.999), strict=False,
        description=("[beta1, beta2] (dimensionless): running averages of the gradient (per element) and of the "
                     "block mean of its square (per block). Source: Adam-mini reference 'betas', default as "
                     "torch.optim.AdamW."))
    eps: float = Field(
        1e-8, gt=0, allow_inf_nan=False,
        description="Denominator epsilon (unit: gradient units). Source: Adam-mini reference 'eps'.")
    weight_decay: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description=("Decoupled weight decay coefficient (p <- p*(1 - lr*weight_decay)), on every parameter except "
                     "norm weights and biases. Source: Adam-mini reference 'weight_decay', same exemptions."))
    block_rule: Literal["default", "neuron"] = Field(
        "default",
        description=("How parameters are cut into blocks that share one second moment. 'default': embeddings, "
                     "output heads and biases per element (Adam), query/key projections one block per attention "
                     "head, every other tensor one block. 'neuron': as default, but every other >=2-D tensor "
                     "(embeddings and heads included) one block per output row (the reference's v1.1 rule). "
                     "Source: Adam-mini reference (docs/adam_mini.md)."))
    max_consecutive_skipped_steps: int = Field(
        50, ge=0, le=1_000_000,
        description=("Stop the run after this many consecutive optimizer steps skipped because the global gradient "
                     "norm was NaN or Inf (unit: optimizer steps; 0: never stop). Source: ds_muon (as for Muon)."))

    def group_defaults(self) -> dict[str, Any]:
        """``{"lr", "betas", "eps", "weight_decay"}`` of the param groups."""
        return {"lr": self.lr, "betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    def adamw_implementation(self) -> dict[str, Any]:
        """DeepSpeed's element-wise Adam for the per-element groups: FusedAdam, or DeepSpeedCPUAdam offloaded."""
        return {"torch_adam": False, "foreach": None}


def parse_adam_mini_params(params: Optional[dict], path: str = OPTIMIZER_PARAMS_PATH) -> AdamMiniOptimizerParams:
    """Validate the ``optimizer.params`` of an AdamMini config (``None``: all defaults).

    Raises:
        ConfigError: naming ``<path>.<key>``, the value and what is allowed, for each problem.
    """
    if params is None:
        params = {}
    if isinstance(params, AdamMiniOptimizerParams):
        return params
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: {params!r} is invalid: must be an object (a dict of optimizer settings)")
    try:
        return AdamMiniOptimizerParams.model_validate(params)
    except ValidationError as err:
        raise ConfigError(_error_lines(err, path, AdamMiniOptimizerParams)) from None


def is_adam_mini(ds_config: Any) -> bool:
    """Whether a DeepSpeed config dict says ``"optimizer": {"type": "AdamMini"}`` (case-insensitive, as DeepSpeed)."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    kind = opt.get("type") if isinstance(opt, dict) else None
    return isinstance(kind, str) and kind.lower().replace("_", "").replace("-", "") == ADAM_MINI_TYPE


def validate_adam_mini_config(ds_config: dict) -> Optional[AdamMiniOptimizerParams]:
    """Check an AdamMini DeepSpeed config; None when the optimizer is not AdamMini.

    Checks ``optimizer.params`` (:func:`parse_adam_mini_params`), ``zero_optimization.stage`` == 3 (the
    Adam-mini ZeRO-3 step is the only distributed one), no NVMe parameter offload (as for Muon; NVMe
    optimizer offload is supported), no partial offload ``ratio``, and ``gradient_clipping`` >= 0.

    Raises:
        ConfigError: one line per problem.
    """
    if not is_adam_mini(ds_config):
        return None
    problems: list[str] = []
    params = None
    try:
        params = parse_adam_mini_params(ds_config["optimizer"].get("params"))
    except ConfigError as err:
        problems.extend(err.problems)
    zero = ds_config.get("zero_optimization") or {}
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage")
    if not (_is_number(stage) and stage == 3):
        shown = "missing (DeepSpeed's default is 0)" if stage is None else f"{stage!r} is invalid"
        problems.append(f"zero_optimization.stage: {shown}: ds_muon's AdamMini runs on ZeRO stage 3 only (which runs "
                        "on one GPU too); set zero_optimization.stage to 3")
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section)
        device = offload.get("device") if isinstance(offload, dict) else None
        nvme = str(getattr(device, "value", device)).lower() == "nvme"
        if section == "offload_param" and nvme:
            problems.append(NVME_PARAM_OFFLOAD_PROBLEM)
        elif nvme:  # the same environment checks as Muon's NVMe offload
            problems.extend(_nvme_offload_problems(offload))
        if section == "offload_optimizer" and isinstance(offload, dict) and _is_number(offload.get("ratio")) \
                and offload["ratio"] != 1.0:
            problems.append(f"zero_optimization.offload_optimizer.ratio: {offload['ratio']!r} is invalid with AdamMini "
                            "(DeepSpeed's partial offload needs DeepSpeedCPUAdam as the optimizer); remove it")
    if zero.get("zenflow"):
        problems.append("zero_optimization.zenflow: is not supported by ds_muon's AdamMini; remove it")
    tp = ds_config.get("tensor_parallel")
    if isinstance(tp, dict) and _is_number(tp.get("autotp_size")) and tp["autotp_size"] > 1:
        problems.append(f"tensor_parallel.autotp_size: {tp['autotp_size']!r} is invalid: AdamMini's blocks are whole "
                        "heads and tensors, and ds_muon does not support tensor parallelism yet; set autotp_size to 1")
    if "gradient_clipping" in ds_config:
        clip = ds_config["gradient_clipping"]
        if not _is_number(clip) or clip < 0 or clip != clip:
            problems.append(f"gradient_clipping: {clip!r} is invalid: allowed: a number >= 0 (0 disables clipping)")
    if problems:
        raise ConfigError(problems)
    return params
