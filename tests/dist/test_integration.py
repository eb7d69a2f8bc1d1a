"""``ds_muon.initialize`` / ``enable()``: routing, pass-through, bad input, and the built-in staying off."""
from __future__ import annotations

import pytest

from tests.support.spawn import run_distributed
from tests.support.harness import ds_config


def test_import_patches_nothing_and_enable_disable_restore() -> None:
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    originals = (deepspeed.set_optimizer_flags, DeepSpeedEngine._configure_basic_optimizer,
                 DeepSpeedEngine._configure_zero_optimizer)
    import ds_muon
    from ds_muon.integration import hooks as integ
    assert (deepspeed.set_optimizer_flags, DeepSpeedEngine._configure_basic_optimizer,
            DeepSpeedEngine._configure_zero_optimizer) == originals
    ds_muon.enable()
    ds_muon.enable()  # nests
    assert integ.is_enabled() and deepspeed.set_optimizer_flags is integ._set_optimizer_flags
    ds_muon.disable()
    assert integ.is_enabled()
    ds_muon.disable()
    assert not integ.is_enabled()
    assert (deepspeed.set_optimizer_flags, DeepSpeedEngine._configure_basic_optimizer,
            DeepSpeedEngine._configure_zero_optimizer) == originals
    with ds_muon.enable_scope():
        assert DeepSpeedEngine._configure_zero_optimizer is integ._configure_zero_optimizer
    assert DeepSpeedEngine._configure_zero_optimizer is originals[2]


@pytest.mark.parametrize("stage", [0, None])
def test_stage_0_is_refused_before_the_engine(stage, monkeypatch) -> None:
    import ds_muon
    from deepspeed.runtime.engine import DeepSpeedEngine

    def no_engine(*a, **k):  # pragma: no cover - reached only if validation failed to run first
        raise AssertionError("the engine was constructed before the config was validated")

    monkeypatch.setattr(DeepSpeedEngine, "__init__", no_engine)
    cfg = ds_config()
    cfg["zero_optimization"] = {"stage": stage} if stage is not None else {}
    with pytest.raises(ds_muon.ConfigError, match=r"zero_optimization\.stage.*ZeRO stages 1, 2 and 3"):
        ds_muon.initialize(model=object(), config=cfg)


def test_typo_is_refused_before_the_engine(monkeypatch) -> None:
    import ds_muon
    from deepspeed.runtime.engine import DeepSpeedEngine
    monkeypatch.setattr(DeepSpeedEngine, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    cfg = ds_config()
    cfg["optimizer"]["params"]["momentun"] = 0.9
    with pytest.raises(ds_muon.ConfigError, match=r"optimizer\.params\.momentun.*did you mean 'momentum'"):
        ds_muon.initialize(model=object(), config=cfg)


def _train(engine, steps: int = 2) -> None:
    import torch.distributed as dist
    from tests.support.models import batch
    for step in range(steps):
        tokens, targets = batch(step, dist.get_rank(), 0)
        engine.backward(engine(tokens, targets, True))
        engine.step()


class _OneWayModelParallel:
    """The smallest Megatron-style mpu: tensor/model-parallel size 1, data parallel over the world.
    Built on every rank (``new_subgroups`` is collective)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self._mp_group, _ = dist.new_subgroups(group_size=1)

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return self._mp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_group(self):
        import torch.distributed as dist
        return dist.group.WORLD

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank()

    def get_data_parallel_world_size(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size()

    def get_data_parallel_group_ranks(self) -> list[int]:
        import torch.distributed as dist
        return list(range(dist.get_world_size()))


def integration_worker(rank: int, world_size: int) -> dict:
    import deepspeed
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    import ds_muon
    from ds_muon.integration.zero3 import MuonZeroOptimizer
    from ds_muon.integration.inner import ZeroMuonInner
    from tests.support.harness import build_engine
    from tests.support.models import ParityNet

    out = {}
    # DeepSpeed's built-in ZeRO-3 Muon must never run alongside ours: make it explode if touched.
    import deepspeed.runtime.zero.muon.original_muon as original_muon
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    def boom(*a, **k):
        raise AssertionError("DeepSpeed's built-in Muon ran")

    saved = (original_muon.muon_update, MuonWithAuxAdam.step, DeepSpeedZeroOptimizer_Stage3._apply_muon_updates_cpu_offload)
    original_muon.muon_update, MuonWithAuxAdam.step = boom, boom
    DeepSpeedZeroOptimizer_Stage3._apply_muon_updates_cpu_offload = boom
    try:
        engine, _ = build_engine(ds_config())
        _train(engine)
    finally:
        original_muon.muon_update, MuonWithAuxAdam.step = saved[0], saved[1]
        DeepSpeedZeroOptimizer_Stage3._apply_muon_updates_cpu_offload = saved[2]
    original_muon.muon_update, MuonWithAuxAdam.step = boom, boom
    out["initialize_type"] = type(engine.optimizer).__name__
    out["inner_type"] = type(engine.optimizer.optimizer).__name__
    out["inner_adamw"] = type(engine.optimizer.optimizer.adamw).__name__
    out["use_muon_builtin"] = engine.optimizer.use_muon
    out["steps"] = engine.optimizer.muon_step_count
    out["enabled_after"] = ds_muon.integration.is_enabled()
    engine.destroy()

    # per-step Muon figures reach DeepSpeed's own monitor (csv_monitor here)
    import tempfile
    csv_dir = tempfile.mkdtemp()
    from tests.support.comm_counter import counting
    cfg = ds_config()
    cfg["optimizer"]["params"]["exchange_dtype"] = "bfloat16"  # 2 bytes an element on the wire
    cfg["csv_monitor"] = {"enabled": True, "output_path": csv_dir, "job_name": "ds_muon_test"}
    engine, _ = build_engine(cfg)
    _train(engine, 1)
    with counting() as records:  # the second step's all_to_all bytes, counted on the wire
        _train(engine, 1)
    out["a2a_bytes"] = sum(b for op, _, b in records if op == "all_to_all_single")
    out["exchange_bytes"] = engine.optimizer.exchange_bytes()
    engine.destroy()
    if rank == 0:
        import csv
        import glob
        out["csv"] = {}
        for path in glob.glob(f"{csv_dir}/ds_muon_test/Train_ds_muon_*.csv"):
            with open(path) as f:
                out["csv"][path.rsplit("/", 1)[-1]] = [row for row in csv.reader(f)]

    # enable() for frameworks that call deepspeed.initialize themselves
    ds_muon.enable()
    try:
        torch.manual_seed(0)
        model = ParityNet()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
        _train(engine)
        out["enable_type"] = type(engine.optimizer).__name__
        out["enable_steps"] = engine.optimizer.muon_step_count
        engine.destroy()
        # non-Muon configs pass through untouched, even while enabled
        model = ParityNet()
        cfg = ds_config(optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["adamw_type"] = type(engine.optimizer) is DeepSpeedZeroOptimizer_Stage3
        out["adamw_inner"] = type(engine.optimizer.optimizer).__name__
        engine.destroy()
        # stage 0 through the enable() path is refused with the same message
        cfg = ds_config()
        cfg["zero_optimization"] = {"stage": 0}
        try:
            deepspeed.initialize(model=ParityNet(), model_parameters=ParityNet().parameters(), config=cfg)
            out["stage2"] = "no error"
        except ds_muon.ConfigError as exc:
            out["stage2"] = str(exc)
    finally:
        ds_muon.disable()
        original_muon.muon_update, MuonWithAuxAdam.step = saved[0], saved[1]
    out["isinstance_checks"] = (issubclass(MuonZeroOptimizer, DeepSpeedZeroOptimizer_Stage3),
                                not issubclass(ZeroMuonInner, MuonWithAuxAdam))

    # an mpu of tensor-parallel size 1 is served (a tensor-parallel one is refused: test_sequence_parallel.py)
    try:
        model = ParityNet()
        ds_muon.initialize(model=model, model_parameters=model.parameters(), config=ds_config(),
                           mpu=_OneWayModelParallel())
        out["mpu"] = "no error"
    except ds_muon.ConfigError as exc:
        out["mpu"] = str(exc)

    # after disable(), DeepSpeed is itself again: the same config builds the built-in Muon
    torch.manual_seed(0)
    model = ParityNet(conv=False)
    cfg = ds_config(reduce_scatter=False, optimizer={"type": "Muon", "params": {"lr": 0.02}})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out["after_disable_type"] = type(engine.optimizer).__name__
    out["after_disable_builtin"] = engine.optimizer.use_muon
    engine.destroy()
    return out


def _install_counter() -> None:
    from tests.support.comm_counter import install
    install()


integration_worker.before_init = _install_counter  # wrap torch.distributed before DeepSpeed binds it


def test_integration_paths() -> None:
    res = run_distributed(integration_worker, 2)[0]
    assert res["initialize_type"] == "MuonZeroOptimizer"
    assert res["inner_type"] == "ZeroMuonInner"
    assert res["use_muon_builtin"] is False
    assert res["inner_adamw"] == "FusedAdam"  # AdamW sub-groups: DeepSpeed's element-wise fused optimizer
    assert res["steps"] == 2
    assert res["enabled_after"] is False  # initialize() leaves DeepSpeed as it found it
    assert res["enable_type"] == "MuonZeroOptimizer" and res["enable_steps"] == 2
    assert res["adamw_type"] is True and res["adamw_inner"] == "FusedAdam"
    assert "ZeRO stages 1, 2 and 3" in res["stage2"] and "zero_optimization.stage: 0" in res["stage2"]
    assert res["isinstance_checks"] == (True, True)
    assert res["exchange_bytes"] == res["a2a_bytes"] > 0  # the reported figure is what went on the wire
    csvs = res["csv"]
    assert set(csvs) == {"Train_ds_muon_muon_seconds.csv", "Train_ds_muon_exchange_bytes.csv",
                         "Train_ds_muon_owner_imbalance.csv", "Train_ds_muon_muon_lr.csv",
                         "Train_ds_muon_adam_lr.csv"}, csvs
    assert [float(r[1]) for r in csvs["Train_ds_muon_adam_lr.csv"][1:]] == [3e-3] * 2  # harness.MUON_PARAMS
    assert [float(r[1]) for r in csvs["Train_ds_muon_muon_lr.csv"][1:]] == [0.02] * 2
    for rows in csvs.values():
        assert len(rows) == 1 + 2  # header + one row per optimizer step
    assert all(float(r[1]) > 0 for r in csvs["Train_ds_muon_muon_seconds.csv"][1:])
    # x axis = DeepSpeed's sample count after each step (micro-batch 2 x 2 ranks), like its own events
    assert [int(float(r[0])) for r in csvs["Train_ds_muon_muon_seconds.csv"][1:]] == [4, 8]
    assert [float(r[1]) for r in csvs["Train_ds_muon_exchange_bytes.csv"][1:]] == [res["exchange_bytes"]] * 2
    assert res["after_disable_type"] == "DeepSpeedZeroOptimizer_Stage3" and res["after_disable_builtin"] is True
    # an mpu of tensor/pipeline-parallel size 1 is served now (sequence parallelism: tests/dist/test_sequence_parallel.py)
    assert res["mpu"] == "no error", res["mpu"]


def _moe_worker(rank: int, world_size: int) -> str:
    """ds_muon.initialize on a model with a DeepSpeed MoE layer; returns the error text."""
    import torch
    from deepspeed.moe.layer import MoE

    import ds_muon
    from tests.support.harness import ds_config

    class TinyMoE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)
            self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)

        def forward(self, x):
            return self.moe(self.inp(x))[0].sum()

    torch.manual_seed(0)
    model = TinyMoE()
    try:
        ds_muon.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    except ds_muon.ConfigError as exc:
        return str(exc)
    return "no error"


def test_deepspeed_moe_layers_are_refused() -> None:
    """DeepSpeed MoE layers (``deepspeed.moe.layer.MoE``) are refused today with a clear error that
    names the alternative (stacked expert weights). If MoE layers become supported, replace this test."""
    msg = run_distributed(_moe_worker, 1, timeout=300)[0]
    assert "native MoE layers" in msg and "does not support with ZeRO stage 3" in msg and "stacked expert weights" in msg, msg


def _rank_dependent_graph_worker(rank: int, world_size: int) -> None:
    """Rank 1 runs ``extra`` but detaches its output on step 1: ``extra`` gets a gradient on rank 0 only."""
    from tests.support.harness import build_engine, ds_config
    from tests.support.models import batch
    engine, model = build_engine(ds_config())
    run_extra = model.extra.forward
    for step in range(2):
        detach = rank == 1 and step == 1
        model.extra.forward = (lambda x: run_extra(x).detach()) if detach else run_extra
        tokens, targets = batch(step, rank, 0)
        engine.backward(engine(tokens, targets, True))
        engine.step()


def test_rank_dependent_gradients_fail_fast_in_deepspeed_not_in_the_exchange(monkeypatch) -> None:
    """ZeRO-3 needs the same set of gradients on every rank in each backward: DeepSpeed's own gradient
    reduce-scatter in ``engine.backward`` then sees different sizes. That is DeepSpeed's limit, not
    ds_muon's: it fails there, before the optimizer step, with the collective named, and nothing hangs
    (the spawn has a deadline). Parameters without a gradient on some ranks that DeepSpeed does
    support (a rank holding only padding) are covered by test_zero3_parity's W=4 offload case; a
    parameter without a gradient on every rank in some steps by every parity case (``extra``)."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # read when the spawned ranks import torch
    with pytest.raises(RuntimeError) as info:
        run_distributed(_rank_dependent_graph_worker, 2, timeout=180)
    report = str(info.value)
    assert "Detected mismatch between collectives" in report and "REDUCE_SCATTER" in report, report[-3000:]
    assert "in backward" in report, report[-3000:]
    assert "ds_muon/exchange.py" not in report and "_muon_sub_group_step" not in report, report[-3000:]


@pytest.mark.parametrize("depth, notice", [(1, True), (2, False)])
def test_auto_activation_notice_only_when_the_hook_alone_enabled_ds_muon(depth: int, notice: bool, monkeypatch) -> None:
    """The start-up hook's "activated automatically" line is logged only when nothing but the hook enabled
    ds_muon (depth 1); a script that calls ds_muon.initialize / enable() itself (depth 2) chose ds_muon."""
    import types

    import torch
    from ds_muon.integration import hooks as integration
    warnings: list[str] = []
    monkeypatch.setattr(integration._PATCHES, "auto", True)
    monkeypatch.setattr(integration._PATCHES, "depth", depth)
    monkeypatch.setattr(integration._PATCHES, "auto_notice_done", False)
    monkeypatch.setattr(integration, "_is_rank0", lambda: True)
    monkeypatch.setattr(integration, "log_info", lambda message: None)
    monkeypatch.setattr(integration.ds_logger, "warning", lambda message, *a, **k: warnings.append(str(message)))
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    integration._set_optimizer_flags(types.SimpleNamespace(_param_dict=ds_config()), model)
    assert (integration.AUTO_NOTICE in warnings) is notice, warnings
