"""Tiny models and data shared by the single-device and distributed tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 37, 24


class ParityNet(nn.Module):
    """A tiny LM-shaped model covering every case the parity tests need.

    Muon matrices of mixed shapes (11 of them, so the count is not divisible by W = 2, 3, 4):
    GQA-like q (24x24) / k, v (12x24), o (24x24), kv_proj (24x12), an ``nn.Conv1d`` weight (24, 24, 3)
    seen as one (24, 72) matrix, up (41x24) / down (24x41) with odd numels, a 3-D stacked-expert parameter
    (3, 24, 16) tagged ``use_muon=True``, expert_out (24x16), and ``extra`` (24x24), which gets no
    gradient when ``use_extra`` is False (``conv=False`` drops the conv: the DeepSpeed 0.19.8
    built-in Muon comparison in test_comm_accounting runs without it). AdamW: the embedding (tied to the output head), two
    LayerNorms, biases. ``frozen`` does not train.

    ``dim``/``vocab`` scale it up (the data still uses the first ``VOCAB`` tokens): :func:`wide_parity_net`
    makes every sub-group large enough for DeepSpeed's NVMe swapper, which keeps tensors under
    1 MiB in memory.
    """

    def __init__(self, tie: bool = True, conv: bool = True, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.vocab = vocab
        half, hidden, expert = dim // 2, dim + 17, dim * 2 // 3
        self.embed = nn.Embedding(vocab, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, half, bias=False)
        self.v = nn.Linear(dim, half, bias=True)
        self.o = nn.Linear(dim, dim, bias=False)
        self.kv_proj = nn.Linear(half, dim, bias=False)
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=1) if conv else None
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.experts = nn.Parameter(torch.randn(3, dim, expert) * 0.2)
        self.experts.use_muon = True
        self.expert_out = nn.Linear(expert, dim, bias=False)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.extra = nn.Linear(dim, dim, bias=False)
        self.pad_a = nn.Linear(7, 5, bias=False)   # 35 elements: ZeRO-3 pads it at W = 2, 3, 4
        self.pad_b = nn.Linear(3, 1, bias=False)   # 3 elements: fewer than W = 4, one rank holds only padding
        self.norm2 = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.late = None  # see late_parity_net

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        """tokens, targets: (B, T) int64. Returns the mean cross-entropy (scalar)."""
        x = self.embed(tokens)
        h = self.norm1(x)
        h = x + self.o(F.silu(self.q(h))) + self.kv_proj(self.k(h) * F.silu(self.v(h)))
        if self.conv is not None:
            h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.down(F.gelu(self.up(h)))
        e = torch.einsum("btd,edf->btef", h, self.experts).mean(2)
        h = h + self.expert_out(F.silu(e))
        h = h + self.frozen(h)
        if use_extra:
            h = h + self.extra(h)
        elif self.late is not None:  # late_parity_net: used on odd steps only, so never in step 0
            h = h + 0.1 * F.linear(F.silu(F.linear(h, self.late)), self.late.t())
        # into one feature only: a shift of all features would vanish in the LayerNorm below
        z = self.pad_b(F.silu(self.pad_a(h[..., :7]))[..., :3])
        h = torch.cat([h[..., :1] + z, h[..., 1:]], dim=-1)
        logits = self.head(self.norm2(h))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def wide_parity_net() -> ParityNet:
    """ParityNet at dim 256, vocab 2100: ~0.8M Muon and ~0.54M AdamW elements, so at W = 2 both the
    Muon and the AdamW sub-group exceed the NVMe swapper's 1 MiB minimum (262144 fp32 elements)."""
    return ParityNet(dim=256, vocab=2100)


def late_parity_net() -> ParityNet:
    """wide_parity_net plus ``late`` (2100 x 256, ``use_muon=True``), used only on odd steps; with
    :func:`late_groups` it is a sub-group of its own, large enough to be NVMe-swapped at W = 2
    (268,800 elements per rank), that gets no gradient at all in step 0."""
    model = wide_parity_net()
    model.late = nn.Parameter(torch.randn(2100, 256) * 0.02)
    model.late.use_muon = True
    return model


def late_groups(model: ParityNet) -> list[dict]:
    """Param groups: ``late`` alone, then every other trainable parameter."""
    rest = [p for n, p in model.named_parameters() if p.requires_grad and n != "late"]
    return [{"params": [model.late]}, {"params": rest}]


def batch(step: int, rank: int, micro: int, batch_size: int = 2, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) for one micro-batch of one rank, shape (batch_size, seq)."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + micro)
    data = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def use_extra(step: int) -> bool:
    """``extra`` is skipped on odd optimizer steps (a layer with no gradient in some steps)."""
    return step % 2 == 0


GLOBAL_BATCH = 6


def shared_batch(step: int, rank: int, micro: int, batch_size: int = 2, seq: int = 8,
                 global_batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[rank*batch_size, (rank+1)*batch_size)`` of one global micro-batch of ``global_batch``
    rows drawn per (step, micro), shape (batch_size, seq): the data of a step is the same at every
    world size W with ``W * batch_size == global_batch`` (6 = 1x6 = 2x3 = 3x2), unlike :func:`batch`,
    which draws each rank's rows from its own seed."""
    if (rank + 1) * batch_size > global_batch:
        raise ValueError(f"rank {rank} x micro-batch {batch_size} is past the global batch of {global_batch} rows")
    g = torch.Generator().manual_seed(1_000_003 * step + micro)
    data = torch.randint(0, VOCAB, (global_batch, seq + 1), generator=g)[rank * batch_size:(rank + 1) * batch_size]
    return data[:, :-1], data[:, 1:]
