"""A compact Llama-like causal language model in plain PyTorch (no ``transformers``).

Architecture (pre-norm decoder):

    tokens -> Embedding -> N x [ x + Attn(RMSNorm(x)) ; x + SwiGLU(RMSNorm(x)) ] -> RMSNorm -> lm_head -> logits

* attention: separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` ``nn.Linear`` without bias, rotary position
  embeddings (RoPE), grouped-query attention (``n_kv_heads`` divides ``n_heads``), so ``q_proj`` is
  ``(d_model, d_model)`` while ``k_proj``/``v_proj`` are ``(n_kv_heads * head_dim, d_model)``;
* MLP: SwiGLU, ``down(silu(gate(x)) * up(x))``;
* ``lm_head`` can be tied to the token embedding (``tie_embeddings=True``).
* MuonClip: in a training forward each ``Attention`` reports its per-head max pre-softmax logit (after
  RoPE) through ``ds_muon.model.max_logits`` (``record_max_logits=True``, the default; measured cost in
  docs/qk_clip.md); ``record_max_logits=False`` turns it off.
* MoE (``n_experts > 0``): the MLP is a top-k routed mixture of SwiGLU experts, stored as transformers'
  MoE models store them (Mixtral, Qwen3-MoE): a router ``nn.Linear(d_model, n_experts)`` and an
  ``Experts`` module with ``gate_up_proj`` ``(E, 2I, d_model)`` (gate rows, then up rows) and
  ``down_proj`` ``(E, d_model, I)``. ds_muon trains the experts with Muon, one matrix per expert and
  gate/up apart, and the router with AdamW (docs/selection.md).

``get_output_embeddings()`` returns ``lm_head`` (ds_muon uses it to route the output head to AdamW).

Presets (``ModelConfig.preset(name)``): ``tiny`` (CPU default), ``small``, ``934m`` (the benchmark model),
``2.9b`` (the larger benchmark flavour), ``moe`` (a small MoE for CPU: 8 experts, top 2) and ``moe-1.5b``
(the MoE benchmark flavour: 8 experts, top 2).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_muon.model.max_logits import max_logits_per_head, record_max_logits, wants_max_logits


@dataclass
class ModelConfig:
    vocab_size: int = 256          # 256 = raw bytes
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 352          # SwiGLU hidden width
    max_seq_len: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0             # 0: dense SwiGLU MLP; > 0: a routed mixture of that many experts
    top_k: int = 2                 # experts per token (MoE)
    expert_hidden: int = 0         # SwiGLU hidden width of one expert (MoE)
    record_max_logits: bool = True  # attention reports per-head max logits for MuonClip (ds_muon.model.max_logits)

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.n_experts and not (1 <= self.top_k <= self.n_experts and self.expert_hidden >= 1):
            raise ValueError(f"MoE needs 1 <= top_k <= n_experts and expert_hidden >= 1, got top_k={self.top_k}, "
                             f"n_experts={self.n_experts}, expert_hidden={self.expert_hidden}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """Named preset, with optional field overrides (e.g. ``vocab_size=256``, ``max_seq_len=512``)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {
    # ~0.8M params: trains in a few minutes on 2 CPU cores with 2 processes.
    "tiny": ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, max_seq_len=128),
    # ~18M params with the byte vocab.
    "small": ModelConfig(d_model=512, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden=1408, max_seq_len=512),
    # The benchmark model of docs/design.md, "Measuring": ~934M params with a 32000 vocab (d=2048, 16 layers, SwiGLU 5440).
    "934m": ModelConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16,
                        ffn_hidden=5440, max_seq_len=1024),
    # The larger benchmark flavour: ~2.9B params (d=3072, 24 layers, 24 heads, SwiGLU 8192, vocab 32000).
    "2.9b": ModelConfig(vocab_size=32000, d_model=3072, n_layers=24, n_heads=24, n_kv_heads=24,
                        ffn_hidden=8192, max_seq_len=1024),
    # ~1.7M params: the tiny model with 8 routed experts (top 2) in every MLP; CPU.
    "moe": ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128,
                       n_experts=8, top_k=2, expert_hidden=128),
    # The MoE benchmark flavour: ~1.5B params (1.1B in experts), d=2048, 16 layers, 8 experts of SwiGLU 1408, top 2.
    "moe-1.5b": ModelConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16,
                            max_seq_len=1024, n_experts=8, top_k=2, expert_hidden=1408),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned gain. (..., D) -> (..., D)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (T, head_dim // 2), fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (B, H, T, hd) by the angles in cos/sin: (T, hd//2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)          # (B, H, T, hd//2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query attention. (B, T, D) -> (B, T, D).

    With ``record_max_logits`` (set from the config; an attribute, so it can be switched per module), a
    training forward records its ``(n_heads,)`` max logits ``q·k / sqrt(head_dim)`` for MuonClip.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.record_max_logits = cfg.record_max_logits
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def muon_qk_clip(self) -> dict:
        """The query/key weights and head geometry QK-clip scales (ds_muon.model.attention.find_clip_targets)."""
        return {"q": self.q_proj.weight, "k": self.k_proj.weight, "num_heads": self.n_heads,
                "num_kv_heads": self.n_kv_heads}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)      # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.record_max_logits and self.training and wants_max_logits(self):  # autograd on, window open
            record_max_logits(self, max_logits_per_head(q, k, self.head_dim ** -0.5, is_causal=True))
        if self.n_kv_heads != self.n_heads:                       # GQA: share each kv head across a group
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                      # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)). (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked, as transformers' MoE models store them.

    ``gate_up_proj``: ``(E, 2I, D)``, expert ``e``'s gate rows ``[0, I)`` then up rows ``[I, 2I)``;
    ``down_proj``: ``(E, D, I)``. ``forward(x: (N, D), idx: (N, k) int64, w: (N, k)) -> (N, D)``:
    ``sum_j w[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n))`` over the ``k`` experts ``e = idx[n, j]``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.n_experts
        self.gate_up_proj = nn.Parameter(torch.randn(cfg.n_experts, 2 * cfg.expert_hidden, cfg.d_model) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_model, cfg.expert_hidden) * 0.02)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(idx == e)             # tokens routed to expert e (none: a zero gradient)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class MoE(nn.Module):
    """Top-k routed mixture of experts (Mixtral-style: softmax over the router logits, top k,
    renormalized). (B, T, D) -> (B, T, D). No auxiliary load-balancing loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))                                  # (N, D)
        probs = F.softmax(self.router(flat).float(), dim=-1)              # (N, E)
        w, idx = probs.topk(self.top_k, dim=-1)                           # (N, k)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        return self.experts(flat, idx, w).view_as(x)


class Block(nn.Module):
    """Pre-norm decoder block. (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.n_experts else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    """Llama-like causal LM. ``forward(input_ids: (B, T) int64) -> logits (B, T, vocab)``;
    ``forward(input_ids, labels)`` (labels (B, T), -100 ignored) -> mean cross-entropy (scalar)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)
        # GPT-2 style: scale down the residual-branch output projections by depth.
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight") or name.endswith("down_proj"):
                with torch.no_grad():
                    p.mul_(1.0 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = rope_tables(T, self.cfg.head_dim, self.cfg.rope_theta, device=input_ids.device)
        x = self.embed_tokens(input_ids)                                  # (B, T, D)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))                               # (B, T, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; targets (B, T) are input_ids shifted by one."""
        return self(input_ids, targets)


def count_params(params) -> int:
    """Elements of unique parameters (tied weights counted once; ``ds_numel`` under ZeRO-3)."""
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += getattr(p, "ds_numel", p.numel())
    return total
