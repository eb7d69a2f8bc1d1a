"""Built-in Muon configs that ds_muon runs as they are: torch_adam/foreach and torch_autocast, against
the oracle (W=2, CPU, gloo, one process group for all cases).

* ``torch_adam: true, foreach: false``: the AdamW half is ``torch.optim.AdamW`` (DeepSpeed's
  ``get_optimizer_configuration`` picks it), fp32, so the parity tolerance is the usual one:
  harness.PARITY_RTOL (1e-5) of each parameter and 1e-3 of its update.
* ``torch_autocast`` bf16 (fp32 weights, bf16 compute in autocast's ops): the oracle reproduces
  DeepSpeed's arithmetic (:func:`_autocast_oracle`), so the tolerance is the fp32 one. DeepSpeed 0.19.8
  marks every parameter of a lower-precision-safe module (``LOWER_PRECISION_SAFE_MODULES``: Linear,
  Conv1d/2d/3d; a tied one too, e.g. an embedding shared with a Linear head) with ``comm_dtype`` bf16,
  and ZeRO-3 then (a) all-gathers those parameters in bf16 for the forward (the fp32 master is rounded
  to bf16 before every forward, also where the tensor is used outside autocast, as in the embedding
  lookup of a tied head), and (b) reduce-scatters their gradients in bf16 (each rank's gradient rounded
  to bf16, the sum rounded to bf16). The oracle does both and lands within 4e-6 of each parameter and
  2e-5 of its update (measured). Without (a) the engine is 6e-4 of a parameter and 4e-2 of a Muon
  update away (5e-2 for the tied embedding: a bf16-rounded table against an fp32 one changes every
  activation by ~2^-9 relative); with (a) but an fp32 sum of the bf16-rounded per-rank gradients it is
  4e-4 of a parameter away; both fail this test. Everything else (autocast's own casts, the fp32
  Adam/Muon step on fp32 masters) is the same arithmetic in both. The autocast run must also differ from the run without it (autocast was not
  silently ignored).

  Rounding to bf16 is discontinuous: where the engine's and the oracle's fp32 masters differ by fp32
  noise (1e-7 relative: the gradient reduction sums in another order) and straddle a bf16 rounding
  boundary, the two forwards see values one bf16 step (2^-8 relative) apart, and every later
  gradient moves by ~1e-3 (measured: 2 such elements of ``extra`` after step 0, from a reassociated
  but equally exact Newton–Schulz, put all Muon weights 1e-4..5e-4 apart after step 2). The fp32
  parameters of the forward (norms) do the same through the activations autocast rounds to bf16: fp32
  noise in a LayerNorm weight flips a rounded activation, and on a machine with AMX-BF16 that put
  ``extra.weight`` 1.7e-5 from the oracle (3e-4 of its update). So the oracle's forward takes the
  engine's values of every parameter (bf16-rounded for the lower-precision-safe modules, fp32 as they
  are for the others; :func:`_forward_values`), and each step first checks that the engine's masters are
  within the fp32 tolerance of the oracle's and that the two bf16 roundings differ only by such
  neighbouring values. So drift cannot build up across steps: each step is compared from the engine's
  point (its masters within the fp32 tolerance of the oracle's), and the final parameters after it.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.spawn import run_distributed
from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                           reference_model, train_reference)
from tests.support.models import batch, use_extra

STEPS = 3
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}
CASES = [dict(name="torch_adam", params={"torch_adam": True, "foreach": False, "fp32_optimizer_states": True},
              rtol=PARITY_RTOL, rtol_update=1e-3),
         dict(name="torch_autocast", top={"torch_autocast": AUTOCAST}, autocast=True, rtol=PARITY_RTOL,
              rtol_update=1e-3),
         dict(name="no-autocast-control", autocast=True, control=True)]


def _forward_values(mine: torch.Tensor, engine: torch.Tensor, name: str, rtol: float) -> tuple[torch.Tensor, dict]:
    """The bf16 values of ``engine`` (the engine's fp32 master at the start of a step; any shape, fp32),
    as fp32, for the oracle's forward, and a check record: ``rel`` = ||engine - mine|| / ||mine|| (fp32
    masters), ``flips`` = elements whose bf16 rounding differs, ``neighbours`` = whether every such
    pair is two adjacent bf16 numbers of one sign (what fp32 noise across a rounding boundary gives)."""
    a, b = mine.to(torch.bfloat16), engine.to(torch.bfloat16)
    flip = a != b
    steps = (a[flip].view(torch.int16).int() - b[flip].view(torch.int16).int()).abs()
    same_sign = torch.signbit(a[flip]) == torch.signbit(b[flip])
    rel = ((engine - mine).norm() / mine.norm().clamp_min(1e-30)).item()
    return b.float(), {"name": name, "rel": rel, "rtol": rtol, "flips": int(flip.sum()),
                       "neighbours": bool((steps <= 1).all() and same_sign.all())}


def _autocast_oracle(model, optimizer, steps: int, world_size: int, clip: float,
                     engine_masters: list[dict] | None = None) -> list[dict]:
    """The oracle loop for ``torch_autocast`` bf16, as DeepSpeed's ZeRO-3 computes it: the parameters
    of lower-precision-safe modules (Linear, Conv; their ``comm_dtype`` is bf16) enter each forward
    rounded to bf16 (ZeRO-3 all-gathers them in bf16) while the optimizer steps their fp32 values;
    autocast forward per rank; their per-rank gradients rounded to bf16 and summed in bf16 (the bf16
    reduce-scatter), others summed in fp32; clipped by the global norm; one step.

    ``engine_masters[step]``: the engine's fp32 parameters (by name) at the start of ``step``; the
    forward then takes those instead of the oracle's own masters (rounded to bf16 for the
    lower-precision-safe ones; :func:`_forward_values`, see the module docstring). Returns the per-step
    check records of :func:`_forward_values`."""
    from deepspeed.runtime.torch_autocast import LOWER_PRECISION_SAFE_MODULES
    low = {id(p) for m in model.modules() if type(m) in LOWER_PRECISION_SAFE_MODULES for p in m.parameters(False)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    checks = []
    for step in range(steps):
        total = [torch.zeros_like(p, dtype=torch.bfloat16 if id(p) in low else p.dtype) for p in trainable]
        forward = {}
        for p in model.parameters():
            if engine_masters is None:
                if id(p) in low:
                    forward[p] = p.data.to(torch.bfloat16).float()
                continue
            engine = engine_masters[step][names[id(p)]]
            forward[p], check = _forward_values(p.data, engine, names[id(p)], PARITY_RTOL)
            checks.append(dict(check, step=step))
            if id(p) not in low:  # fp32 in the forward (norms, fp32 biases): the engine's value as it is
                forward[p] = engine.clone()
        for rank in range(world_size):
            tokens, targets = batch(step, rank, 0, 2)
            masters = {p: p.data for p in forward}
            for p in masters:  # ZeRO-3 all-gathers these in their comm_dtype: the forward sees bf16 values
                p.data = forward[p]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens, targets, use_extra(step)) / world_size
            grads = torch.autograd.grad(loss, trainable, allow_unused=True)
            for p, master in masters.items():
                p.data = master
            for t, g in zip(total, grads):
                if g is not None:
                    t += g.to(t.dtype)  # bf16 + bf16: the sum rounded to bf16, as DeepSpeed's bf16 reduce-scatter
        for p, t in zip(trainable, total):
            p.grad = t.float()
        torch.nn.utils.clip_grad_norm_(trainable, clip)
        optimizer.step()
    return checks


def _worker(rank: int, world_size: int) -> list[dict]:
    import ds_muon
    out = []
    for case in CASES:
        cfg = ds_config(clip=0.5)
        cfg["optimizer"]["params"].update(case.get("params", {}))
        cfg.update(case.get("top", {}))
        engine, model = build_engine(cfg)
        init, tags = gathered_params(model), clone_tags(model)
        adamw = engine.optimizer.optimizer.adamw
        res = {"adamw": type(adamw).__name__, "foreach": adamw.defaults.get("foreach")}
        masters = [init]  # the engine's fp32 parameters at the start of each step (for the autocast oracle)
        for step in range(STEPS):  # train_engine's loop, gathering after each step
            tokens, targets = batch(step, rank, 0, 2)
            engine.backward(engine(tokens, targets, use_extra(step)))
            engine.step()
            masters.append(gathered_params(model))
        got = masters.pop()
        engine.destroy()
        if rank == 0:
            ref = reference_model(init, tags)
            opt = ds_muon.MuonAdamW(ref.parameters(), **cfg["optimizer"]["params"])
            if case.get("autocast"):
                res["checks"] = _autocast_oracle(ref, opt, STEPS, world_size, 0.5,
                                                 None if case.get("control") else masters)
            else:
                train_reference(ref, opt, STEPS, world_size, 1, 0.5)
            res["errors"] = compare(got, {n: p.detach().clone() for n, p in ref.named_parameters()}, init)
            res["tags"] = tags
            res["got"] = got
        out.append(res)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


def test_torch_adam_picks_torch_adamw(results):
    res = results[0][0]
    assert res["adamw"] == "AdamW" and res["foreach"] is False, res


@pytest.mark.parametrize("k", [0, 1], ids=[c["name"] for c in CASES[:2]])
def test_parity_with_oracle(results, k):
    case, res = CASES[k], results[0][k]
    assert any(res["tags"].values()) and not all(res["tags"].values())
    for name, err in res["errors"].items():
        if not res["tags"][name] and "adamw_rtol_update" in case:
            assert err["rel_update"] <= case["adamw_rtol_update"], f"{case['name']}: {name} {err['rel_update']:.2e}"
            continue
        assert err["rel"] <= case["rtol"], f"{case['name']}: {name} rel error {err['rel']:.2e}"
        if err["moved"] > 0:
            assert err["rel_update"] <= case["rtol_update"], f"{case['name']}: {name} update {err['rel_update']:.2e}"


def test_autocast_oracle_forward_values(results):
    # the oracle's forward takes the engine's bf16 values only where they are its own up to fp32 noise:
    # at every step the engine's masters are within the fp32 tolerance and the roundings are neighbours
    checks = results[0][1]["checks"]
    assert len(checks) >= STEPS
    for c in checks:
        assert c["rel"] <= c["rtol"] and c["neighbours"], c


def test_autocast_changes_the_result(results):
    # the engine with torch_autocast differs from the same engine without it: autocast was not ignored
    with_autocast, without = results[0][1]["got"], results[0][2]["got"]
    worst = max(((with_autocast[n] - without[n]).norm() / without[n].norm()).item()
                for n, muon in results[0][1]["tags"].items() if muon and without[n].norm() > 0)
    assert worst > 1e-4, worst
