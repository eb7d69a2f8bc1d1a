"""Effect of "no gradient, no step" on a small MoE's loss (docs/how-it-works.md, "Steps with no gradient").

A tiny ``Qwen3MoeForCausalLM`` built from a config (no download; stacked experts tagged Muon, one
matrix per expert) trains on the byte-level stdlib corpus of ``examples/data.py`` with the
single-device oracle ``ds_muon.MuonAdamW``, twice from the same seed: with ds_muon's rule (an
expert with no routed token keeps its momentum and weights) and with the rule before it (every
expert steps from its momentum, plus weight decay, whether it got tokens or not). Prints the share of
(expert, step) pairs with no token and the train/validation loss of both runs.

    python benchmarks/no_grad_moe.py [--steps 200] [--experts 32] [--batch 2] [--seq 32] [--aux 0.01]

CPU, a few minutes. The ZeRO-3 path applies the same rule (tests/dist/test_no_grad.py checks it against
the oracle), so the single-device oracle is enough to show the effect on the loss.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from data import ByteCorpus  # noqa: E402

from ds_muon import MuonAdamW  # noqa: E402
from ds_muon.core.matrix import ns_view_shape, update_scale  # noqa: E402
from ds_muon.core.newton_schulz import orthogonalize
from ds_muon.core.dtypes import resolve_ns_dtype  # noqa: E402
from ds_muon.model.structure import param_shape  # noqa: E402


class StepEveryExpert(MuonAdamW):
    """The rule before "no gradient, no step": every Muon matrix steps every step (old ``_muon``)."""

    def _muon(self, p, group):
        state = self.state[p]
        m = state.setdefault("momentum_buffer", torch.zeros_like(p, dtype=torch.float32))
        g = p.grad.float()
        beta = group["momentum"]
        m.lerp_(g, 1 - beta)
        u = torch.lerp(g, m, beta) if group["nesterov"] else m
        b, rows, cols = ns_view_shape(param_shape(p))
        o = orthogonalize(u.reshape(b, rows, cols), group["ns_method"], group["ns_steps"],
                          resolve_ns_dtype(group["ns_dtype"], group["ns_method"], p.device))
        o = o.float().mul_(update_scale(rows, cols, group["update_scale"]))
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(o.view(p.shape).to(p.dtype), alpha=-group["lr"])


def build(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(args.seed)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=args.experts,
                         num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=args.seq,
                         tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg)
    for name, p in model.named_parameters():
        if ".experts." in name and p.dim() == 3:
            p.use_muon = True  # one Muon matrix per expert
    return model


def lm_loss(model, tokens: torch.Tensor, targets: torch.Tensor, aux: float = 0.0) -> torch.Tensor:
    """Mean next-byte cross-entropy (+ ``aux`` x the router's load-balancing loss); tokens, targets:
    (B, T) int64 (targets already shifted)."""
    out = model(input_ids=tokens, output_router_logits=aux > 0)
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    return loss + aux * out.aux_loss if aux > 0 else loss


def run(args, cls, corpus) -> dict:
    model = build(args)
    opt = cls(model, lr=args.lr, adam_lr=3e-3, momentum=0.95, weight_decay=0.1)
    experts = [p for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3]
    batches = corpus.batches("train", args.batch, args.seq, seed=args.seed)
    idle, total, losses = 0, 0, []
    for _ in range(args.steps):
        loss = lm_loss(model, *next(batches), aux=args.aux)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in experts:
            quiet = p.grad is None or p.grad.reshape(p.shape[0], -1).ne(0).any(dim=1).logical_not()
            idle += int(p.shape[0] if p.grad is None else quiet.sum())
            total += p.shape[0]
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        val_batches = corpus.batches("val", 8, args.seq, seed=1234)
        val = sum(float(lm_loss(model, *next(val_batches))) for _ in range(8)) / 8
    tail = losses[-20:]
    return {"idle_share": idle / total, "train_last20": sum(tail) / len(tail), "val": val}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aux", type=float, default=0.0, help="router load-balancing loss coefficient (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    corpus = ByteCorpus(max_bytes=2 * 1024 * 1024)
    print(f"Qwen3-MoE tiny: {args.experts} experts, top-2, batch {args.batch}x{args.seq} tokens, {args.steps} steps, "
          f"aux loss {args.aux}")
    for label, cls in (("no gradient, no step (ds_muon)", MuonAdamW), ("every expert steps (before)", StepEveryExpert)):
        r = run(args, cls, corpus)
        print(f"{label:<32} idle (expert, step) pairs {r['idle_share']:.1%}  train loss (last 20) "
              f"{r['train_last20']:.4f}  val loss {r['val']:.4f}", flush=True)


if __name__ == "__main__":
    main()
