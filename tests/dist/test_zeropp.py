"""ZeRO++ and MiCS under ds_muon (DeepSpeed 0.19.8, CPU accelerator, gloo).

* hpZ (``zero_hpz_partition_size: 2`` at W=4, ZeRO-3): DeepSpeed keeps a secondary copy of each parameter
  partitioned within groups of 2 ranks and all-gathers from it in backward; the optimizer's partitions, the
  gradient reduce-scatter and ds_muon's owner exchange stay on the whole data-parallel group. Parity with the
  oracle parameter by parameter (tolerance as tests/dist/test_zero3_parity.py: 1e-5 relative to each
  parameter, 1e-3 relative to its update), GAS 2, clipping on, with and without ``zero.Init`` and with
  ``reduce_scatter: false``; a probe checks hpZ really was on (secondary tensors built in the group of 2).
* qwZ / qgZ (``zero_quantized_weights``, ``zero_quantized_gradients``): DeepSpeed's QuantizerBuilder has no CPU
  implementation; ds_muon refuses the config in ``initialize`` before DeepSpeed builds anything, naming the key,
  DeepSpeed's own reason and that ZeRO++ quantization runs on CUDA. Both halves are asserted: DeepSpeed alone
  (its AdamW) fails with that reason, later (qwZ inside ``deepspeed.initialize``, qgZ at the first backward).
* MiCS (``mics_shard_size``): DeepSpeed 0.19.8 refuses the key in ``DeepSpeedConfig`` ("MiCS ZeRO-3 sharding
  has been removed"); through ``ds_muon.initialize`` and through zero-code activation that error reaches the
  caller unchanged, no engine is built (no hang, no fallback).

All W=4 cases run in one process group.
"""
from __future__ import annotations

from ds_muon.config.sections import deepspeed_version  # the installed release, which the message names

from tests.dist.test_zero3_parity import check_parity, parity_worker
from tests.support.harness import build_engine, ds_config
from tests.support.spawn import run_distributed

HPZ = 2
CPU_REASON = "This op had not been implemented on CPU backend."
MICS_REASON = "MiCS ZeRO-3 sharding has been removed"


def _hpz_start(engine) -> None:
    """Probe: record, at every backward all-gather, whether it came from a secondary (hpZ) partition."""
    opt = engine.optimizer
    _HPZ_SEEN[:] = [0, opt.zero_hpz_partition_size]
    for p in engine.module.parameters():
        p.ds_muon_probe_gather = p.all_gather_coalesced  # noqa: B010 - restored in _hpz_finish

        def gather(params, *args, _orig=p.all_gather_coalesced, **kwargs):
            _HPZ_SEEN[0] += sum(getattr(q, "ds_secondary_tensor", None) is not None for q in params)
            return _orig(params, *args, **kwargs)
        p.all_gather_coalesced = gather


_HPZ_SEEN: list = []


def _hpz_finish(engine) -> dict:
    """Probe result: the optimizer's hpZ size, how many gathers found a secondary partition, and the size of
    the secondary partition of the largest parameter relative to its primary one (hpZ=2 at W=4: 2x)."""
    for p in engine.module.parameters():
        p.all_gather_coalesced = p.ds_muon_probe_gather
        del p.ds_muon_probe_gather
    return {"hpz": _HPZ_SEEN[1], "secondary_gathers": _HPZ_SEEN[0]}


def _refusals(rank: int, world_size: int) -> dict:
    """qwZ, qgZ and MiCS through ds_muon.initialize, zero-code activation and DeepSpeed alone: each error's
    type and message (``"built"`` where an engine was built, ``"trained"`` where a step ran too)."""
    import deepspeed
    import torch

    import ds_muon
    from ds_muon.integration import hooks
    from tests.support.models import ParityNet, batch, use_extra

    def attempt(zero: dict, how: str) -> tuple[str, str]:
        cfg = ds_config(gas=1, clip=0.5, **zero)
        if how == "deepspeed":
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        try:
            if how == "auto":
                hooks.auto_enable()
                torch.manual_seed(0)
                model = ParityNet()
                try:
                    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=cfg)
                finally:
                    hooks.disable()
                    hooks._auto = False
            elif how == "deepspeed":
                torch.manual_seed(0)
                model = ParityNet()
                engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            else:
                engine, _ = build_engine(cfg)
        except Exception as exc:  # noqa: BLE001 - what the caller sees
            return type(exc).__name__, str(exc)
        try:
            tokens, targets = batch(0, rank, 0)
            engine.backward(engine(tokens, targets, use_extra(0)))
            engine.step()
        except Exception as exc:  # noqa: BLE001
            return "built, then " + type(exc).__name__, str(exc)
        finally:
            engine.destroy()
        return "trained", ""

    out = {}
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        for how in ("initialize", "auto", "deepspeed"):
            out[(key, how)] = attempt({key: True}, how)
    for how in ("initialize", "auto"):
        out[("mics_shard_size", how)] = attempt({"mics_shard_size": 2}, how)
    return out


def _worker(rank: int, world_size: int, cases: list[dict]) -> dict:
    from deepspeed.utils import groups
    parity = []
    for case in cases:
        # DeepSpeed 0.19.8 creates the hpZ group once per process and never resets it (engine.destroy() keeps
        # it; a second hpZ engine asserts "ZeRO parameter intra parallel group is already initialized")
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
        parity += parity_worker(rank, world_size, [case])
    return {"parity": parity, "refusals": _refusals(rank, world_size)}


HPZ_CASES = [
    dict(name="w4-hpz2-gas2-clip", gas=2, clip=0.5, zero=dict(zero_hpz_partition_size=HPZ),
         probe=(_hpz_start, _hpz_finish)),
    dict(name="w4-hpz2-zeroinit-allreduce-gas2-clip", gas=2, clip=0.5, zero_init=True,
         zero=dict(zero_hpz_partition_size=HPZ, reduce_scatter=False), probe=(_hpz_start, _hpz_finish)),
]


def test_zeropp_hpz_parity_and_qwz_qgz_mics_refusals() -> None:
    results = run_distributed(_worker, 4, HPZ_CASES)
    for k, case in enumerate(HPZ_CASES):
        per_rank = [r["parity"][k] for r in results]
        for rank, r in enumerate(per_rank):  # hpZ was on: the backward gathers read secondary partitions
            assert r["probe"]["hpz"] == HPZ, (case["name"], rank, r["probe"])
            assert r["probe"]["secondary_gathers"] > 0, (case["name"], rank, r["probe"])
        check_parity(case, per_rank)
        worst = max(per_rank[0]["errors"].items(), key=lambda kv: kv[1]["rel_update"])
        print(f"{case['name']}: worst update error {worst[1]['rel_update']:.1e} ({worst[0]}), parameter error "
              f"{max(e['rel'] for e in per_rank[0]['errors'].values()):.1e}; gathers from secondary partitions "
              f"{per_rank[0]['probe']['secondary_gathers']}")  # -s shows it (docs/parallelism.md quotes it)

    refusals = results[0]["refusals"]
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        for how in ("initialize", "auto"):  # ds_muon: before DeepSpeed builds anything
            kind, msg = refusals[(key, how)]
            assert kind == "ConfigError", (key, how, kind, msg)
            assert f"zero_optimization.{key}: true" in msg and CPU_REASON in msg and f"DeepSpeed {deepspeed_version()}" in msg, msg
            assert "runs on CUDA" in msg and f"Set {key} to false" in msg, msg
        kind, msg = refusals[(key, "deepspeed")]  # DeepSpeed alone fails with the reason ds_muon quotes
        assert CPU_REASON in msg, (key, kind, msg)
        # qwZ inside deepspeed.initialize (zero.Init), qgZ only at the first backward (the quantized reduce)
        assert kind == ("ValueError" if key == "zero_quantized_weights" else "built, then ValueError"), (key, kind)
    for how in ("initialize", "auto"):
        kind, msg = refusals[("mics_shard_size", how)]
        assert kind == "DeepSpeedConfigError" and MICS_REASON in msg and "mics_shard_size" in msg, (how, kind, msg)
