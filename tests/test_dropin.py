"""Built-in Muon configs that ds_muon runs as they are: torch_adam/foreach and torch_autocast, against
the oracle (W=2, CPU, gloo, one process group for all cases).

* ``torch_adam: true, foreach: false``: the AdamW half is ``torch.optim.AdamW`` (DeepSpeed's
  ``get_optimizer_configuration`` picks it), fp32, so the parity tolerance is the usual one:
  harness.PARITY_RTOL (1e-5) of each parameter and 1e-3 of its update.
* ``torch_autocast`` bf16 (fp32 weights, bf16 compute in Linear/Conv): the oracle runs its forward
  under the same ``torch.autocast("cpu", torch.bfloat16)``. DeepSpeed also reduces the gradients of
  autocast modules' parameters in bf16 (their ``comm_dtype``), which the single-device oracle has no
  counterpart for, so the stated tolerance is looser: 1e-3 of each parameter and 3e-2 of its update;
  and a run without autocast must land clearly farther from the autocast oracle than that.
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
         dict(name="torch_autocast", top={"torch_autocast": AUTOCAST}, autocast=True, rtol=1e-3, rtol_update=3e-2),
         dict(name="no-autocast-control", autocast=True, control=True)]


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
            if case.get("autocast"):  # the oracle computes its forward as the engine does
                ref.forward = torch.autocast("cpu", dtype=torch.bfloat16)(ref.forward)
            opt = ds_muon.MuonAdamW(ref.parameters(), **cfg["optimizer"]["params"])
            train_reference(ref, opt, STEPS, world_size, 1, 0.5)
            res["errors"] = compare(got, {n: p.detach().clone() for n, p in ref.named_parameters()}, init)
            res["tags"] = tags
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
        assert err["rel"] <= case["rtol"], f"{case['name']}: {name} rel error {err['rel']:.2e}"
        if err["moved"] > 0:
            assert err["rel_update"] <= case["rtol_update"], f"{case['name']}: {name} update {err['rel_update']:.2e}"


def test_autocast_changes_the_result(results):
    # the same run without torch_autocast is far from the autocast oracle: the tolerance above is not vacuous
    control = results[0][2]["errors"]
    worst = max(e["rel_update"] for n, e in control.items() if results[0][2]["tags"][n] and e["moved"] > 0)
    assert worst > 3 * CASES[1]["rtol_update"], worst
