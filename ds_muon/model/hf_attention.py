"""``attn_implementation="ds_muon_sdpa"`` / ``"ds_muon_eager"``: transformers' attention that also records per-head max logits.

For MuonClip (QK-clip; :mod:`ds_muon.model.max_logits`). :func:`ds_muon_sdpa` has the signature of
transformers' attention functions (``transformers.integrations.sdpa_attention.sdpa_attention_forward``,
checked against transformers 5.x): it returns exactly what ``"sdpa"`` returns (it calls that function)
and, in a training forward (``module.training`` and autograd on), records
``max_logits_per_head(query, key, scaling, attention_mask, is_causal)`` for ``module`` with
:func:`ds_muon.model.max_logits.record_max_logits`. The query and key it receives are the ones the
softmax sees: after q/k norm (Qwen3) and RoPE.

:func:`register_attention` registers it under ``"ds_muon_sdpa"`` in transformers'
``AttentionInterface`` and registers SDPA's mask builder (``sdpa_mask``) under the same name in
``AttentionMaskInterface`` (transformers 5 builds no mask at all for a name it does not know, which
would drop padding).

:func:`ds_muon_eager` is the same for models that transformers runs only eagerly (``_supports_sdpa = False``:
GPT-OSS with its attention sinks; a model whose eager function adds soft-capping): it calls the eager
attention function of the module's own modeling file (``eager_attention_forward`` in
``sys.modules[type(module).__module__]``, so sinks and everything else that function does are the model's),
with ``eager_mask`` registered as its mask builder, and records ``q·k·scaling`` over the positions the additive
mask allows (a sink is a learned per-head logit, not ``q·k``: it is not part of the max).

Models that compute attention inline instead of through transformers' attention functions (Bloom; Falcon before
transformers 5.25, whose FalconAttention calls them from 5.25 on) cannot use either name: :func:`guard_falcon`
turns such a Falcon's bare ``KeyError: 'ds_muon_sdpa'`` into an error that says so. Importing this module imports transformers; ``import ds_muon`` does not.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .attention import FALCON_MODULE
from .max_logits import RECORDER, max_logits_per_head, record_max_logits

NAME = "ds_muon_sdpa"
EAGER_NAME = "ds_muon_eager"


def _recording(module: torch.nn.Module) -> bool:
    return module.training and RECORDER.wants(module)


def ds_muon_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` plus the per-head max-logit record of a training forward.

    Args: as ``sdpa_attention_forward``: ``query`` ``(B, H, Sq, D)``, ``key``/``value``
    ``(B, Hkv, Sk, D)``, ``attention_mask`` the mask transformers built for SDPA (bool, True = attend,
    ``(B, 1, Sq, Sk)``) or ``None`` (then causal per ``is_causal``/``module.is_causal``, as SDPA is
    given it), ``scaling`` the softmax scale (``None``: ``D ** -0.5``).

    Returns:
        ``(attn_output (B, Sq, H, D), None)``, identical to ``"sdpa"``.

    Records ``(H,)`` fp32 max logits for ``module`` (``ds_muon.model.max_logits.RECORDER``) only when
    ``module.training`` and autograd is on; the recorded logit is ``q·k * scaling`` (a position bias
    passed as ``position_bias`` is not added: it is not what QK-clip scales).
    """
    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
    if _recording(module):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        # the causal flag exactly as sdpa_attention_forward hands it to SDPA (upper-left aligned)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
        record_max_logits(module, max_logits_per_head(query, key, scale, attention_mask, causal))
    return out


def model_eager_function(module: torch.nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the modeling file that defines ``type(module)``.

    Raises:
        ValueError: that file has none (naming the module class and the fix).
    """
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if not callable(fn):
        raise ValueError(f"attn_implementation={EAGER_NAME!r}: {type(module).__name__} ({type(module).__module__}) "
                         "defines no eager_attention_forward to wrap; use attn_implementation='ds_muon_sdpa', or "
                         "call ds_muon.record_max_logits in the attention's forward")
    return fn


def ds_muon_eager(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                  **kwargs) -> tuple[torch.Tensor, Any]:
    """The model's own eager attention function plus the per-head max-logit record of a training forward.

    Args: as the model's ``eager_attention_forward``: ``query`` ``(B, H, Sq, D)``, ``key``/``value``
    ``(B, Hkv, Sk, D)``, ``attention_mask`` the additive float mask ``eager_mask`` built (``(B, 1, Sq, Sk)``,
    ``0`` = attend, the dtype's minimum = masked) or ``None`` (eager attention then masks nothing), ``scaling``
    the softmax scale (``None``: ``D ** -0.5``); the rest (GPT-OSS's ``s_aux`` sinks, ``softcap``,
    ``sliding_window``, ...) is passed through.

    Returns:
        What the model's eager function returns (``(attn_output (B, Sq, H, D), attn_weights)``), unchanged.

    Records ``(H,)`` fp32 max logits ``q·k * scaling`` over the allowed positions for ``module`` in a training
    forward, as :func:`ds_muon_sdpa`.

    Raises:
        ValueError: the module's modeling file has no ``eager_attention_forward``.
    """
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = model_eager_function(module)(module, query, key, value, attention_mask, scaling=scale, dropout=dropout,
                                        **kwargs)
    if _recording(module):
        record_max_logits(module, max_logits_per_head(query, key, scale, attention_mask))
    return out


class _FalconAttentionClasses(dict):
    """Falcon's ``FALCON_ATTENTION_CLASSES`` with a clear error for ds_muon's names instead of a bare KeyError."""

    def __missing__(self, key: Any) -> Any:
        if key in (NAME, EAGER_NAME):
            raise ValueError(
                f"attn_implementation={key!r} does not work with Falcon: FalconAttention computes its attention "
                "inline (torch's SDPA or its own matmul), not through transformers' attention functions, so ds_muon "
                "cannot record its max logits and QK-clip cannot be used on it (ds_muon refuses qk_clip for "
                "FalconAttention). Use attn_implementation='sdpa' and leave optimizer.params.qk_clip disabled")
        raise KeyError(key)


def guard_falcon() -> None:
    """Make Falcon's attention-class lookup name ds_muon's attention names in its error (no-op unless Falcon's
    modeling file is imported and has that lookup, ``FALCON_ATTENTION_CLASSES``: transformers before 5.25;
    idempotent)."""
    falcon = sys.modules.get(FALCON_MODULE)
    table = getattr(falcon, "FALCON_ATTENTION_CLASSES", None)
    if isinstance(table, dict) and not isinstance(table, _FalconAttentionClasses):
        falcon.FALCON_ATTENTION_CLASSES = _FalconAttentionClasses(table)


def register_attention() -> None:
    """Register ``"ds_muon_sdpa"`` and ``"ds_muon_eager"`` with transformers (attention functions and their mask
    builders); idempotent.

    After it, ``AutoModelForCausalLM.from_config(cfg, attn_implementation="ds_muon_sdpa")`` (or
    ``from_pretrained(...)``, or ``model.set_attn_implementation("ds_muon_sdpa")``) trains with SDPA
    and records the per-head max logits MuonClip needs; ``"ds_muon_eager"`` does the same with the model's eager
    attention (models without SDPA support, such as GPT-OSS). :func:`ds_muon.enable` calls it too: at once when
    ``transformers.modeling_utils`` is already imported, else right after its import (and :func:`guard_falcon`
    right after Falcon's modeling file is imported).
    """
    AttentionInterface.register(NAME, ds_muon_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    AttentionInterface.register(EAGER_NAME, ds_muon_eager)
    AttentionMaskInterface.register(EAGER_NAME, eager_mask)
    guard_falcon()
