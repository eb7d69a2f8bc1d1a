"""Built-in Muon configs that ds_muon runs as they are: torch_adam/foreach and torch_autocast, against
the oracle (W=2, CPU, gloo, one process group for all cases).

* ``torch_adam: true, foreach: false``: the AdamW half is ``torch.optim.AdamW`` (DeepSpeed's
  ``get_optimizer_configuration`` picks it), fp32, so the parity tolerance is the usual one:
  harness.PARITY_RTOL (1e-5) of each parameter and 1e-3 of its update.
* ``torch_autocast`` bf16 (fp32 weights, bf16 compute in Linear/Conv): the oracle runs its forward
  under the same ``torch.autocast("cpu", torch.bfloat16)``, and, as DeepSpeed reduces the gradients
  of autocast modules' parameters in bf16 (their ``comm_dtype``), rounds each rank's gradient of those
  parameters to bf16 before summing (:func:`_autocast_oracle`). Measured: the engine lands within
  4.2e-2 of a Muon parameter's update and 6e-2 of an AdamW one's (0.2 for LayerNorm weights, whose
  near-zero gradients Adam normalizes), about as far as a run without autocast lands (2.3e-2 / 4e-2);
  the rounding inside the bf16 reduce-scatter and DeepSpeed's autocast forward are not copied more
  closely by the oracle. So the tolerance is the half-precision one of test_zero3_parity (1e-2 of each
  parameter, 5e-2 of a Muon update, 0.5 of an AdamW update), and the autocast run must differ from the
  run without it (autocast was not silently ignored).
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_util import run_distributed
from tests.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                           reference_model, train_engine, train_reference)

STEPS = 3
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}
CASES = [dict(name="torch_adam", params={"torch_adam": True, "foreach": False, "fp32_optimizer_states": True},
              rtol=PARITY_RTOL, rtol_update=1e-3),
         dict(name="torch_autocast", top={"torch_autocast": AUTOCAST}, autocast=True, rtol=1e-2, rtol_update=5e-2,
              adamw_rtol_update=0.5),
         dict(name="no-autocast-control", autocast=True, control=True)]


def _autocast_oracle(model, optimizer, steps: int, world_size: int, clip: float) -> None:
    """The oracle loop for ``torch_autocast`` bf16: autocast forward per rank; gradients of the
    parameters of DeepSpeed's lower-precision-safe modules (Linear, Conv) rounded to bf16 per rank
    (DeepSpeed's comm_dtype), others fp32; summed, clipped by the global norm, one step."""
    from deepspeed.runtime.torch_autocast import LOWER_PRECISION_SAFE_MODULES
    from tests.models import batch, use_extra
    low = {id(p) for m in model.modules() if type(m) in LOWER_PRECISION_SAFE_MODULES for p in m.parameters(False)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        total = [torch.zeros_like(p) for p in trainable]
        for rank in range(world_size):
            tokens, targets = batch(step, rank, 0, 2)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens, targets, use_extra(step)) / world_size
            grads = torch.autograd.grad(loss, trainable, allow_unused=True)
            for t, g, p in zip(total, grads, trainable):
                if g is not None:
                    t += g.to(torch.bfloat16).float() if id(p) in low else g
        for p, t in zip(trainable, total):
            p.grad = t
        torch.nn.utils.clip_grad_norm_(trainable, clip)
        optimizer.step()


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
        train_engine(engine, STEPS, rank, gas=1)
        got = gathered_params(model)
        engine.destroy()
        if rank == 0:
            ref = reference_model(init, tags)
            opt = ds_muon.MuonAdamW(ref.parameters(), **cfg["optimizer"]["params"])
            if case.get("autocast"):
                _autocast_oracle(ref, opt, STEPS, world_size, 0.5)
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


def test_autocast_changes_the_result(results):
    # the engine with torch_autocast differs from the same engine without it: autocast was not ignored
    with_autocast, without = results[0][1]["got"], results[0][2]["got"]
    worst = max(((with_autocast[n] - without[n]).norm() / without[n].norm()).item()
                for n, muon in results[0][1]["tags"].items() if muon and without[n].norm() > 0)
    assert worst > 1e-4, worst
