"""Tiny attention models that record their exact per-head max logits, for the QK-clip tests.

The logits are computed brute force (the full ``(B, H, T, T)`` score matrix, causal mask) and reported
with :func:`ds_muon.record_max_logits`, independently of the production ``ds_muon_sdpa`` attention, so
the clip is tested on real logits. The q/k weights are initialised large enough that logits of O(10)
arise, so a threshold in that range clips some heads and not others.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ds_muon.model.max_logits import record_max_logits
from tests.support.models import VOCAB

TEST_ATTENTION = "qk_test_recording_sdpa"
QK_GAIN = 12.0  # q/k weights are scaled by this at init (logits grow ~ its square)


TEST_EAGER = "qk_test_recording_eager"  # the model's own eager attention function (GPT-OSS: sinks), brute-force record
#: The last brute-force max logits of every attention module (any forward, training or not): what the tests
#: read to measure logits independently of ds_muon's recorder.
MEASURED: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


def brute_max_logits(query: torch.Tensor, key: torch.Tensor, scaling: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(H,)`` max over batch and allowed positions of ``q_i . k_j * scaling``: causal (j <= i) without a mask,
    else where the mask allows (bool True, or an additive float mask's entries > -1e4; broadcast over heads).

    query ``(B, H, T, d)``, key ``(B, Hkv, T, d)`` (GQA: key head ``h // (H / Hkv)``), any float dtype;
    computed in fp32."""
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    scores = query.float() @ k.float().transpose(-1, -2) * scaling
    t, s = scores.shape[-2:]
    if mask is None:
        allowed = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(s - t)
    else:
        allowed = mask if mask.dtype == torch.bool else mask > -1e4
        allowed = allowed[..., :t, :s]
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


def _measure(module, query, key, attention_mask, scaling):
    value = brute_max_logits(query, key, scaling if scaling is not None else query.shape[-1] ** -0.5, attention_mask)
    MEASURED[module] = value.detach()
    record_max_logits(module, value)


def _recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    _measure(module, query, key, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _recording_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    import sys
    _measure(module, query, key, attention_mask, scaling)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register_test_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    AttentionInterface.register(TEST_ATTENTION, _recording_attention)
    AttentionMaskInterface.register(TEST_ATTENTION, sdpa_mask)
    AttentionInterface.register(TEST_EAGER, _recording_eager)
    AttentionMaskInterface.register(TEST_EAGER, eager_mask)


def _lm(base):
    class LM(base):
        def forward(self, tokens, targets, use_extra=True):  # the harness's signature
            return super().forward(input_ids=tokens, labels=targets).loss

    LM.__name__ = LM.__qualname__ = base.__name__
    return LM


def _hf(cls_name: str, cfg_name: str, **kw):
    import transformers
    register_test_attention()
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                attn_implementation=TEST_ATTENTION)
    base.update(kw)
    model = _lm(getattr(transformers, cls_name))(getattr(transformers, cfg_name)(**base))
    _boost_qk(model)
    return model


#: Projections whose weights the test models scale by QK_GAIN (MLA's too: q_b_proj, kv_b_proj, and the rotary key's
#: kv_a_proj_with_mqa; GPT-NeoX's query_key_value).
BOOSTED = ("q_proj", "k_proj", "qkv_proj", "q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa", "query_key_value")
NORM_GAIN = 1.8  # q/k-norm gains of the qk-norm models (logits grow ~ its square)


def _boost_qk(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(f".{k}." in name for k in BOOSTED):
                p.mul_(QK_GAIN)
            elif any(f".{k}.weight" in name for k in ("q_norm", "k_norm")):  # heads of different strengths
                spread = torch.linspace(0.7, 1.3, p.numel())
                plus_one = "Gemma" in type(model).__name__  # Gemma's RMSNorm applies 1 + w
                gain = NORM_GAIN * spread
                p.copy_(gain - 1 if plus_one else gain)


def llama_gqa(**kw):
    """Llama, 4 query heads over 2 key heads, no biases."""
    return _hf("LlamaForCausalLM", "LlamaConfig", **kw)


def qwen2_bias(**kw):
    """Qwen2 (q/k/v biases), GQA 4/2."""
    return _hf("Qwen2ForCausalLM", "Qwen2Config", **kw)


def llama_ds_muon_sdpa(**kw):
    """Llama GQA 4/2 through ds_muon's own attention function (``attn_implementation="ds_muon_sdpa"``), so the
    clip runs end to end on the production recording rather than the brute-force test attention."""
    import ds_muon
    ds_muon.register_attention()
    return _hf("LlamaForCausalLM", "LlamaConfig", **dict(kw, attn_implementation="ds_muon_sdpa"))


def phi3_fused(**kw):
    """Phi-3: fused qkv_proj [Q; K; V], GQA 4/2."""
    return _hf("Phi3ForCausalLM", "Phi3Config", **kw)


def deepseek_v3(q_lora_rank=None, **kw):
    """DeepSeek-V3 MLA, 4 heads (nope 8, rope 4, v 8), kv_lora_rank 16, YaRN rope with mscale_all_dim (so the softmax
    scale is qk_head_dim^-0.5 * mscale^2, not qk_head_dim^-0.5), dense MLPs; ``q_lora_rank`` None (q_proj) or set
    (q_a_proj, q_a_layernorm, q_b_proj)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
    return _hf("DeepseekV3ForCausalLM", "DeepseekV3Config", **dict(
        dict(num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8, head_dim=4, first_k_dense_replace=2, n_routed_experts=4, moe_intermediate_size=16,
             max_position_embeddings=64, rope_parameters=rope), **kw))


def mla_softmax_scale(model) -> float:
    """The softmax scale MLA must use, from the config (transformers' yarn_get_mscale formula written out):
    ``(nope + rope)^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2``."""
    import math
    c = model.config
    m = 0.1 * c.rope_parameters["mscale_all_dim"] * math.log(c.rope_parameters["factor"]) + 1.0
    return (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5 * m * m


def qwen3_qk_norm(**kw):
    """Qwen3: q_norm/k_norm over head_dim, one gain shared by all heads; GQA 4/2."""
    return _hf("Qwen3ForCausalLM", "Qwen3Config", **kw)


def olmo2_qk_norm(**kw):
    """OLMo 2: q_norm/k_norm over the whole projection (heads x head_dim gains: one slice per head); GQA 4/2."""
    return _hf("Olmo2ForCausalLM", "Olmo2Config", **kw)


def gemma3_qk_norm(**kw):
    """Gemma 3 (text): q_norm/k_norm over head_dim, gain applied as 1 + w, shared by all heads; a sliding layer
    (window 4) and a full one; softmax scale query_pre_attn_scalar^-0.5; GQA 4/2."""
    return _hf("Gemma3ForCausalLM", "Gemma3TextConfig", **dict(
        dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16), **kw))


def gpt_neox(**kw):
    """GPT-NeoX: interleaved query_key_value (per head [q; k; v]) with biases, partial rotary, 4 heads."""
    return _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **dict(dict(num_key_value_heads=4, head_dim=None), **kw))


def gpt_oss(**kw):
    """GPT-OSS: eager-only attention with sinks (the model's own eager function), q/k biases, a sliding layer
    (window 4) and a full one, 4 experts; GQA 4/2."""
    return _hf("GptOssForCausalLM", "GptOssConfig", **dict(
        dict(attn_implementation=TEST_EAGER, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
             sliding_window=4, layer_types=["sliding_attention", "full_attention"]), **kw))


#: Falcon's three fused query_key_value layouts (the FalconConfig flags of each).
FALCON_LAYOUTS = {"multi_query": dict(multi_query=True),
                  "per_head": dict(multi_query=False, bias=True),
                  "new_arch": dict(new_decoder_architecture=True, num_kv_heads=2)}


def falcon(layout: str = "multi_query", **kw):
    """Falcon with RoPE, 4 heads of 8, in one of its fused query_key_value layouts (:data:`FALCON_LAYOUTS`):
    ``"multi_query"`` (Falcon-7B: all query heads, then one key head and one value head), ``"per_head"`` (per head
    [q; k; v] rows, with biases), ``"new_arch"`` (Falcon-40B's new decoder architecture: per key head [its 2 query
    heads; key; value]). QK-clip serves it where FalconAttention calls transformers' attention functions
    (transformers >= 5.25: :func:`falcon_calls_attention_functions`)."""
    import transformers
    register_test_attention()
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, attn_implementation=TEST_ATTENTION, **FALCON_LAYOUTS[layout])
    base.update(kw)
    model = _lm(transformers.FalconForCausalLM)(transformers.FalconConfig(**base))
    _boost_qk(model)
    return model


def falcon_calls_attention_functions() -> bool:
    """Whether the installed transformers' FalconAttention calls transformers' attention functions (5.25 on), so
    QK-clip can serve it; False where it computes its attention inline."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from ds_muon.model.attention import calls_attention_functions
    return calls_attention_functions(FalconAttention)


#: The families with their own QK-clip rule: model name in MODELS -> (the start of the rule its attention targets
#: carry, ds_muon.model.attention.ClipTarget.rule; the leaf modules whose parameters the clip scales).
FAMILIES = {
    "deepseek_v3": ("MLA", {"q_proj", "kv_b_proj"}),
    "deepseek_v3_q_lora": ("MLA", {"q_b_proj", "kv_b_proj"}),
    "qwen3": ("q/k-norm gains, one gamma per layer", {"q_norm", "k_norm"}),
    "gemma3": ("q/k-norm gains, one gamma per layer", {"q_norm", "k_norm"}),
    "olmo2": ("q/k-norm gains, per head", {"q_norm", "k_norm"}),
    "gpt_neox": ("per head [q; k; v]", {"query_key_value"}),
    "gpt_oss": ("W_q/W_k rows per head", {"q_proj", "k_proj"}),
    "falcon_multi_query": ("Falcon's fused query_key_value", {"query_key_value"}),
    "falcon_per_head": ("Falcon's fused query_key_value", {"query_key_value"}),
    "falcon_new_arch": ("Falcon's fused query_key_value", {"query_key_value"}),
}
#: The families QK-clip serves only where the installed transformers' attention calls its attention functions.
NEEDS_ATTENTION_FUNCTIONS = {"falcon_multi_query", "falcon_per_head", "falcon_new_arch"}


def _gathered(params):
    """Full parameters for an in-place init change, also when built under ``deepspeed.zero.Init``."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed
        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    import contextlib
    return contextlib.nullcontext()


class DeclaredAttention(nn.Module):
    """A custom causal attention (no RoPE, GQA 4/2) that declares its q/k weights and records its logits."""

    def __init__(self, dim: int = 24, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.hd, bias=True)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, dim, bias=False)

    def muon_qk_clip(self) -> dict:
        return {"q": self.q.weight, "k": self.k.weight, "q_bias": self.q.bias, "num_heads": self.heads,
                "num_kv_heads": self.kv_heads}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        record_max_logits(self, brute_max_logits(q, k, self.hd ** -0.5))
        rep = self.heads // self.kv_heads
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class DeclaredNet(nn.Module):
    """Embedding -> 2 x (LayerNorm, DeclaredAttention, MLP) -> tied head; the harness's forward signature."""

    def __init__(self, dim: int = 24, num_hidden_layers: int = 2, num_key_value_heads: int = 2, vocab: int = VOCAB):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(num_hidden_layers))
        self.attn = nn.ModuleList(DeclaredAttention(dim, kv_heads=num_key_value_heads) for _ in range(num_hidden_layers))
        self.mlp = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_hidden_layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        params = [self.embed.weight] + [p for a in self.attn for p in (a.q.weight, a.k.weight)]
        with torch.no_grad(), _gathered(params):
            self.embed.weight.mul_(0.2)
            for a in self.attn:  # heads of different strengths, so a threshold clips some, not all
                spread = torch.linspace(0.6, 1.4, a.heads).repeat_interleave(a.hd)[:, None]
                a.q.weight.mul_(spread * QK_GAIN / 4)
                a.k.weight.mul_(QK_GAIN / 4)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, tokens, targets, use_extra=True):
        h = self.embed(tokens)
        for norm, attn, mlp in zip(self.norms, self.attn, self.mlp):
            h = h + attn(norm(h))
            h = h + F.silu(mlp(h))
        return F.cross_entropy(self.head(h).reshape(-1, self.vocab), targets.reshape(-1))


def declared_wide() -> DeclaredNet:
    """DeclaredNet at dim 256, 3 layers, vocab 2100: at W = 2 both its Muon and its decayed AdamW sub-group exceed
    the NVMe swapper's 1 MiB minimum (262144 fp32 elements per rank), so both are swapped; the AdamW one holds the
    query biases only with ``decay_norms_and_biases: true`` (else they are in the small no-decay sub-group)."""
    return DeclaredNet(dim=256, num_hidden_layers=3, vocab=2100)


MODELS = {"llama": llama_gqa, "llama_ds_muon_sdpa": llama_ds_muon_sdpa, "qwen2": qwen2_bias, "phi3": phi3_fused, "declared": DeclaredNet,
          "declared_wide": declared_wide, "deepseek_v3": deepseek_v3,
          "deepseek_v3_q_lora": lambda **kw: deepseek_v3(q_lora_rank=12, **kw), "qwen3": qwen3_qk_norm,
          "olmo2": olmo2_qk_norm, "gemma3": gemma3_qk_norm, "gpt_neox": gpt_neox, "gpt_oss": gpt_oss,
          **{f"falcon_{layout}": (lambda layout: lambda **kw: falcon(layout, **kw))(layout) for layout in FALCON_LAYOUTS}}
