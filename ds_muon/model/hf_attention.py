"""``attn_implementation="ds_muon_sdpa"``: transformers' SDPA attention that also records per-head max logits.

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
would drop padding). Importing this module imports transformers; ``import ds_muon`` does not.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .max_logits import max_logits_per_head, record_max_logits

NAME = "ds_muon_sdpa"


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
    if module.training and torch.is_grad_enabled():
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        # the causal flag exactly as sdpa_attention_forward hands it to SDPA (upper-left aligned)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
        record_max_logits(module, max_logits_per_head(query, key, scale, attention_mask, causal))
    return out


def register_attention() -> None:
    """Register ``"ds_muon_sdpa"`` with transformers (attention function and its mask builder); idempotent.

    After it, ``AutoModelForCausalLM.from_config(cfg, attn_implementation="ds_muon_sdpa")`` (or
    ``from_pretrained(...)``, or ``model.set_attn_implementation("ds_muon_sdpa")``) trains with SDPA
    and records the per-head max logits MuonClip needs. :func:`ds_muon.enable` calls it too: at once when
    ``transformers.modeling_utils`` is already imported, else right after its import.
    """
    AttentionInterface.register(NAME, ds_muon_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
