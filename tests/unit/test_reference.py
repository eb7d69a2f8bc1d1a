"""Tests for the single-device oracle ``ds_muon.MuonAdamW`` (docs/design.md, "One optimizer step" and "Selection").

Every expected value here is computed by hand in plain PyTorch (our own quintic Newton–Schulz,
our own momentum), never through ds_muon's math, so the oracle is checked against an independent
implementation.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_muon
from ds_muon.config import ConfigError

QUINTIC = (3.4445, -4.7750, 2.0315)


# ------------------------------------------------------------------------------------------------
# the hand-written Muon
# ------------------------------------------------------------------------------------------------
def hand_ns(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic NS on one 2-D matrix, fp32, Frobenius-normalized, wide orientation."""
    a, b, c = QUINTIC
    X = G.float()
    X = X / (X.norm() + 1e-7)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.T if tall else X


def hand_scale(rows: int, cols: int, mode: str = "shape") -> float:
    if mode == "shape":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def hand_orth_update(u: torch.Tensor, mode: str = "shape") -> torch.Tensor:
    """O for a parameter-shaped u: 2-D as is, 3-D slice by slice, >=4-D flattened to (out, rest)."""
    if u.dim() == 3:
        rows, cols = u.shape[1], u.shape[2]
        return torch.stack([hand_ns(u[i]) for i in range(u.shape[0])]) * hand_scale(rows, cols, mode)
    rows, cols = u.shape[0], u[0].numel()
    return (hand_ns(u.reshape(rows, cols)) * hand_scale(rows, cols, mode)).reshape(u.shape)


def hand_muon_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, *, lr: float, wd: float, beta: float,
                   nesterov: bool = True, mode: str = "shape") -> None:
    """In place on p and buf: buf <- beta buf + (1-beta) g; u; p <- p (1 - lr wd) - lr O."""
    buf.mul_(beta).add_((1 - beta) * g)
    u = (1 - beta) * g + beta * buf if nesterov else buf.clone()
    o = hand_orth_update(u, mode)
    p.mul_(1 - lr * wd).sub_(lr * o)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def muon_param(*shape: int, seed: int = 0) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(*shape, generator=g) * 0.1)
    p.use_muon = True
    return p


# ------------------------------------------------------------------------------------------------
# first step, by hand
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (7, 7)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mode", ["shape", "rms_match"])
def test_first_step_by_hand(shape, nesterov, mode):
    lr, wd, beta = 0.05, 0.1, 0.9
    p = muon_param(*shape, seed=1)
    W0 = p.detach().clone()
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    opt = ds_muon.MuonAdamW([p], lr=lr, weight_decay=wd, momentum=beta, nesterov=nesterov,
                            ns_method="standard", ns_dtype="float32", update_scale=mode)
    p.grad = g.clone()
    opt.step()

    # fully explicit, independent of the helper above
    rows, cols = shape
    m1 = (1 - beta) * g
    u = torch.lerp(g, m1, beta) if nesterov else m1
    scale = math.sqrt(max(1.0, rows / cols)) if mode == "shape" else 0.2 * math.sqrt(max(rows, cols))
    O = hand_ns(u) * scale
    W1 = W0 * (1 - lr * wd) - lr * O
    assert rel_err(p.detach(), W1) < 1e-6
    torch.testing.assert_close(p.detach(), W1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], m1, rtol=1e-6, atol=1e-7)
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    # the update itself has the expected size: singular values of O/scale are in the quintic band
    sv = torch.linalg.svdvals((W0 * (1 - lr * wd) - p.detach()) / (lr * scale))
    assert sv.min() > 0.6 and sv.max() < 1.25


def test_scale_modes_differ_by_expected_ratio():
    # tall (20, 5): shape scale 2, rms_match 0.2*sqrt(20)
    outs = {}
    for mode in ("shape", "rms_match"):
        p = muon_param(20, 5, seed=3)
        W0 = p.detach().clone()
        opt = ds_muon.MuonAdamW([p], lr=0.01, weight_decay=0.0, ns_dtype="float32", update_scale=mode)
        p.grad = torch.randn(20, 5, generator=torch.Generator().manual_seed(4))
        opt.step()
        outs[mode] = W0 - p.detach()
    ratio = outs["rms_match"].norm() / outs["shape"].norm()
    assert ratio.item() == pytest.approx(0.2 * math.sqrt(20) / 2.0, rel=1e-5)


def test_step_does_not_modify_grad():
    """An optimizer must not write into ``p.grad``: users log its norm, clip it, or accumulate into it."""
    for dtype in (torch.float32, torch.bfloat16):
        p = nn.Parameter(torch.randn(8, 6, dtype=dtype))
        p.use_muon = True
        opt = ds_muon.MuonAdamW([p], lr=0.1, nesterov=True, ns_dtype="float32")
        p.grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(5)).to(dtype)
        g0 = p.grad.clone()
        opt.step()
        assert torch.equal(p.grad, g0), (
            f"BUG ds_muon/reference.py MuonAdamW._muon: with nesterov=True and a {dtype} gradient, step() "
            "overwrites p.grad with the Nesterov blend u: `g = p.grad.float()` is p.grad itself for fp32 "
            "grads (no copy), and `g.lerp_(m, beta)` then writes into it (bf16 grads are copied, so they are "
            "left alone: the side effect depends on the dtype). Use an out-of-place torch.lerp(g, m, beta).")


# ------------------------------------------------------------------------------------------------
# several steps against plain PyTorch (torch.optim.AdamW + hand Muon)
# ------------------------------------------------------------------------------------------------
V, D, H = 29, 16, 24


class SmallLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, H)            # Muon weight, AdamW bias
        self.fc2 = nn.Linear(H, D, bias=False)  # Muon
        self.proj = nn.Linear(D, D)          # Muon weight, AdamW bias
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)          # output head -> AdamW

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.embed(tok)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        x = x + self.proj(x)
        return self.head(self.norm(x))


MUON_NAMES = {"fc1.weight", "fc2.weight", "proj.weight"}


def lm_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, V, (4, 9), generator=g)
    tgt = torch.randint(0, V, (4, 9), generator=g)
    return tok, tgt


def lm_loss(model, step):
    tok, tgt = lm_batch(step)
    return F.cross_entropy(model(tok).reshape(-1, V), tgt.reshape(-1))


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_plain_pytorch_over_five_steps(nesterov):
    torch.manual_seed(0)
    model_a = SmallLM()
    model_b = copy.deepcopy(model_a)
    init = {n: p.detach().clone() for n, p in model_a.named_parameters()}
    hp = dict(lr=0.02, adam_lr=3e-3, momentum=0.9, betas=(0.85, 0.97), eps=1e-7, weight_decay=0.05)
    opt_a = ds_muon.MuonAdamW(model_a, nesterov=nesterov, ns_method="standard", ns_dtype="float32", **hp)

    named_b = dict(model_b.named_parameters())
    muon_b = {n: p for n, p in named_b.items() if n in MUON_NAMES}
    # Hugging Face Trainer's convention (decay_norms_and_biases false): no weight decay on biases and norm weights
    no_decay = [p for n, p in named_b.items() if n not in MUON_NAMES and (n.endswith("bias") or n.startswith("norm."))]
    decayed = [p for n, p in named_b.items() if n not in MUON_NAMES and all(p is not q for q in no_decay)]
    adamw = torch.optim.AdamW([{"params": decayed}, {"params": no_decay, "weight_decay": 0.0}], lr=hp["adam_lr"],
                              betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"], foreach=False)
    bufs = {n: torch.zeros_like(p) for n, p in muon_b.items()}

    # the module rule picked the expected split
    muon_a = {n for n, p in model_a.named_parameters() if p.use_muon}
    assert muon_a == MUON_NAMES

    for step in range(5):
        for model in (model_a, model_b):
            model.zero_grad(set_to_none=True)
            lm_loss(model, step).backward()
        opt_a.step()
        adamw.step()
        with torch.no_grad():
            for n, p in muon_b.items():
                hand_muon_step(p, p.grad, bufs[n], lr=hp["lr"], wd=hp["weight_decay"], beta=hp["momentum"],
                               nesterov=nesterov)
    for n, p in model_a.named_parameters():
        q = named_b[n]
        assert not torch.equal(p.detach(), init[n]), f"{n} did not train"
        err = rel_err(p.detach(), q.detach())
        assert err < 1e-6, f"{n}: relative error {err:.3g}"
    # the AdamW half has exactly torch.optim.AdamW's state
    for n in ("embed.weight", "head.weight", "norm.weight", "fc1.bias"):
        pa = dict(model_a.named_parameters())[n]
        sa, sb = opt_a.state[pa], adamw.state[named_b[n]]
        assert sa["step"] == 5 and int(sb["step"]) == 5
        assert rel_err(sa["exp_avg"], sb["exp_avg"]) < 1e-6
        assert rel_err(sa["exp_avg_sq"], sb["exp_avg_sq"]) < 1e-6


# ------------------------------------------------------------------------------------------------
# conv and 3-D parameters
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(24, 2, 3, 3), (8, 4, 3, 3), (6, 3, 2)], ids=["conv-tall", "conv-wide", "conv1d"])
def test_conv_weight_is_flattened_matrix(shape):
    lr, beta = 0.03, 0.95
    p = muon_param(*shape, seed=6)
    W0 = p.detach().clone()
    g = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    opt = ds_muon.MuonAdamW([p], lr=lr, momentum=beta, ns_dtype="float32")
    p.grad = g.clone()
    opt.step()
    out, rest = shape[0], math.prod(shape[1:])
    if len(shape) == 3:
        # a 3-D param is a batch, not a conv: use the batch rule
        expected = W0 - lr * hand_orth_update(torch.lerp(g, (1 - beta) * g, beta))
    else:
        u2d = torch.lerp(g, (1 - beta) * g, beta).reshape(out, rest)
        expected = W0 - lr * (hand_ns(u2d) * math.sqrt(max(1.0, out / rest))).reshape(shape)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
    if shape == (24, 2, 3, 3):
        # the scale is that of (24, 18), not of (24, 2): sqrt(24/18), not sqrt(12)
        upd = ((W0 - p.detach()) / lr).reshape(out, rest)
        sv = torch.linalg.svdvals(upd / math.sqrt(24 / 18))
        assert sv.min() > 0.6 and sv.max() < 1.25


def test_3d_param_is_batch_of_independent_matrices():
    lr, beta = 0.02, 0.9
    p = muon_param(3, 10, 6, seed=8)
    W0 = p.detach().clone()
    g = torch.randn(3, 10, 6, generator=torch.Generator().manual_seed(9))
    g[1] *= 1000.0  # independent normalization: a huge slice must not shrink the others
    opt = ds_muon.MuonAdamW([p], lr=lr, momentum=beta, ns_dtype="float32")
    p.grad = g.clone()
    opt.step()
    u = torch.lerp(g, (1 - beta) * g, beta)
    for i in range(3):
        exp = W0[i] - lr * hand_ns(u[i]) * math.sqrt(10 / 6)
        torch.testing.assert_close(p.detach()[i], exp, rtol=1e-5, atol=1e-6)
        # each slice orthogonalized alone, matching a single 2-D param of that slice
        q = nn.Parameter(W0[i].clone())
        q.use_muon = True
        o2 = ds_muon.MuonAdamW([q], lr=lr, momentum=beta, ns_dtype="float32")
        q.grad = g[i].clone()
        o2.step()
        torch.testing.assert_close(p.detach()[i], q.detach(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# groups, hyperparameters, skipping, errors
# ------------------------------------------------------------------------------------------------
def test_per_group_lr_and_weight_decay():
    p1, p2 = muon_param(6, 4, seed=10), muon_param(6, 4, seed=11)
    a1 = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(12)))
    a1.use_muon = False
    W1, W2, A1 = p1.detach().clone(), p2.detach().clone(), a1.detach().clone()
    opt = ds_muon.MuonAdamW([{"params": [p1, a1], "lr": 0.1},
                             {"params": [p2], "lr": 0.01, "weight_decay": 0.5}],
                            lr=0.02, weight_decay=0.2, momentum=0.9, ns_dtype="float32")
    # three halves: group 0 Muon, group 0 AdamW, group 1 Muon
    assert [(g["use_muon"], g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
        (True, 0.1, 0.2), (False, 0.1, 0.2), (True, 0.01, 0.5)]
    gen = torch.Generator().manual_seed(13)
    g1, g2, ga = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(5, generator=gen)
    p1.grad, p2.grad, a1.grad = g1.clone(), g2.clone(), ga.clone()
    opt.step()
    for p, W, g, lr, wd in ((p1, W1, g1, 0.1, 0.2), (p2, W2, g2, 0.01, 0.5)):
        exp = W.clone()
        hand_muon_step(exp, g, torch.zeros_like(g), lr=lr, wd=wd, beta=0.9)
        torch.testing.assert_close(p.detach(), exp, rtol=1e-5, atol=1e-6)
    # AdamW first step: m_hat/sqrt(v_hat) = sign(g) (up to eps)
    exp_a = A1 * (1 - 0.1 * 0.2) - 0.1 * ga / (ga.abs() + 1e-8)
    torch.testing.assert_close(a1.detach(), exp_a, rtol=1e-6, atol=1e-7)


def test_muon_lr_adam_lr_adam_weight_decay_resolution():
    def groups(**hp):
        p = muon_param(4, 4)
        b = nn.Parameter(torch.zeros(4))
        b.use_muon = False
        opt = ds_muon.MuonAdamW([p, b], **hp)
        return {g["use_muon"]: g for g in opt.param_groups}

    g = groups(lr=0.03, weight_decay=0.1)
    assert (g[True]["lr"], g[True]["weight_decay"]) == (0.03, 0.1)
    assert (g[False]["lr"], g[False]["weight_decay"]) == (0.03, 0.1)
    g = groups(lr=0.03, muon_lr=0.05, adam_lr=1e-3, weight_decay=0.1, adam_weight_decay=0.01)
    assert (g[True]["lr"], g[True]["weight_decay"]) == (0.05, 0.1)
    assert (g[False]["lr"], g[False]["weight_decay"]) == (1e-3, 0.01)
    g = groups(adam_betas=[0.8, 0.9], adam_eps=1e-6)
    assert g[False]["betas"] == (0.8, 0.9) and g[False]["eps"] == 1e-6
    assert "betas" not in g[True] and "momentum" not in g[False]

    # per-group half-specific keys override the defaults for one half only
    p = muon_param(4, 4)
    b = nn.Parameter(torch.zeros(4))
    b.use_muon = False
    opt = ds_muon.MuonAdamW([{"params": [p, b], "muon_lr": 0.07, "adam_lr": 2e-3, "adam_weight_decay": 0.3}],
                            lr=0.02, weight_decay=0.1)
    g = {x["use_muon"]: x for x in opt.param_groups}
    assert (g[True]["lr"], g[True]["weight_decay"]) == (0.07, 0.1)
    assert (g[False]["lr"], g[False]["weight_decay"]) == (2e-3, 0.3)

    # and the AdamW step really uses adam_lr / adam_weight_decay
    w0 = torch.randn(4, generator=torch.Generator().manual_seed(14))
    b.data.copy_(w0)
    b.grad = torch.randn(4, generator=torch.Generator().manual_seed(15))
    ref = nn.Parameter(w0.clone())
    ref.grad = b.grad.clone()
    torch.optim.AdamW([ref], lr=2e-3, weight_decay=0.3, foreach=False).step()
    opt.step()
    torch.testing.assert_close(b.detach(), ref.detach(), rtol=1e-6, atol=1e-8)


def test_param_without_grad_is_skipped_and_state_untouched():
    p, q = muon_param(6, 4, seed=16), muon_param(6, 4, seed=17)
    a = nn.Parameter(torch.randn(3))
    a.use_muon = False
    opt = ds_muon.MuonAdamW([p, q, a], lr=0.02, ns_dtype="float32")
    p.grad = torch.randn(6, 4)
    q.grad = None
    a.grad = torch.randn(3)
    Q0 = q.detach().clone()
    opt.step()
    assert torch.equal(q.detach(), Q0) and q not in opt.state
    assert "momentum_buffer" in opt.state[p] and opt.state[a]["step"] == 1
    # later: p and a get no grad; their state and values stay exactly as they were
    P1, A1 = p.detach().clone(), a.detach().clone()
    mom, ea, eas = (opt.state[p]["momentum_buffer"].clone(), opt.state[a]["exp_avg"].clone(),
                    opt.state[a]["exp_avg_sq"].clone())
    p.grad, a.grad = None, None
    q.grad = torch.randn(6, 4)
    opt.step()
    assert torch.equal(p.detach(), P1) and torch.equal(a.detach(), A1)
    assert torch.equal(opt.state[p]["momentum_buffer"], mom)
    assert opt.state[a]["step"] == 1
    assert torch.equal(opt.state[a]["exp_avg"], ea) and torch.equal(opt.state[a]["exp_avg_sq"], eas)
    assert not torch.equal(q.detach(), Q0)


def test_use_muon_true_on_1d_param_raises():
    b = nn.Parameter(torch.zeros(5))
    b.use_muon = True
    with pytest.raises(ValueError, match=r"use_muon=False"):
        ds_muon.MuonAdamW([b])
    # through a module as well (explicit tag, module rule path); the message names the parameter
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model[1].weight.use_muon = True
    with pytest.raises(ValueError, match=r"1\.weight.*use_muon=False"):
        ds_muon.MuonAdamW(model)


@pytest.mark.parametrize("bad", [dict(momentum=1.5), dict(lr=-1.0), dict(ns_method="cubic"), dict(ns_steps=0),
                                 dict(update_scale="spectral"), dict(momentun=0.9)])
def test_bad_hyperparameter_raises_config_error(bad):
    with pytest.raises(ConfigError) as err:
        ds_muon.MuonAdamW([muon_param(4, 4)], **bad)
    key = next(iter(bad))
    assert key in str(err.value)


# ------------------------------------------------------------------------------------------------
# state_dict
# ------------------------------------------------------------------------------------------------
def _train(model, opt, steps, start):
    for s in range(start, start + steps):
        model.zero_grad(set_to_none=True)
        lm_loss(model, s).backward()
        opt.step()


def test_state_dict_round_trip():
    torch.manual_seed(1)
    model = SmallLM()
    hp = dict(lr=0.02, adam_lr=3e-3, weight_decay=0.05, ns_dtype="float32")
    opt = ds_muon.MuonAdamW(model, **hp)
    _train(model, opt, 3, 0)
    sd = copy.deepcopy(opt.state_dict())

    model2 = copy.deepcopy(model)
    opt2 = ds_muon.MuonAdamW(model2, **hp)
    opt2.load_state_dict(sd)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for k, v in opt.state[p].items():
            v2 = opt2.state[p2][k]
            assert (torch.equal(v, v2) and v.dtype == v2.dtype) if torch.is_tensor(v) else v == v2
    _train(model, opt, 2, 3)
    _train(model2, opt2, 2, 3)
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), n


def test_state_dict_round_trip_bf16_model_keeps_fp32_state():
    """Momentum is fp32 whatever the model dtype (docs/design.md, "One optimizer step"), also after load_state_dict."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8),
                          nn.Linear(8, 10)).to(torch.bfloat16)

    def grads(m, seed):
        gen = torch.Generator().manual_seed(seed)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)

    opt = ds_muon.MuonAdamW(model, lr=0.02, ns_dtype="float32")
    for s in range(2):
        grads(model, s)
        opt.step()
    model2 = copy.deepcopy(model)
    opt2 = ds_muon.MuonAdamW(model2, lr=0.02, ns_dtype="float32")
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    dtypes = {k: v.dtype for st in opt2.state.values() for k, v in st.items() if torch.is_tensor(v)}
    assert set(dtypes.values()) == {torch.float32}, (
        "BUG ds_muon/reference.py MuonAdamW has no load_state_dict override: torch.optim.Optimizer."
        "load_state_dict casts every floating state tensor to the parameter's dtype, so on a bf16 model the "
        f"fp32 momentum_buffer/exp_avg/exp_avg_sq come back as {dtypes} (precision lost) and the next "
        "step() raises 'expected dtype c10::BFloat16 for `end` but got dtype float' in m.lerp_(g, 1-beta). "
        "Fix: after super().load_state_dict, restore the saved fp32 values (e.g. cast state back to float32 "
        "from the incoming state_dict tensors).")
    grads(model, 5)
    grads(model2, 5)
    opt.step()
    opt2.step()
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


# ------------------------------------------------------------------------------------------------
# module selection
# ------------------------------------------------------------------------------------------------
def test_module_selects_by_module_type():
    model = SmallLM()
    opt = ds_muon.MuonAdamW(model, lr=0.02, weight_decay=0.1)
    named = {id(p): n for n, p in model.named_parameters()}
    muon = {named[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {named[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    assert muon == MUON_NAMES
    assert adamw == {"embed.weight", "fc1.bias", "proj.bias", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    assert {g["use_muon"] for g in opt.param_groups} == {True, False}
    assert len(opt.param_groups) == 3  # Muon; AdamW decayed; AdamW norm weights and biases, weight_decay 0
    exempt = {named[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 and not g["use_muon"] for p in g["params"]}
    assert exempt == {"fc1.bias", "proj.bias", "norm.weight", "norm.bias", "head.bias"}


def test_frozen_params_are_not_in_groups():
    model = SmallLM()
    model.fc2.weight.requires_grad_(False)
    model.norm.requires_grad_(False)
    opt = ds_muon.MuonAdamW(model, lr=0.02)
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.fc2.weight) not in ids and id(model.norm.weight) not in ids
    assert id(model.fc1.weight) in ids
