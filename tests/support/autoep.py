"""DeepSpeed AutoEP in the tests: a tiny Qwen3-MoE, the AutoEP config, the test-only transformers shim, and the
way back from AutoEP's expert layout to transformers' (tests/dist/test_autoep.py; docs/parallelism.md, "AutoEP").
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch

from tests.support.families import causal_lm

EXPERTS, TOP_K, MOE_INTER, EP = 6, 2, 16, 2
#: DeepSpeed's AutoEP section: EP ranks per expert-parallel group; the grouped-GEMM kernels are CUDA's, the
#: per-expert loop runs on CPU.
AUTOEP = {"enabled": True, "autoep_size": EP, "use_grouped_mm": False}


def qwen3_moe():
    """``Qwen3MoeForCausalLM`` (2 layers, hidden 32, 4 heads of 8 / 2 KV heads, 6 experts of width 16, top 2,
    vocab 64; ``attn_implementation="ds_muon_sdpa"``, which records the per-head max logits QK-clip reads) with the
    harness's ``forward(tokens, targets, use_extra) -> loss``; seeded, so every rank builds the same weights."""
    import transformers

    import ds_muon
    ds_muon.register_attention()
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, num_experts=EXPERTS,
                                      num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_INTER,
                                      attn_implementation="ds_muon_sdpa")
    torch.manual_seed(0)
    return causal_lm(transformers.Qwen3MoeForCausalLM)(cfg)


@contextlib.contextmanager
def registry_shim() -> Iterator[bool]:
    """TEST-ONLY compatibility shim for the one incompatibility between DeepSpeed 0.19.8's AutoEP and transformers
    >= 5.23 (``ds_muon.integration.autoep.transformers_problem``), so the tests can run AutoEP under CI's
    transformers 5.25.0. ds_muon itself does not do this: it refuses (docs/parallelism.md, "AutoEP").

    DeepSpeed (``auto_ep_presets/base.py``) treats ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` as
    the plain ``{str(model class): outputs}`` dict it was up to transformers 5.22: ``get(key, default)`` to save an
    entry and ``registry[key] = entry`` to restore it, with the class's string as the key. transformers 5.23 made it
    a ``_CanRecordRegistry`` keyed on the same strings but whose ``get(model)`` and ``__setitem__(model, ...)`` take a
    model and compute the string themselves. For the duration of the block, both also accept DeepSpeed's string key
    (and ``get`` its default) and then act as the plain dict did; a model argument (transformers' own calls) goes
    to transformers' methods unchanged. Yields whether a shim was needed (False: the registry is a plain dict).
    """
    from transformers.utils import output_capturing
    cls = type(output_capturing._CAN_RECORD_REGISTRY)
    if cls is dict:
        yield False
        return
    get, setitem = cls.get, cls.__setitem__

    def shim_get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else get(self, key)

    def shim_setitem(self, key, value):
        return dict.__setitem__(self, key, value) if isinstance(key, str) else setitem(self, key, value)

    cls.get, cls.__setitem__ = shim_get, shim_setitem
    try:
        yield True
    finally:
        cls.get, cls.__setitem__ = get, setitem


_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(w1|w2|w3)$")


def hf_name(name: str) -> str:
    """transformers' name of an AutoEP parameter: ``mlp.router.gate.weight`` -> ``mlp.gate.weight``,
    ``mlp.experts.w1``/``w3`` -> ``mlp.experts.gate_up_proj``, ``w2`` -> ``down_proj``; others unchanged."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.experts.{'down_proj' if m.group(2) == 'w2' else 'gate_up_proj'}"
    return name.replace(".mlp.router.gate.", ".mlp.gate.")


def to_hf(per_ep_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers' parameters from AutoEP's: ``per_ep_rank[e]`` holds expert-parallel rank ``e``'s full
    parameters (its local experts ``w1``/``w3`` ``[E/EP, I, d]``, ``w2`` ``[E/EP, d, I]``; the rest as on every rank).
    ``gate_up_proj`` ``[E, 2I, d]`` = per expert ``[w1; w3]`` (gate rows first, as Qwen3-MoE's forward ``chunk(2)``
    reads them), ``down_proj`` ``[E, d, I]`` = ``w2``, experts in expert-parallel rank order (DeepSpeed's uniform
    placement: rank ``e`` holds experts ``e*E/EP .. (e+1)*E/EP - 1``)."""
    out = {}
    for name, value in per_ep_rank[0].items():
        m = _EXPERT.match(name)
        if m is None:
            out[hf_name(name)] = value
        elif m.group(2) == "w1":
            w3 = name[:-2] + "w3"
            out[hf_name(name)] = torch.cat([torch.cat([r[name], r[w3]], dim=1) for r in per_ep_rank])
        elif m.group(2) == "w2":
            out[hf_name(name)] = torch.cat([r[name] for r in per_ep_rank])
    return out
