"""Tiny real models of the families issue 26 names, built from configs (transformers >= 5 for the MoE ones).

Shared by tests/unit/test_selection_families.py (selection only) and tests/dist/test_family_parity.py (ZeRO-3
training against the oracle), so the split the unit test reads off the model's own forward is the split the parity
test trains. Each builder returns the plain model; :func:`causal_lm` and :func:`image_classifier` wrap a
transformers class in the harness's ``forward(inputs, targets, use_extra) -> loss`` (tests/support/harness.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN = 64, 32
IMAGE, PATCH, CHANNELS, LABELS = 8, 4, 3, 5


def _transformers():
    import transformers
    return transformers


def gpt_oss_config():
    """GPT-OSS: 2 layers (sliding, full), 4 experts of width 16 with biases, attention sinks (eager attention:
    the only implementation GPT-OSS has with sinks on CPU)."""
    return _transformers().GptOssConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, pad_token_id=0,
        attn_implementation="eager")


def qwen3_next_config():
    """Qwen3-Next: a GatedDeltaNet layer (2 key heads, 4 value heads of 8) then a gated full-attention layer
    (4 query heads of 8, 2 KV heads); MoE MLPs of 4 experts with a gated shared expert."""
    return _transformers().Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"], pad_token_id=0)


def vit_config():
    """ViT: 8x8 RGB images in 4x4 patches (a Conv2d(3, 32, 4, stride 4) patch embedding), 2 layers, 5 labels."""
    return _transformers().ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, image_size=IMAGE, patch_size=PATCH,
                                     num_channels=CHANNELS, num_labels=LABELS)


def mixtral_config():
    """Mixtral: 2 layers, 8 stacked experts of width 16 (``gate_up_proj`` (8, 32, 32), ``down_proj`` (8, 32, 16)),
    top 1: with a micro-batch of 16 tokens some experts route no token in a step (their blocks get an exactly zero
    gradient while the stacked parameter gets one)."""
    return _transformers().MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=1, pad_token_id=0)


def mixtral():
    """A seeded :func:`mixtral_config` ``MixtralForCausalLM`` with the harness's ``forward(tokens, targets,
    use_extra) -> loss`` (every rank builds the same weights)."""
    torch.manual_seed(0)
    return causal_lm(_transformers().MixtralForCausalLM)(mixtral_config())


def gpt_oss():
    return _transformers().GptOssForCausalLM(gpt_oss_config())


def qwen3_next():
    return _transformers().Qwen3NextForCausalLM(qwen3_next_config())


def vit():
    return _transformers().ViTForImageClassification(vit_config())


class EncoderLM(nn.Module):
    """A token LM on ``nn.TransformerEncoder``: 2 ``nn.TransformerEncoderLayer`` (E 32, 4 heads, MLP 48, no
    dropout), so ``in_proj_weight`` (96, 32) is PyTorch's packed Q/K/V and ``in_proj_bias`` (96,) its bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(HIDDEN, 4, 48, dropout=0.0, batch_first=True),
                                             2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, use_extra: bool = True):
        """tokens (B, T) int64 -> logits (B, T, VOCAB); with ``targets`` (B, T) the mean cross-entropy."""
        logits = self.head(self.encoder(self.embed(tokens)))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def encoder_lm() -> EncoderLM:
    return EncoderLM()


def causal_lm(base):
    """``base`` (a transformers *ForCausalLM class) with the harness's ``forward(tokens, targets, use_extra)``."""

    class LM(base):
        def forward(self, tokens, targets, use_extra=True):  # noqa: D401 - the harness's signature
            return super().forward(input_ids=tokens, labels=targets).loss

    LM.__name__ = LM.__qualname__ = base.__name__
    return LM


def image_classifier(base):
    """``base`` (a transformers *ForImageClassification class) with ``forward(pixels, labels, use_extra)``."""

    class Classifier(base):
        def forward(self, pixels, labels, use_extra=True):  # noqa: D401 - the harness's signature
            return super().forward(pixel_values=pixels, labels=labels).loss

    Classifier.__name__ = Classifier.__qualname__ = base.__name__
    return Classifier


def images(step: int, rank: int, micro: int, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (pixels (B, 3, 8, 8) fp32, labels (B,) int64) for one micro-batch of one rank."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + micro)
    return (torch.randn(batch_size, CHANNELS, IMAGE, IMAGE, generator=g),
            torch.randint(0, LABELS, (batch_size,), generator=g))


def tokens(step: int, rank: int, micro: int, batch_size: int = 2, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) (B, seq) int64 over the families' vocabulary of 64, one micro-batch."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + micro)
    data = torch.randint(3, VOCAB, (batch_size, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]
