"""Newton-Schulz settings changed after initialize reach the step (ds_muon/sharded/muon_step.py), at ZeRO-3 and
ZeRO-2, W=2, against the single-device oracle ``ds_muon.MuonAdamW`` given the same changes.

ds_muon follows the param group, as torch optimizers do: ``ns_method``, ``ns_steps`` and ``update_scale`` are read
from the group at every step (``MuonShardStep._orthogonalizer`` rebuilds its kernel when they change), whether a
user edits ``engine.optimizer.param_groups`` or a loaded checkpoint brings its own groups. The owner plan (built
at initialize; its LPT cost model reads ``ns_steps``/``ns_method`` for load balance only) is not rebuilt.

Each stage: engine A steps once with the config's settings (standard, 5 steps, ``shape``), the test edits every
group to ``EDIT1`` and A steps again, then saves; engine B, built from the same config, loads that checkpoint (its
groups bring ``EDIT1``), steps once, is edited to ``EDIT2`` and steps once more. The oracle trains the 4 steps with
``EDIT1`` from step 1 and ``EDIT2`` from step 3. fp32 everywhere: ``harness.PARITY_RTOL`` of each parameter, 1e-3
of its update, and every Muon matrix at least 10x farther from an oracle that never changed its settings.
(Fails with the kernel built once at initialize: the Muon matrices then match the unchanged oracle.)
"""
from __future__ import annotations

from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                                   reference_model, train_reference, train_steps)
from tests.support.spawn import run_distributed

GAS, CLIP, STEPS = 2, 0.5, 4
EDIT1 = {"ns_steps": 3, "update_scale": "rms_match"}
EDIT2 = {"ns_method": "polar_express", "ns_steps": 4}
STAGES = (3, 2)


def _edit(param_groups, settings: dict) -> None:
    for group in param_groups:
        if "ns_steps" in group:
            group.update(settings)


def _settings(opt) -> list:
    return [(g["ns_method"], g["ns_steps"], g["update_scale"]) for g in opt.param_groups if "ns_steps" in g]


def _run(rank: int, world_size: int, stage: int, ckpt: str) -> dict:
    import ds_muon
    cfg = ds_config(gas=GAS, clip=CLIP, stage=stage)
    engine, model = build_engine(cfg)
    init, tags = gathered_params(model), clone_tags(model)
    train_steps(engine, rank, 0, 1, GAS)
    _edit(engine.optimizer.param_groups, EDIT1)
    train_steps(engine, rank, 1, 2, GAS)
    engine.save_checkpoint(ckpt, tag="edited")
    engine.destroy()
    engine, model = build_engine(cfg)
    engine.load_checkpoint(ckpt, tag="edited")
    out = {"loaded": _settings(engine.optimizer)}
    train_steps(engine, rank, 2, 3, GAS)
    _edit(engine.optimizer.param_groups, EDIT2)
    train_steps(engine, rank, 3, STEPS, GAS)
    got = gathered_params(model)
    engine.destroy()
    if rank != 0:
        return out
    params = cfg["optimizer"]["params"]

    def oracle(edits: bool) -> dict:
        ref = reference_model(init, tags)
        opt = ds_muon.MuonAdamW(ref.parameters(), **params)

        def before_step(step: int) -> None:
            if edits and step in (1, 3):
                _edit(opt.param_groups, EDIT1 if step == 1 else EDIT2)

        train_reference(ref, opt, STEPS, world_size, GAS, CLIP, before_step=before_step)
        return {n: p.detach().clone() for n, p in ref.named_parameters()}

    out.update(errors=compare(got, oracle(True), init), unchanged=compare(got, oracle(False), init), tags=tags)
    return out


def worker(rank: int, world_size: int, ckpt: str) -> list[dict]:
    import os
    return [_run(rank, world_size, stage, os.path.join(ckpt, f"stage{stage}")) for stage in STAGES]


def test_newton_schulz_settings_changed_after_initialize_reach_the_step(tmp_path):
    results = run_distributed(worker, 2, str(tmp_path), timeout=600)
    for k, stage in enumerate(STAGES):
        res = results[0][k]
        loaded = ("standard", EDIT1["ns_steps"], EDIT1["update_scale"])
        assert all(r[k]["loaded"] and set(r[k]["loaded"]) == {loaded} for r in results), (stage, res["loaded"])
        for name, err in res["errors"].items():
            assert err["rel"] <= PARITY_RTOL, f"stage {stage}: {name} rel error {err['rel']:.2e}"
            assert err["rel_update"] <= 1e-3, f"stage {stage}: {name} update rel error {err['rel_update']:.2e}"
            if res["tags"][name] and err["moved"] > 0:
                far = res["unchanged"][name]["rel_update"]
                assert far >= 10 * max(err["rel_update"], 1e-3), (
                    f"stage {stage}: {name} is as close to the oracle that kept the settings ({far:.2e})")
