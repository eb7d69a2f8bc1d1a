"""DeepSpeed's config schedulers on ds_muon: the scheduler's value is the Muon lr, every param group
keeps its ratio to it (ds_muon.integration.schedulers), against the oracle driven by the same schedule.

One W=2 process group (CPU, gloo, fp32) builds an engine per scheduler type and trains 4 steps;
rank 0 trains ``ds_muon.MuonAdamW`` on the same data with each group's lr set before every step
from DeepSpeed's own scheduler class run on a plain optimizer with one group per oracle group:
for a scheduler that writes one lr ``L(t)`` into every group, the oracle group g gets
``L(t) * lr_g(0) / muon_lr`` (``scale``); for the others, the value DeepSpeed computes for that group.
Tolerance: harness.PARITY_RTOL (1e-5 of the parameter) and 1e-3 of its update, as the parity tests;
``engine.get_lr()`` must equal the oracle's lrs (both Muon's and AdamW's) at every step.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.spawn import run_distributed
from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                           oracle_schedule, reference_model, train_engine, train_reference)

STEPS = 4


def _own_adam_lr_groups(model):
    """Case (a): 1-D parameters in a group of their own with adam_lr 0.01 (the config says 3e-3)."""
    from ds_muon.model.structure import param_shape
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if len(param_shape(p)) >= 2]},
            {"params": [p for n, p in named if len(param_shape(p)) < 2], "adam_lr": 0.01}]


CASES = [
    dict(name="WarmupLR", scale=True,
         params={"warmup_min_lr": 0.002, "warmup_max_lr": 0.02, "warmup_num_steps": 4, "warmup_type": "linear"}),
    # (b) no warmup_max_lr: DeepSpeed warms every group up to its own lr
    dict(name="WarmupLR", scale=False, params={"warmup_min_lr": 0.001, "warmup_num_steps": 3}),
    # (a) a group with its own adam_lr through model_parameters keeps its ratio (0.01 / 0.02)
    dict(name="WarmupDecayLR", scale=True, groups=True,
         params={"total_num_steps": 5, "warmup_min_lr": 0.004, "warmup_max_lr": 0.03, "warmup_num_steps": 2}),
    dict(name="WarmupCosineLR", scale=False,
         params={"total_num_steps": 5, "warmup_min_ratio": 0.1, "warmup_num_steps": 2}),
    dict(name="OneCycle", scale=True,
         params={"cycle_min_lr": 0.005, "cycle_max_lr": 0.03, "cycle_first_step_size": 2}),
    dict(name="LRRangeTest", scale=True, groups=True,
         params={"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 1, "lr_range_test_step_rate": 0.5}),
]


def _worker(rank: int, world_size: int) -> list[dict]:
    import ds_muon
    from ds_muon.integration.schedulers import GroupRatioScheduler
    out = []
    for case in CASES:
        cfg = ds_config()
        cfg["scheduler"] = {"type": case["name"], "params": dict(case["params"])}
        groups_fn = _own_adam_lr_groups if case.get("groups") else None
        engine, model = build_engine(cfg, model_parameters=groups_fn)
        init, tags = gathered_params(model), clone_tags(model)
        engine_lrs = []
        real_step = engine.optimizer.step

        def step_and_record(*a, **k):  # the lrs each optimizer step uses, as engine.get_lr() reports them
            engine_lrs.append(list(engine.get_lr()))
            return real_step(*a, **k)

        engine.optimizer.step = step_and_record
        train_engine(engine, STEPS, rank, gas=1)
        res = {"wrapped": isinstance(engine.lr_scheduler, GroupRatioScheduler), "engine_lrs": engine_lrs}
        got = gathered_params(model)
        engine.destroy()
        if rank == 0:
            ref = reference_model(init, tags)
            opt = ds_muon.MuonAdamW(groups_fn(ref) if groups_fn else ref.parameters(), **cfg["optimizer"]["params"])
            muon_lr = cfg["optimizer"]["params"]["lr"]
            schedule = oracle_schedule(cfg["scheduler"], [g["lr"] for g in opt.param_groups], muon_lr, STEPS,
                                       case["scale"])

            def set_lrs(step: int) -> None:
                for g, lr in zip(opt.param_groups, schedule[step]):
                    g["lr"] = lr

            train_reference(ref, opt, STEPS, world_size, 1, 0.0, before_step=set_lrs)
            res["oracle_lrs"] = schedule
            res["use_muon"] = [g["use_muon"] for g in opt.param_groups]
            res["errors"] = compare(got, {n: p.detach().clone() for n, p in ref.named_parameters()}, init)
        out.append(res)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("k", range(len(CASES)), ids=[f"{c['name']}-{'scaled' if c['scale'] else 'own'}"
                                                      + ("-groups" if c.get("groups") else "") for c in CASES])
def test_scheduler_parity(results, k):
    case, res = CASES[k], results[0][k]
    assert results[1][k]["engine_lrs"] == res["engine_lrs"]
    assert res["wrapped"] is case["scale"]
    # engine.get_lr() reports every group's lr, Muon's and AdamW's, as the oracle schedule has them
    torch.testing.assert_close(torch.tensor(res["engine_lrs"], dtype=torch.float64),
                               torch.tensor(res["oracle_lrs"], dtype=torch.float64),
                               rtol=1e-12, atol=0)
    lrs = torch.tensor(res["oracle_lrs"])
    muon = torch.tensor(res["use_muon"])
    assert len(set(lrs[:, 0].tolist())) > 1, "the schedule never changed the lr"
    assert (lrs[-1, ~muon] != lrs[-1, muon][0]).all(), "an AdamW group trained at the Muon lr"
    if case.get("groups"):  # the own-adam_lr group keeps 0.01 / 0.02 of the Muon lr
        torch.testing.assert_close(lrs[:, -1], lrs[:, 0] * 0.5)
    for name, err in res["errors"].items():
        assert err["rel"] <= PARITY_RTOL, f"{name}: rel error {err['rel']:.2e}"
        if err["moved"] > 0:
            assert err["rel_update"] <= 1e-3, f"{name}: update rel error {err['rel_update']:.2e}"
