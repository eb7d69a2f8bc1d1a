"""Per-head max attention logits for MuonClip (ds_muon.model.max_logits, ds_muon.model.attention).

Every value is compared for equality with a brute-force full-matrix computation written
independently here (GQA by ``repeat_interleave`` as transformers' ``repeat_kv``, the full
``(Sq, Sk)`` score matrix, an explicit bool "allowed" matrix). The inputs are built so that a
mistake shows: masked positions (future keys, padding) and the other heads' keys hold the largest
products, and each case asserts that the unmasked (or wrongly mapped) max differs.
"""
from __future__ import annotations

import sys

import pytest
import torch

from ds_muon.model.max_logits import RECORDER, max_logits_per_head, record_max_logits


def brute_force(q: torch.Tensor, k: torch.Tensor, scaling: float, allowed: torch.Tensor | None) -> torch.Tensor:
    """max over (b, i, j allowed) of float(q_h,i · k_{h // G},j) * scaling, (H,); allowed (B|1, H|1, Sq, Sk) bool."""
    k_full = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)            # (B, H, Sk, D)
    scores = (q @ k_full.transpose(-1, -2)).float() * scaling                  # (B, H, Sq, Sk), all of it
    if allowed is not None:
        scores = scores.masked_fill(~allowed.expand_as(scores), float("-inf"))
    return scores.amax(dim=(0, 2, 3))


def causal(sq: int, sk: int) -> torch.Tensor:
    """SDPA's is_causal pattern: upper-left aligned lower triangle, (1, 1, Sq, Sk) bool."""
    return torch.ones(sq, sk, dtype=torch.bool).tril()[None, None]


def qk(B=2, H=6, Hkv=2, Sq=11, Sk=11, D=8, dtype=torch.float32, seed=0):
    """Integer-valued q, k: every dot product is exact in fp32 and bf16 whatever the matmul's summation
    order (a chunk's matmul may sum in another order than the full one), so equality is the test."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-4, 5, (B, H, Sq, D), generator=g).float()
    k = torch.randint(-4, 5, (B, Hkv, Sk, D), generator=g).float()
    q[:, :, 0] *= 30          # query 0 sees only key 0 under causality: its products with later keys are the largest
    return q.to(dtype), k.to(dtype)


def left_padding(B: int, S: int, pads: list[int]) -> torch.Tensor:
    """Causal + left padding, as transformers' sdpa_mask builds it: (B, 1, S, S) bool, padded rows all False."""
    keep = torch.ones(B, S, dtype=torch.bool)
    for b, p in enumerate(pads):
        keep[b, :p] = False
    return causal(S, S) & keep[:, None, None, :] & keep[:, None, :, None]


@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("Sq,Sk", [(11, 11), (5, 9), (9, 5)])
def test_causal_gqa_equals_brute_force(Sq, Sk, chunk):
    q, k = qk(Sq=Sq, Sk=Sk)
    got = max_logits_per_head(q, k, 0.3, is_causal=True, chunk_size=chunk)
    assert got.dtype == torch.float32 and got.shape == (6,)
    assert torch.equal(got, brute_force(q, k, 0.3, causal(Sq, Sk)))
    assert not torch.equal(got, brute_force(q, k, 0.3, None))               # causality matters in this case
    # the GQA mapping matters: query head h reads kv head h // G, not h % Hkv
    wrong = brute_force(q, k.repeat(1, 3, 1, 1), 0.3, causal(Sq, Sk))      # tiled: kv head h % Hkv
    assert not torch.equal(got, wrong)


@pytest.mark.parametrize("chunk", [1, 3, None])
def test_left_padding_bool_and_float_masks(chunk):
    B, S = 3, 10
    q, k = qk(B=B, Sq=S, Sk=S)
    allowed = left_padding(B, S, [0, 3, 7])
    q[1, :, :3] *= 100    # padded queries (fully masked rows) and padded keys hold the largest products
    k[2, :, :7] *= 100
    want = brute_force(q, k, 0.25, allowed)
    assert torch.equal(max_logits_per_head(q, k, 0.25, allowed, chunk_size=chunk), want)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert torch.equal(max_logits_per_head(q, k, 0.25, additive, chunk_size=chunk), want)
    inf_mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    assert torch.equal(max_logits_per_head(q, k, 0.25, inf_mask, chunk_size=chunk), want)
    unpadded = brute_force(q, k, 0.25, causal(S, S))
    assert not torch.equal(want, unpadded)


def test_per_head_mask_and_broadcast_shapes():
    q, k = qk(B=2, H=6, Hkv=3, Sq=7, Sk=9)
    g = torch.Generator().manual_seed(1)
    per_head = torch.rand(2, 6, 7, 9, generator=g) > 0.5                  # a different mask per query head
    assert torch.equal(max_logits_per_head(q, k, 0.5, per_head, chunk_size=2), brute_force(q, k, 0.5, per_head))
    two_d = torch.rand(7, 9, generator=g) > 0.3                            # (Sq, Sk): shared by batch and heads
    assert torch.equal(max_logits_per_head(q, k, 0.5, two_d, chunk_size=3), brute_force(q, k, 0.5, two_d))
    row = torch.rand(2, 1, 1, 9, generator=g) > 0.3                        # (B, 1, 1, Sk): key padding only
    assert torch.equal(max_logits_per_head(q, k, 0.5, row, chunk_size=3), brute_force(q, k, 0.5, row))


def test_no_mask_bf16_and_no_grad():
    q, k = qk(Sq=6, Sk=13, dtype=torch.bfloat16)
    q.requires_grad_(True)
    got = max_logits_per_head(q, k, 0.125, chunk_size=4)
    assert got.dtype == torch.float32 and not got.requires_grad
    assert torch.equal(got, brute_force(q.detach(), k, 0.125, None))
    assert torch.equal(max_logits_per_head(q, k, 0.125, is_causal=True, chunk_size=4),
                       brute_force(q.detach(), k, 0.125, causal(6, 13)))


def test_random_floats_within_rounding():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 33, 16, generator=g), torch.randn(2, 2, 33, 16, generator=g)
    allowed = left_padding(2, 33, [0, 5])
    for got, want in [(max_logits_per_head(q, k, 0.25, allowed, chunk_size=7), brute_force(q, k, 0.25, allowed)),
                      (max_logits_per_head(q, k, 0.25, is_causal=True, chunk_size=5),
                       brute_force(q, k, 0.25, causal(33, 33)))]:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # summation order of the matmuls only


def test_bad_input_is_refused():
    q, k = qk()
    with pytest.raises(ValueError, match="does not fit"):
        max_logits_per_head(q, k[:, :, :, :4], 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        max_logits_per_head(q[:, :5], k, 1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        max_logits_per_head(q, k, 1.0, torch.ones(2, 1, 11, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        max_logits_per_head(q, k, 1.0, torch.ones(11, 11, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="scaling"):
        max_logits_per_head(q, k, 0.0)


def test_recorder_running_max_and_autograd_off():
    m = torch.nn.Linear(1, 1)
    RECORDER.take(m)
    record_max_logits(m, torch.tensor([1.0, 5.0]))
    record_max_logits(m, torch.tensor([3.0, 2.0]))
    with torch.no_grad():
        record_max_logits(m, torch.tensor([9.0, 9.0]))                    # evaluation: ignored
    assert torch.equal(RECORDER.take(m), torch.tensor([3.0, 5.0]))
    assert RECORDER.take(m) is None


def test_example_model_records_its_attention_max_logits(monkeypatch):
    from examples.model import CausalLM, ModelConfig
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                                 max_seq_len=16))
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):  # the example repeats its kv heads before SDPA: k has n_heads heads here
        seen.append((q.detach(), k.detach(), kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    RECORDER.clear()
    model(ids, ids).backward()
    assert len(seen) == 2 and all(kw == {"is_causal": True} for _, _, kw in seen)
    for layer, (q, k, _) in zip(model.layers, seen):
        torch.testing.assert_close(RECORDER.take(layer.attn), brute_force(q, k, 8 ** -0.5, causal(16, 16)),
                                   rtol=1e-6, atol=0)
    model.eval()
    model(ids, ids)
    model.train()
    for layer in model.layers:
        layer.attn.record_max_logits = False
    model(ids, ids)
    assert all(RECORDER.take(layer.attn) is None for layer in model.layers)


def test_plot_qk_clip_draws_from_metrics(tmp_path, monkeypatch):
    """scripts/plot_qk_clip.py --reuse: reads train.py's --metrics lines (max_logit per step) and writes the PNG."""
    import json

    from tests.support.tools import repo_module
    plot = repo_module("scripts/plot_qk_clip.py")
    for arm in range(2):
        with open(tmp_path / f"arm{arm}.jsonl", "w") as f:
            f.write(json.dumps({"step": 0, "val_loss": 5.6}) + "\n")
            for step in range(1, 6):
                f.write(json.dumps({"step": step, "loss": 5.0 - step / 10, "max_logit": 10.0 * step ** (2 - arm)}) + "\n")
    assert plot.read(str(tmp_path / "arm1.jsonl"))[2] == [10.0, 20.0, 30.0, 40.0, 50.0]
    out = tmp_path / "qk.png"
    monkeypatch.setattr(sys, "argv", ["plot_qk_clip.py", "--reuse", "--workdir", str(tmp_path), "--out", str(out)])
    plot.main()
    assert out.stat().st_size > 10_000
    (tmp_path / "arm1.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "max_logit": None}) + "\n")
    with pytest.raises(SystemExit, match="no per-step max_logit"):
        plot.main()


@pytest.mark.parametrize("is_causal", [False, True])
def test_default_chunks_keep_the_score_budget(monkeypatch, is_causal):
    """With the default chunk size no score tensor larger than ``CHUNK_ELEMENTS`` (``B * H * chunk * Sk``)
    is ever formed, far less than the full ``(B, H, Sq, Sk)`` matrix, and the result is still exact.
    At the default budget: a bf16 query/key pair whose full score matrix is 256 MiB (8 heads, 4096 x 4096) forms
    no score tensor over the documented 128 MiB of bf16 scores (there the matmul is replaced by zeros of its
    output's shape: only the sizes are checked; the values are checked at the shrunk budgets). With the budget
    shrunk to 4,096 elements tiny shapes need many chunks. A shape whose whole score matrix fits the budget is one
    matmul (the host-cheap path a training forward takes). Every matmul's output is recorded."""
    import ds_muon.model.max_logits as ml
    sizes = []
    matmul = torch.matmul

    def recording(a, b, *args, **kwargs):
        out = matmul(a, b, *args, **kwargs)
        sizes.append(out.numel() * out.element_size())
        return out

    def shape_only(a, b):
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        sizes.append(batch.numel() * a.shape[-2] * b.shape[-1] * a.element_size())
        return torch.zeros(*batch, a.shape[-2], b.shape[-1], dtype=a.dtype)

    q, k = qk(B=1, H=8, Hkv=2, Sq=4096, Sk=4096, D=4, dtype=torch.bfloat16)
    monkeypatch.setattr(torch, "matmul", shape_only)
    max_logits_per_head(q, k, 0.25, is_causal=is_causal)
    monkeypatch.setattr(torch, "matmul", matmul)
    full = 8 * 4096 * 4096 * 2
    assert len(sizes) > 1 and max(sizes) <= 128 * 2**20 < full, (len(sizes), max(sizes))
    assert ml.CHUNK_ELEMENTS * 2 == 128 * 2**20

    monkeypatch.setattr(ml, "CHUNK_ELEMENTS", 4096)
    q, k = qk(B=2, H=4, Hkv=2, Sq=256, Sk=256)
    sizes.clear()
    monkeypatch.setattr(torch, "matmul", recording)
    got = max_logits_per_head(q, k, 0.25, is_causal=is_causal)
    monkeypatch.setattr(torch, "matmul", matmul)
    want = brute_force(q, k, 0.25, causal(256, 256) if is_causal else None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    full = 2 * 4 * 256 * 256 * 4
    assert len(sizes) > 8 and max(sizes) <= 4096 * 4 < full, (len(sizes), max(sizes))

    monkeypatch.setattr(ml, "CHUNK_ELEMENTS", 2 * 4 * 64 * 64)  # exactly the whole score matrix below
    q, k = qk(B=2, H=4, Hkv=2, Sq=64, Sk=64)
    sizes.clear()
    monkeypatch.setattr(torch, "matmul", recording)
    got = max_logits_per_head(q, k, 0.25, is_causal=is_causal)
    monkeypatch.setattr(torch, "matmul", matmul)
    torch.testing.assert_close(got, brute_force(q, k, 0.25, causal(64, 64) if is_causal else None), rtol=1e-6, atol=0)
    assert sizes == [2 * 4 * 64 * 64 * 4], sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Sq,Sk,chunk", [(64, 64, None), (37, 37, 5), (20, 29, 6), (29, 20, 4), (70, 70, 64)])
def test_same_values_as_the_previous_implementation(Sq, Sk, chunk, dtype):
    """The implementation of 2026-12-02 (one matmul per chunk, cached causal block mask, row maxima reduced once)
    gives what the one before it gave (``benchmarks/max_logit_cost.py``'s ``previous_max_logits_per_head``) on
    random inputs: GQA, causal (Sq = Sk, Sq < Sk, Sq > Sk), left padding, per-head bool and additive masks;
    exactly on integer-valued inputs, within the matmul's summation order on random floats."""
    from tests.support.tools import repo_module
    previous = repo_module("benchmarks/max_logit_cost.py").previous_max_logits_per_head
    g = torch.Generator().manual_seed(Sq * 100 + Sk)
    for B, H, Hkv in ((2, 8, 2), (3, 4, 4), (1, 6, 1)):
        qi, ki = qk(B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk, D=16, dtype=dtype, seed=Sq + H)
        qf = torch.randn(B, H, Sq, 16, generator=g).to(dtype)
        kf = torch.randn(B, Hkv, Sk, 16, generator=g).to(dtype)
        masks = [None, torch.rand(B, H, Sq, Sk, generator=g) > 0.4, torch.rand(B, 1, 1, Sk, generator=g) > 0.2]
        if Sq == Sk:
            masks.append(left_padding(B, Sq, [0, Sq // 3, Sq - 1][:B]))
        additive = torch.zeros(B, 1, Sq, Sk).masked_fill(torch.rand(B, 1, Sq, Sk, generator=g) > 0.5, float("-inf"))
        masks.append(additive)
        for q, k, exact in ((qi, ki, True), (qf, kf, False)):
            cases = [dict(is_causal=True)] + [dict(attention_mask=m) for m in masks]
            for kw in cases:
                got = max_logits_per_head(q, k, 0.17, chunk_size=chunk, **kw)
                want = previous(q, k, 0.17, chunk_size=chunk, **kw)
                if exact:
                    assert torch.equal(got, want), (B, H, Hkv, kw.keys())
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0)
