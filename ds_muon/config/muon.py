"""``"optimizer": {"type": "Muon", "params": {...}}``: the Muon optimizer params, validated (layer ``config``).

:class:`MuonOptimizerParams` (pydantic v2, ``extra="forbid"``, strict): every key has a type, bounds, a
default, and a description stating its unit and its source. DeepSpeed does not validate
``optimizer.params`` at all, so ds_muon validates it strictly: an unknown key is an error with a "did you
mean" hint, a key DeepSpeed's built-in Muon rejects too (``max_grad_norm``) is an error that says so, and
a value of the wrong type is not coerced (``"nesterov": "yes"`` is an error, not ``True``).

The keys DeepSpeed's built-in Muon accepts keep its meaning, so an existing config works unchanged:
``lr``, ``momentum``, ``weight_decay``, ``muon_lr``, ``adam_lr``, ``betas``, ``eps``, ``ns_method``,
``adam_w_mode``, ``torch_adam``, ``foreach``, ``fp32_optimizer_states``, ``per_head_muon`` (see
``DeepSpeedEngine._configure_basic_optimizer``, ``get_optimizer_configuration`` and ``_muon_param_groups``
in deepspeed 0.18.9-0.19.8: ``lr``/``weight_decay`` are shared by both halves, ``muon_lr``/``adam_lr``
override ``lr`` per half, ``betas``/``eps`` go to the AdamW half, ``momentum``/``ns_method`` to the Muon
half, ``torch_adam``/``foreach`` pick ``torch.optim.AdamW`` for the AdamW half; ``fp32_optimizer_states``
and ``adam_w_mode`` only accept ``true``, what ds_muon does). The one visible difference is the default
``ns_method``: DeepSpeed's is ``"gram"``, ours is ``"standard"`` until measurement picks one. ds_muon adds
``nesterov``, ``ns_steps``, ``ns_dtype``, ``update_scale``, ``adam_weight_decay``, ``exchange_dtype``,
``muon_params``, ``adamw_params``, ``muon_splits``, ``qk_clip`` and more, and accepts
``adam_betas``/``adam_eps`` as aliases of ``betas``/``eps``, and torch's/torchtitan's ``adjust_lr_fn`` with
``"original"``/``"match_rms_adamw"`` for ``update_scale`` ``"shape"``/``"rms_match"``.
"""
from __future__ import annotations

import copy
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError
from .messages import custom_error
from .messages import error_lines

__all__ = ["MuonSplit", "QKClipParams", "decay_norms_and_biases_field", "MuonOptimizerParams", "parse_muon_params", "OPTIMIZER_PARAMS_PATH",
           "UNSUPPORTED_BUILTIN_KEYS", "ONLY_TRUE_REASONS", "UPDATE_SCALE_ALIASES"]

OPTIMIZER_PARAMS_PATH = "optimizer.params"

# Keys DeepSpeed's built-in Muon path reads from optimizer.params that ds_muon does not support,
# with the reason and the fix. (DeepSpeed 0.18.9-0.19.8: _configure_basic_optimizer rejects max_grad_norm.
# The other keys it reads -- lr, muon_lr, adam_lr, momentum, weight_decay, ns_method, betas, eps,
# adam_w_mode, per_head_muon (deepspeed/__init__.py), and the ones get_optimizer_configuration pops:
# torch_adam, foreach, fp32_optimizer_states -- are fields.)
UNSUPPORTED_BUILTIN_KEYS: dict[str, str] = {
    "max_grad_norm": ("is not an optimizer parameter (DeepSpeed rejects it too); set the top-level "
                      "'gradient_clipping' of the DeepSpeed config instead"),
}

_Beta = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]

# name -> alias (accepted on input, not both at once).
_ALIASES: dict[str, str] = {"betas": "adam_betas", "eps": "adam_eps", "update_scale": "adjust_lr_fn"}
#: update_scale's values under the names torch's ``torch.optim.Muon`` and torchtitan give them (their key:
#: ``adjust_lr_fn``): accepted as aliases of ds_muon's names and stored as those.
UPDATE_SCALE_ALIASES: dict[str, str] = {"original": "shape", "match_rms_adamw": "rms_match"}


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


#: Built-in keys whose only value ds_muon implements is true, and why.
ONLY_TRUE_REASONS = {
    "adam_w_mode": ("ds_muon only implements decoupled weight decay (AdamW) for its AdamW half; Adam with L2 "
                    "regularization (adam_w_mode=false) is not supported"),
    "fp32_optimizer_states": ("ds_muon keeps the Adam moments in fp32 whatever the model dtype (in DeepSpeed this key "
                              "only sets DeepSpeedCPUAdam's moment dtype), and lower-precision Adam moments are not "
                              "supported; for bf16 Muon momentum set momentum_dtype 'bfloat16' instead"),
}


_BlockSize = Annotated[int, Field(ge=1)]


def decay_norms_and_biases_field():
    """The ``decay_norms_and_biases`` field, one definition for the Muon and AdamMini params."""
    return Field(
        False,
        description=("Apply weight decay to norm weights and biases too. false (default): they get none, as in "
                     "Hugging Face Trainer (no decay for biases and LayerNorm/RMSNorm weights: parameters of a norm "
                     "module, named *bias*, bias_*, or matching Trainer's norm name patterns), in param groups of "
                     "their own with weight_decay 0; true: every parameter decays with its group's weight_decay. "
                     "Source: Hugging Face Trainer.get_decay_parameter_names (docs/selection.md, 'Weight decay')."))


def _split_schema(schema: dict[str, Any]) -> None:
    """JSON Schema of a split: the object form, or a bare list (row block sizes), as the model accepts."""
    obj = dict(schema, minProperties=1)
    schema.clear()
    schema.update(title=obj.pop("title"), description=obj.pop("description"), anyOf=[
        {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1,
         "description": "Row block sizes in order (the same as {\"rows\": [...]})."}, obj])


#: a switch whose "auto" lets ds_muon decide where it applies (elementwise_compile, overlap_backward)
AutoOrBool = Union[Literal["auto"], bool]

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
            raise custom_error("a split needs 'rows' and/or 'cols'", allowed="{\"rows\": [...]} and/or {\"cols\": [...]}")
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
    until_step: Optional[int] = Field(
        None, ge=1,
        description=("The last optimizer step that clips (a warm-up window: steps 1..until_step clip, counted in "
                     "applied steps, an fp16 overflow step does not count); after it QK-clip stops, and so does the "
                     "max-logit recording of ds_muon_sdpa/ds_muon_eager (no cost). null: every step. Source: ds_muon "
                     "(trainers that clip only early in training)."))


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
    #: what a field accepts where its annotation says too little (ds_muon.config.messages)
    ALLOWED_TEXT: ClassVar[dict[str, str]] = {
        "betas": "a pair [beta1, beta2] of numbers, each in [0, 1)",
        "exchange_bucket_mb": ("a number of MiB in (0, 1048576] (MiB, not elements: DeepSpeed's *_bucket_size keys "
                               "count elements; 256 MiB is the default)"),
        "muon_splits": ("an object mapping glob patterns to a list of row block sizes (ints >= 1) or to "
                        "{\"rows\": [...], \"cols\": [...]}"),
    }
    #: keys DeepSpeed's built-in Muon path reads that ds_muon refuses, with the reason and the fix
    REFUSED_KEYS: ClassVar[dict[str, str]] = UNSUPPORTED_BUILTIN_KEYS

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
        description=("Compile the Newton-Schulz iteration with torch.compile (static shapes: one graph per call "
                     "shape) when it runs on a CUDA device; on CPU it runs eagerly. Whether the element-wise passes "
                     "are compiled too is elementwise_compile's choice (its 'auto' follows this key). Source: ds_muon; "
                     "the gains are measured by benchmarks/step_time.py."))
    elementwise_compile: AutoOrBool = Field(
        "auto",
        description=("Run the element-wise passes of the ZeRO Muon step (the momentum step with its Nesterov blend, "
                     "and the update apply with decoupled weight decay) as one torch.compile'd pass each over the "
                     "shard (16 and 12 bytes per element instead of 24 and 20). 'auto': compiled on CUDA when "
                     "ns_compile is true; true: compiled on CUDA; false: eager. On the CPU (and under optimizer "
                     "offload, where the partitions live in CPU memory) always eager. Source: ds_muon; measured by "
                     "benchmarks/elementwise.py."))
    ns_autotune: bool = Field(
        False,
        description=("With ns_compile on CUDA, compile Newton-Schulz as heavyball does: torch.compile mode "
                     "'max-autotune-no-cudagraphs' with static shapes (one graph per (batch, rows, cols) of the owner "
                     "plan, Triton autotuning of each on the first step: 19.9 s cold for 16x2048x2048 on one H200). "
                     "Measured on one H200, bf16, 5 steps (docs/benchmarks.md, \"Issue 27, items 3-5\"): 86% of the matmul rate "
                     "on 16x2048x2048, against 87% with the static-shape default and 79% with dynamic shapes; it "
                     "no longer beats the default there. Off by default for the start-up time. Prints a progress line per graph on rank 0 and keeps "
                     "inductor's caches in $XDG_CACHE_HOME/ds_muon/torchinductor (~/.cache/...) unless "
                     "TORCHINDUCTOR_CACHE_DIR is set, so a second start with the same shapes skips the tuning. "
                     "Source: ds_muon, benchmarks/step_time.py --ns-micro."))
    update_scale: Literal["shape", "rms_match", "original", "match_rms_adamw"] = Field(
        "shape",
        validation_alias=AliasChoices("update_scale", "adjust_lr_fn"),
        description=("Dimensionless multiplier of the orthogonalized update of a (rows, cols) matrix (conv "
                     "weights as (out, in*k*k)): 'shape' = sqrt(max(1, rows/cols)); 'rms_match' = "
                     "0.2*sqrt(max(rows, cols)), which matches AdamW's update RMS so AdamW's lr and weight decay "
                     "carry over. torch.optim.Muon's and torchtitan's names are accepted as aliases: the key "
                     "'adjust_lr_fn', and the values 'original' (= 'shape') and 'match_rms_adamw' (= 'rms_match'), "
                     "read as ds_muon's names. Source: 'shape' from Keller Jordan's Muon, 'rms_match' from Moonlight "
                     "(Liu et al., arXiv:2502.16982)."))

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
    decay_norms_and_biases: bool = decay_norms_and_biases_field()

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
        description=("Size of one owner-exchange bucket (unit: MiB of full Muon matrices in the exchange dtype, not "
                     "elements: DeepSpeed's *_bucket_size keys such as reduce_bucket_size count elements; a "
                     "matrix larger than this is a bucket of its own). A sub-group's matrices are exchanged and "
                     "orthogonalized bucket by bucket, the next bucket's all_to_all overlapping the current one's "
                     "Newton-Schulz; at most 3 buckets hold buffers at once. Per rank that is 3 x (this rank's chunks of "
                     "a bucket + its owned matrices of a bucket) plus one batch of owned matrices in the NS dtype: "
                     "about 6 x exchange_bucket_mb / W MiB when a bucket has at least W matrices, up to about "
                     "3 x exchange_bucket_mb MiB when it has few large ones. Source: ds_muon."))

    overlap_backward: AutoOrBool = Field(
        "auto",
        description=("Run the Muon step's momentum, owner exchange and Newton-Schulz speculatively during the last "
                     "micro-batch's backward, bucket by bucket as ZeRO reduces the gradients, and apply the kept update "
                     "when the step commits. Exact: a step whose gradient clipping fires, that is skipped for an fp16 "
                     "overflow or whose loss scale changed, and a sub-group with a Muon parameter that got no "
                     "gradient at all (an expert that is a parameter of its own and got no token), recompute the "
                     "sub-group as without overlap; blocks of a stacked parameter that got no gradient on any rank "
                     "(a stacked expert without tokens) are set aside at the commit, as the step without overlap "
                     "sets them aside. Costs a stash per owner-plan bucket in the exchange dtype, held from "
                     "the bucket's backward to the commit (at most the local Muon shard's size; with overlap_cuda_graphs "
                     "a bucket whose stash address does not repeat keeps it across steps), an fp32 scratch of one owner-plan bucket's stretch "
                     "of the shard while it is speculated, and at ZeRO-1/2 one gradient buffer of the partition in the "
                     "gradient dtype. 'auto': on where it is exact and measured faster: ZeRO-3 on CUDA at one "
                     "data-parallel rank without optimizer offload, with overlap_cuda_graphs (one H200, 934M, 3 rounds: "
                     "0.271 s per step against AdamW's 0.273 and the built-in Muon's 0.482; peak memory +1.3 GiB; "
                     "docs/benchmarks.md, 'Issue 40: the overlapped step as CUDA graphs'); off elsewhere (at W >= 2 "
                     "its launches run on backward's host thread, measured slower at W=1 that way; ZeRO-1/2 not yet "
                     "measured on a GPU against the step without overlap; the CPU has no streams). Where it runs and zero_optimization.reduce_bucket_size is not set, "
                     "ds_muon gives DeepSpeed 1e8 elements instead of its 5e8, so that the first gradient bucket, and "
                     "the speculation with it, starts early in backward (logged once; a set value is kept). true: on where it applies (ZeRO-3, ZeRO-2, ZeRO-1 with overlap_comm; "
                     "no optimizer offload; on CUDA on a side stream, on the CPU inline in backward: exact, not "
                     "faster), refused with optimizer offload, at ZeRO-1 without overlap_comm (DeepSpeed reduces after "
                     "backward there) and with AutoTP; false: off. Source: ds_muon."))

    overlap_cuda_graphs: bool = Field(
        True,
        description=("With overlap_backward on CUDA, where a Muon sub-group's owner exchange is one rank (W=1): run each "
                     "owner-plan bucket's speculative step (momentum, Newton-Schulz) eagerly once, then capture it as "
                     "one CUDA graph and replay that, so that the speculation costs backward's host thread one launch "
                     "per bucket instead of a few hundred. Exact (the same kernels on the same buffers); a graph is "
                     "captured again when a buffer or the loss scale it was captured with changes. Costs one memory "
                     "pool of about one bucket's working set for the optimizer's life. Not supported together with torch.compile's mode='reduce-overhead' (it frees cuBLAS "
                     "workspaces the graphs use): set false there. false: eager launches. No effect without "
                     "overlap_backward. Source: "
                     "ds_muon; see docs/design.md, 'The overlapped step'."))

    tp_mode: Literal["full", "shard"] = Field(
        "full",
        description=("How Muon treats a matrix that DeepSpeed's AutoTP (tensor_parallel.autotp_size > 1) splits across "
                     "the tensor-parallel group. 'full': the owner rank gathers every tensor-parallel shard's pieces "
                     "(over the tensor-parallel x data-parallel ranks, in the same owner all_to_all) and "
                     "orthogonalizes and shape-scales the full matrix once, as Muon does without tensor parallelism "
                     "(Megatron's 'distributed' mode). 'shard': each shard is orthogonalized and scaled on its own "
                     "within its data-parallel group, which saves the tensor-parallel part of the exchange but is a "
                     "different update (NS of a shard is not a shard of NS; Megatron's 'blockwise' mode, what "
                     "DeepSpeed's built-in Muon does). No effect without AutoTP. Source: ds_muon; see "
                     "docs/parallelism_tp.md."))

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
                     "\"monitor_per_head\": bool, \"until_step\": null or N}. After the "
                     "optimizer step, for each attention head h whose max logit S_h of the step (all micro-batches, "
                     "all data-parallel ranks) exceeds tau: gamma = tau/S_h, the head's W_q rows (and q bias) *= "
                     "gamma^alpha, its key head's W_k rows (and k bias) *= gamma_kv^(1-alpha), gamma_kv from the "
                     "largest S over the query heads sharing that key head (GQA); MLA, q/k-norm gains and fused QKV "
                     "by their own rules (docs/qk_clip.md). Source: Kimi K2 (arXiv 2507.20534, "
                     "section 2.1); see docs/qk_clip.md."))

    # ---- validators --------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _name_and_alias_not_both(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, alias in _ALIASES.items():
                if name in data and alias in data:
                    raise custom_error(
                        f"both '{name}' and its alias '{alias}' are given",
                        key=alias, value=data[alias],
                        allowed=f"one of '{name}' or '{alias}', not both (they mean the same)")
        return data

    @field_validator("update_scale")
    @classmethod
    def _update_scale_by_ds_muons_name(cls, value: str) -> str:
        return UPDATE_SCALE_ALIASES.get(value, value)

    @field_validator("adam_w_mode", "fp32_optimizer_states")
    @classmethod
    def _only_true(cls, value: bool, info) -> bool:
        if value is not True:
            raise custom_error(ONLY_TRUE_REASONS[info.field_name], allowed="true (or leave the key out)")
        return value

    @field_validator("muon_params", "adamw_params")
    @classmethod
    def _patterns_non_empty(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern.strip():
                raise custom_error("a pattern is empty", allowed="non-empty fnmatch glob patterns such as '*.mlp.*.weight'")
        return value

    @field_validator("muon_splits")
    @classmethod
    def _split_patterns_non_empty(cls, value: dict) -> dict:
        if any(not pattern.strip() for pattern in value):
            raise custom_error("a pattern is empty", allowed="non-empty fnmatch glob patterns such as '*.attn.wqkv.weight'")
        return value

    def declared_splits(self) -> dict[str, dict]:
        """``muon_splits`` as ``{pattern: {"rows": [...] or None, "cols": [...] or None}}``."""
        return {k: v.model_dump() for k, v in self.muon_splits.items()}

    @model_validator(mode="after")
    def _patterns_disjoint(self) -> "MuonOptimizerParams":
        both = sorted(set(self.muon_params) & set(self.adamw_params))
        if both:
            raise custom_error(f"pattern(s) {both} are in both muon_params and adamw_params",
                          key="adamw_params", value=self.adamw_params,
                          allowed="each pattern in one list only")
        return self

    @model_validator(mode="after")
    def _autotune_needs_compile(self) -> "MuonOptimizerParams":
        if self.ns_autotune and not self.ns_compile:
            raise custom_error("ns_autotune tunes the compiled Newton-Schulz, but ns_compile is false",
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



# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------
def parse_muon_params(params: Optional[dict], path: str = OPTIMIZER_PARAMS_PATH) -> MuonOptimizerParams:
    """Validate the ``optimizer.params`` of a Muon config. ``None`` (no params) means all defaults.

    Raises:
        ConfigError: naming ``<path>.<key>``, the value and what is allowed, one line per problem.
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
        raise ConfigError(error_lines(err, path, MuonOptimizerParams)) from None
