"""Every refusal of QK-clip's target finder (ds_muon/model/attention.py) that no other test reaches, one process.

Each case builds a real transformers class from a tiny config (tests/support/qk_models.py; Persimmon here),
changes what the check is about (a norm module swapped for another, a projection replaced by one of another size, a
config value or module attribute changed, a child removed; the declared custom attention of tests/support/qk_models.py
for the ``muon_qk_clip()`` checks) and builds the oracle ``ds_muon.MuonAdamW`` with QK-clip on, as a user would. The
error must be a ``ConfigError`` (exactly that type, at construction, before any step), and its message must name the
key (``optimizer.params.qk_clip``), the module, what is wrong, and the fix. The refusals tested elsewhere: no
attention module found, a frozen q/k weight, a non-recording ``attn_implementation`` (tests/unit/test_qk_clip_rules.py);
Falcon, Bloom, GPT-OSS with ``"eager"`` (tests/unit/test_qk_clip_families.py).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from tests.support.qk_models import (TEST_ATTENTION, DeclaredNet, deepseek_v3, gpt_neox, llama_gqa,  # noqa: E402
                                     phi3_fused, qwen3_qk_norm, register_test_attention)

KEY = "optimizer.params.qk_clip"
DISABLE = "optimizer.params.qk_clip.enabled to false"


class ExpGainRMSNorm(nn.RMSNorm):
    """An RMSNorm with a log-parameterized gain (``x_hat * exp(w)``): neither ``x_hat * w`` nor ``x_hat * (1 + w)``."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, None, self.eps) * self.weight.exp()


def _attn(model):
    return model.model.layers[0].self_attn


def _qwen3(change):
    def build():
        model = qwen3_qk_norm(num_hidden_layers=1)
        change(_attn(model))
        return model
    return build


def _set(obj_of, **values):
    def change(model):
        for k, v in values.items():
            setattr(obj_of(model), k, v)
        return model
    return change


def _declared(spec):
    """DeclaredNet whose first attention declares ``spec(attention)`` instead of its own dict."""
    def build():
        model = DeclaredNet(num_hidden_layers=1)
        attn = model.attn[0]
        attn.muon_qk_clip = lambda: spec(attn)
        return model
    return build


def _persimmon():
    register_test_attention()
    cfg = transformers.PersimmonConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=4, attn_implementation=TEST_ATTENTION)
    return transformers.PersimmonForCausalLM(cfg)


def _attention_without_config():
    """transformers' LlamaAttention in a model of one's own, its config dropped: nothing states its heads."""
    attn = _attn(llama_gqa(num_hidden_layers=1))
    attn.config = None
    return nn.ModuleDict({"attn": attn})


def _neox(change):
    def build():
        model = gpt_neox(num_hidden_layers=1)
        change(model)
        return model
    return build


#: name -> (model builder, regexes the message must match: the module and what is wrong, then the fix)
CASES = {
    # q/k-norm gains (_gain, _qk_norm_target)
    "qk-norm-without-learnable-gain": (
        _qwen3(lambda a: setattr(a, "q_norm", nn.RMSNorm(8, elementwise_affine=False))),
        [r"Qwen3Attention 'model\.layers\.0\.self_attn': q_norm has no learnable 1-D gain",
         r"the norm undoes any scaling of W_q/W_k",
         r"give the norm a learnable gain \(e\.g\. elementwise_affine=True\)",
         DISABLE]),
    "qk-norm-that-cannot-be-probed": (  # GroupNorm(num_groups, num_channels): GroupNorm(8) fails
        _qwen3(lambda a: setattr(a, "k_norm", nn.GroupNorm(1, 8))),
        [r"cannot probe k_norm: ds_muon builds GroupNorm\(8\) to see how it applies its gain, which failed "
         r"\(TypeError: ", r"give the norm class a constructor that takes the normalized size first", DISABLE]),
    "qk-norm-gain-the-clip-cannot-scale": (
        _qwen3(lambda a: setattr(a, "q_norm", ExpGainRMSNorm(8))),
        [r"q_norm \(ExpGainRMSNorm\) applies its gain as neither x_hat \* w nor x_hat \* \(1 \+ w\)",
         r"use a norm of either kind \(torch\.nn\.RMSNorm, LayerNorm, Gemma's RMSNorm\)", DISABLE]),
    "qk-norm-wrong-number-of-gains": (
        _qwen3(lambda a: setattr(a, "q_norm", type(a.q_norm)(16))),
        [r"q_norm has 16 gains, neither head_dim 8 \(shared by all heads\) nor 4 heads x 8",
         r"normalize over head_dim or over the whole projection", DISABLE]),
    "qk-norm-on-queries-only": (
        _qwen3(lambda a: delattr(a, "k_norm")),
        [r"Qwen3Attention 'model\.layers\.0\.self_attn' normalizes only one of queries and keys \(q_norm\)",
         r"normalize both or neither", DISABLE]),
    # interleaved fused QKV (GPT-NeoX's layout only)
    "interleaved-qkv-of-another-class": (
        _persimmon,
        [r"PersimmonAttention 'model\.layers\.0\.self_attn': query_key_value interleaves q, k and v in a layout "
         r"ds_muon knows only for GPTNeoXAttention", r"declare them with a muon_qk_clip\(\) method", DISABLE]),
    "interleaved-qkv-wrong-row-count": (
        _neox(lambda m: setattr(m.gpt_neox.layers[0].attention, "query_key_value", nn.Linear(32, 64))),
        [r"GPTNeoXAttention 'gpt_neox\.layers\.0\.attention': query_key_value interleaves .* \(per head \[q; k; v\], "
         r"4 heads x 3 x 8 rows\)", r"muon_qk_clip\(\)", DISABLE]),
    "interleaved-qkv-with-fewer-key-heads": (
        _neox(_set(lambda m: m.config, num_key_value_heads=2)),
        [r"GPTNeoXAttention .* query_key_value interleaves", DISABLE]),
    # MLA
    "mla-without-its-dims": (
        lambda: _set(_attn, qk_rope_head_dim=0)(deepseek_v3(num_hidden_layers=1)),
        [r"DeepseekV3Attention 'model\.layers\.0\.self_attn' looks like MLA \(kv_a_proj_with_mqa, kv_b_proj\) but "
         r"does not state qk_nope_head_dim, qk_rope_head_dim, v_head_dim and num_heads",
         r"set them on the module as transformers' DeepseekV3Attention does", DISABLE]),
    # projections and head geometry
    "fused-qkv-proj-wrong-row-count": (
        lambda: _set(_attn, qkv_proj=nn.Linear(32, 40, bias=False))(phi3_fused(num_hidden_layers=1)),
        [r"Phi3Attention .*: qkv_proj has 40 rows, not \(heads 4 \+ 2 x kv heads 2\) x head_dim 8",
         r"declare the layout with a muon_qk_clip\(\) method", DISABLE]),
    "q-proj-too-small-for-the-heads": (
        lambda: _set(_attn, q_proj=nn.Linear(32, 16, bias=False))(llama_gqa(num_hidden_layers=1)),
        [r"LlamaAttention .*: parameter 'model\.layers\.0\.self_attn\.q_proj\.weight' of shape \(16, 32\) cannot hold "
         r"4 heads of 8 rows", r"correct the head geometry \(num_heads, num_kv_heads, head_dim in the model config",
         DISABLE]),
    "heads-not-a-multiple-of-key-heads": (
        lambda: _set(lambda m: m.config, num_key_value_heads=3)(llama_gqa(num_hidden_layers=1)),
        [r"LlamaAttention .*: 4 query heads, 3 key heads and head_dim 8 do not fit \(all >= 1, num_heads a multiple "
         r"of num_kv_heads\)", r"correct them \(in the model config", DISABLE]),
    "no-head-geometry": (
        _attention_without_config,
        [r"LlamaAttention 'attn': no head geometry \(model\.config with num_attention_heads, num_key_value_heads, "
         r"head_dim\)", r"declare it with a muon_qk_clip\(\) method"]),
    # a custom attention's muon_qk_clip()
    "declared-dict-without-k": (
        _declared(lambda a: {"q": a.q.weight, "num_heads": 4, "num_kv_heads": 2}),
        [r"DeclaredAttention 'attn\.0'\.muon_qk_clip\(\) must return a dict with 'q' and 'k'",
         r"'num_heads' and 'num_kv_heads'; optional: 'q_bias', 'k_bias', 'head_dim'"]),
    "declared-copy-of-a-weight": (
        _declared(lambda a: {"q": a.q.weight.detach().clone(), "k": a.k.weight, "num_heads": 4, "num_kv_heads": 2}),
        [r"DeclaredAttention 'attn\.0'\.muon_qk_clip\(\): a declared tensor is not a parameter of the model",
         r"return the module's own parameters \(e\.g\. self\.q_proj\.weight\), not a copy, slice or view"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_refusal_names_key_problem_and_fix(name):
    from ds_muon import MuonAdamW
    from ds_muon.errors import ConfigError
    build, patterns = CASES[name]
    torch.manual_seed(0)
    model = build()
    with pytest.raises(Exception) as info:
        MuonAdamW(model, qk_clip={"enabled": True, "threshold": 5.0})
    assert type(info.value) is ConfigError, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert message.startswith(f"{KEY}: "), message
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"
