"""``"optimizer": {"type": "AdamMini", "params": {...}}``: the Adam-mini optimizer params, validated (layer ``config``).

Adam-mini (Zhang et al., arXiv:2406.16793) keeps one second moment per block of a parameter instead of
one per element; the blocks are :mod:`ds_muon.model.adam_mini_blocks`, the math :mod:`ds_muon.core.adam_update`.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError
from .messages import error_lines
from .muon import OPTIMIZER_PARAMS_PATH, decay_norms_and_biases_field

__all__ = ["AdamMiniOptimizerParams", "parse_adam_mini_params"]

_Beta = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]


class AdamMiniOptimizerParams(BaseModel):
    """The params of "optimizer": {"type": "AdamMini", "params": {...}} in a DeepSpeed config.

    Adam-mini (Zhang et al., arXiv:2406.16793) keeps one second moment per block of a parameter instead
    of one per element; the blocks are :mod:`ds_muon.model.adam_mini_blocks`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, title="ds_muon AdamMini optimizer params")
    #: what a field accepts where its annotation says too little (ds_muon.config.messages)
    ALLOWED_TEXT: ClassVar[dict[str, str]] = {"betas": "a pair [beta1, beta2] of numbers, each in [0, 1)"}

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
                     "norm weights and biases (unless decay_norms_and_biases). Source: Adam-mini reference "
                     "'weight_decay', which exempts them too."))
    decay_norms_and_biases: bool = decay_norms_and_biases_field()
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
        raise ConfigError(error_lines(err, path, AdamMiniOptimizerParams)) from None
