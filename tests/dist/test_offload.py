"""Optimizer offload (CPU and NVMe) against the single-device oracle, with the swap cycle counted.

CPU, gloo, W = 2, fp32 (tolerances as in test_zero3_parity: ``PARITY_RTOL`` relative to each
parameter, 1e-3 relative to its update). The model is ``wide_parity_net``: DeepSpeed's NVMe swapper
keeps any tensor under 1 MiB in memory, so with the tiny parity model nothing would be swapped; here
both the Muon and the AdamW sub-group are swapped (asserted).

Per case the probe wraps DeepSpeed's optimizer swapper and counts, per sub-group and step, the
swap-in and swap-out calls and the reads/writes they issue, and records which state tensors the
swapper latched (``momentum_buffer`` is in the swap unless ``save_muon_momentum_buffer_in_memory``).
It also checks the exchange's buffer pool against the plan's bound
(:meth:`ds_muon.sharded.ownership.BucketedPlan.buffer_elements`).
"""
from __future__ import annotations

import collections
import functools
import os

import pytest

from tests.support.spawn import run_distributed
from tests.support.harness import swap_dir_for
from tests.dist.test_zero3_parity import STEPS, check_parity, parity_worker


def _count(counter: collections.Counter, key_fn, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        counter[key_fn(*args, **kwargs)] += 1
        return fn(*args, **kwargs)
    return wrapped


def probe_start(engine) -> None:
    """Wrap the optimizer swapper's entry points and its actual reads/writes, counting per ds_id."""
    opt = engine.optimizer
    opt._probe = collections.Counter()
    swapper = getattr(opt, "optimizer_swapper", None)
    if swapper is None:
        return
    c = opt._probe
    swapper.swap_in_optimizer_state = _count(c, lambda parameter, *a, **k: ("in", parameter.ds_id),
                                             swapper.swap_in_optimizer_state)
    swapper.swap_out_optimizer_state = _count(c, lambda parameter, *a, **k: ("out", parameter.ds_id),
                                              swapper.swap_out_optimizer_state)
    if hasattr(swapper, "_swap_in_parameter"):  # PartitionedOptimizerSwapper
        swapper._swap_in_parameter = _count(c, lambda aio_handle, parameter, *a, **k: ("read", parameter.ds_id),
                                            swapper._swap_in_parameter)
        swapper._swap_out_optimizer_state = _count(c, lambda swap_info: ("write", swap_info.param_id),
                                                   swapper._swap_out_optimizer_state)
    else:  # PipelinedOptimizerSwapper: sync and async reads go through one method
        swapper._swap_in_optimizer_state = _count(c, lambda aio_handle, parameter: ("read", parameter.ds_id),
                                                  swapper._swap_in_optimizer_state)
        swapper._swap_out_optimizer_state = _count(c, lambda aio_handle, parameter, swap_in_op:
                                                   ("write", parameter.ds_id), swapper._swap_out_optimizer_state)


def _unwrapped_handles(swapper) -> list[str]:
    """Attributes of the optimizer swapper and its gradient swapper that hold an async_io handle (found by what
    it does, not by name) not wrapped in ds_muon's _CheckedAioHandle: a handle DeepSpeed added or renamed."""
    from ds_muon.integration.nvme import _CheckedAioHandle
    out = []
    for owner_name, owner in (("swapper", swapper), ("gradient_swapper", swapper.gradient_swapper)):
        for name, value in vars(owner).items():
            if hasattr(value, "async_pwrite") and hasattr(value, "wait") and not isinstance(value, _CheckedAioHandle):
                out.append(f"{owner_name}.{name}")
    return out


def probe_finish(engine) -> dict:
    """Per sub-group: Muon or not, swapped or not, counted swap calls, latched swap tensors; pool bytes."""
    from ds_muon.sharded.exchange import PIPELINE_DEPTH
    opt = engine.optimizer
    swapper = getattr(opt, "optimizer_swapper", None)
    out = {"sub_groups": [], "pool_bytes": opt._pool.peak_nbytes, "pool_left": opt._pool.nbytes(),
           "pool_bound": 0}
    out["unwrapped_handles"] = _unwrapped_handles(swapper) if swapper is not None else []
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        swapped = bool(opt._swappable_optimizer_subgroup(i))
        info = swapper.swap_params_info.get(fp32.ds_id) if swapper is not None else None
        state = opt.optimizer.state.get(fp32, {})
        momentum = state.get("momentum_buffer")
        out["sub_groups"].append(dict(
            muon=i in opt.muon_plans, swapped=swapped,
            calls={kind: opt._probe[(kind, fp32.ds_id)] for kind in ("in", "out", "read", "write")},
            swap_tensors=[t.compute_tensor.ds_id.split("-")[0] for t in info.tensors[1:]] if info is not None else [],
            momentum_in_memory=momentum is not None and momentum.numel() > 0 and not getattr(momentum, "swappable", True)))
        if i in opt.muon_plans:
            exchange = opt.muon_steps[i].exchange
            wire, compute = opt.muon_plans[i].buffer_elements(opt._get_sub_group_partition_rank(i), PIPELINE_DEPTH)
            out["pool_bound"] = max(out["pool_bound"], wire * exchange.exchange_dtype.itemsize
                                    + compute * exchange.compute_dtype.itemsize)
    return out


NVME = {"device": "nvme"}
PIPELINED = {"device": "nvme", "pipeline_read": True, "pipeline_write": True, "buffer_count": 6}  # exactly the need
CASES = [
    dict(name="w2-nvme-gas2-clip", gas=2, clip=0.5, wide=True, zero=dict(offload_optimizer=dict(NVME)),
         probe=(probe_start, probe_finish)),
    dict(name="w2-nvme-pipelined-momentum-in-memory", gas=1, wide=True,
         zero=dict(offload_optimizer=dict(PIPELINED), save_muon_momentum_buffer_in_memory=True),
         probe=(probe_start, probe_finish)),
    # a swapped Muon sub-group of its own that gets no gradient at all in step 0 (and 2): the swapper
    # has no gradient to swap in for it, yet DeepSpeed unscales/clips it and Muon steps it with zeros
    dict(name="w2-nvme-sub-group-without-gradient", gas=1, clip=0.5, late=True, zero=dict(offload_optimizer=dict(NVME)),
         probe=(probe_start, probe_finish)),
    dict(name="w2-cpu-offload-momentum-in-memory-small-buckets", gas=2, clip=0.5, wide=True,
         params=dict(exchange_bucket_mb=0.5),
         zero=dict(offload_optimizer={"device": "cpu"}, save_muon_momentum_buffer_in_memory=True),
         probe=(probe_start, probe_finish)),
]


@pytest.fixture(scope="module")
def offload_results(tmp_path_factory):
    """All CASES in one W=2 process group (swap directories via harness.swap_dir_for)."""
    return run_distributed(parity_worker, 2, CASES, str(tmp_path_factory.mktemp("nvme")))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_offload_matches_oracle(offload_results, case) -> None:
    check_parity(case, [r[CASES.index(case)] for r in offload_results])


@pytest.mark.parametrize("case", [c for c in CASES if c["zero"]["offload_optimizer"]["device"] == "nvme"],
                         ids=lambda c: c["name"])
def test_nvme_one_swap_cycle_per_sub_group_per_step(offload_results, case) -> None:
    in_memory = case["zero"].get("save_muon_momentum_buffer_in_memory", False)
    for rank, res in enumerate(offload_results):
        groups = res[CASES.index(case)]["probe"]["sub_groups"]
        assert any(g["swapped"] and g["muon"] for g in groups), f"rank {rank}: no Muon sub-group was swapped"
        if case.get("late"):
            assert sum(g["swapped"] and g["muon"] for g in groups) == 2, f"rank {rank}: `late` not swapped alone"
        assert any(g["swapped"] and not g["muon"] for g in groups), f"rank {rank}: no AdamW sub-group was swapped"
        # every async_io handle of the swapper is checked (none added or renamed by DeepSpeed went unwrapped)
        assert res[CASES.index(case)]["probe"]["unwrapped_handles"] == [], (rank, res[CASES.index(case)]["probe"])
        for g in groups:
            if not g["swapped"]:
                continue
            # exactly one swap-in and one swap-out per sub-group per optimizer step, and one read/write each
            assert g["calls"] == {"in": STEPS, "out": STEPS, "read": STEPS, "write": STEPS}, (rank, g)
            if g["muon"]:
                assert g["swap_tensors"] == ([] if in_memory else ["momentum_buffer"]), (rank, g)
                assert g["momentum_in_memory"] is in_memory, (rank, g)
            else:
                assert sorted(g["swap_tensors"]) == ["exp_avg", "exp_avg_sq"], (rank, g)


def test_exchange_buffers_within_plan_bound(offload_results) -> None:
    """The exchange's buffers (on the accelerator when there is one; the shard stays in CPU memory
    under offload) never exceed the plan's bound, which stays near ``PIPELINE_DEPTH`` buckets."""
    k = next(i for i, c in enumerate(CASES) if c["zero"]["offload_optimizer"]["device"] == "cpu")
    case = CASES[k]
    for res in offload_results:
        probe = res[k]["probe"]
        assert 0 < probe["pool_bytes"] <= probe["pool_bound"], probe
        assert probe["pool_left"] == 0, "the exchange buffers outlived the optimizer step"
        bucket_bytes = case["params"]["exchange_bucket_mb"] * 2**20
        # wire: 3 slots x (1 + 1/W) buckets; compute: one bucket (fp32 here), plus padding slack
        assert probe["pool_bound"] <= (3 * 1.5 + 1) * bucket_bytes * 1.05, probe


def _build_only(rank: int, world_size: int, offload: dict, nvme_dir: str, in_memory: bool) -> int | str:
    """The engine's swap_buffers_needed(), or the construction error as "Type: message"."""
    from tests.support.harness import build_engine, ds_config
    from tests.support.models import wide_parity_net
    cfg = ds_config(offload_optimizer=dict(offload, nvme_path=nvme_dir), save_muon_momentum_buffer_in_memory=in_memory)
    try:
        engine, _ = build_engine(cfg, model_fn=wide_parity_net)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return engine.optimizer.swap_buffers_needed()


@pytest.mark.parametrize("offload, in_memory, needed", [
    ({"device": "nvme", "buffer_count": 3}, False, 4),
    ({"device": "nvme", "pipeline_read": True, "pipeline_write": True, "buffer_count": 6}, False, 7),
    ({"device": "nvme", "pipeline_read": True, "buffer_count": 5}, True, 6),
], ids=["partitioned", "pipelined", "pipelined-momentum-in-memory"])
def test_swap_buffer_count_too_small_names_the_count(tmp_path, offload, in_memory, needed) -> None:
    """One fewer buffer than needed fails at engine construction (before any swap), on every rank,
    with the key and the count; the counts are the measured minima (one fewer makes DeepSpeed's
    swapper fail with a bare AssertionError in the first step)."""
    swap = swap_dir_for(str(tmp_path / "swap"))
    os.makedirs(swap, exist_ok=True)
    out = run_distributed(_build_only, 2, offload, swap, in_memory)
    for msg in out:
        assert isinstance(msg, str) and "ConfigError" in msg, msg
        assert f"offload_optimizer.buffer_count: {needed - 1} is too small" in msg, msg
        assert f"set buffer_count to at least {needed}" in msg, msg


# ------------------------------------------------------------------------------------------------
# the DeepSpeed names the NVMe checks rely on, pinned against the installed DeepSpeed
# ------------------------------------------------------------------------------------------------
def _self_attributes(cls: type) -> set[str]:
    """Names a class and its bases (DeepSpeed's own) define: methods and class attributes, and every
    ``self.<name> = ...`` in their source (instance attributes)."""
    import ast
    import inspect
    import textwrap
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("deepspeed"):
            continue
        names |= set(vars(klass))
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id == "self"}
    return names


def test_deepspeed_nvme_names_exist() -> None:
    """Every DeepSpeed name ds_muon's NVMe checks use (ds_muon.integration.nvme, ``NVME_*``) exists in the installed DeepSpeed,
    which is in ds_muon's supported range (pyproject.toml's dependency; its test extra pins a version in it): a DeepSpeed upgrade that renames
    one fails here, not silently in a run."""
    import re
    import deepspeed
    from packaging.specifiers import SpecifierSet
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
    from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import PipelinedOptimizerSwapper
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from ds_muon.integration import nvme as zero3

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")) as f:
        pins = re.findall(r'"deepspeed([^"]*)"', f.read())
    # the dependency states the supported range; the test extra pins the one version the suite runs against, in it
    assert len(pins) == 2 and pins[0] == zero3.SUPPORTED_DEEPSPEED and pins[1].startswith("=="), pins
    assert pins[1][2:] in SpecifierSet(zero3.SUPPORTED_DEEPSPEED), pins
    assert deepspeed.__version__ in SpecifierSet(zero3.SUPPORTED_DEEPSPEED), deepspeed.__version__

    for name in zero3.NVME_STAGE3_METHODS:
        assert callable(getattr(DeepSpeedZeroOptimizer_Stage3, name, None)), name
    pinned = {
        DeepSpeedZeroOptimizer_Stage3: zero3.NVME_STAGE3_ATTRS,
        PartitionedOptimizerSwapper: zero3.NVME_SWAPPER_ATTRS,
        PipelinedOptimizerSwapper: zero3.NVME_SWAPPER_ATTRS + zero3.NVME_PIPELINED_SWAPPER_ATTRS,
        AsyncTensorSwapper: zero3.NVME_GRADIENT_SWAPPER_ATTRS,
    }
    for cls, names in pinned.items():
        missing = set(names) - _self_attributes(cls)
        assert not missing, (cls.__name__, missing)
    assert "read_aio_handle" not in _self_attributes(PartitionedOptimizerSwapper)  # the scan tells classes apart
    assert set(zero3.NVME_SWAP_CONFIG_ATTRS) <= set(DeepSpeedZeroOffloadOptimizerConfig.model_fields)
    # torch's FileBaton waits without a deadline on a lock a killed build left: refuse such a lock, naming it
    # (issue 30, item 1), instead of hanging here; a build in progress is waited for
    from ds_muon.integration.probes import _async_io_build_lock_problem
    problem = _async_io_build_lock_problem()
    assert problem is None, problem
    handle = AsyncIOBuilder().load(verbose=False).aio_handle
    assert all(callable(getattr(handle, name, None)) for name in zero3.NVME_AIO_HANDLE_ATTRS), dir(handle)


def _nvme_name_cases(rank: int, world_size: int, nvme_dir: str) -> dict:
    """NVMe-offloaded engines: with ``gradient_swapper`` deleted from the optimizer swapper after its __init__,
    and with a ZeRO-3 method removed from the class (each restored afterwards), the construction error; and a
    pipelined engine's unwrapped async_io handles."""
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from tests.support.harness import build_engine, ds_config
    from tests.support.models import wide_parity_net
    nvme = {"device": "nvme", "nvme_path": nvme_dir}
    out = {}
    real_init, real_release = PartitionedOptimizerSwapper.__init__, DeepSpeedZeroOptimizer_Stage3._release_swap_buffers

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        del self.gradient_swapper
    for hide in ("gradient_swapper", "_release_swap_buffers"):
        if hide == "gradient_swapper":
            PartitionedOptimizerSwapper.__init__ = init
        else:
            del DeepSpeedZeroOptimizer_Stage3._release_swap_buffers
        try:
            build_engine(ds_config(offload_optimizer=nvme), model_fn=wide_parity_net)
            out[hide] = None
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            out[hide] = f"{type(err).__name__}: {err}"
        finally:
            PartitionedOptimizerSwapper.__init__ = real_init
            DeepSpeedZeroOptimizer_Stage3._release_swap_buffers = real_release
    engine, _ = build_engine(ds_config(offload_optimizer=dict(PIPELINED, nvme_path=nvme_dir, buffer_count=8)),
                             model_fn=wide_parity_net)
    out["pipelined_unwrapped"] = _unwrapped_handles(engine.optimizer.optimizer_swapper)
    engine.destroy()
    return out


def test_missing_deepspeed_name_is_named_with_supported_range(tmp_path) -> None:
    """A DeepSpeed that lacks a name the NVMe checks use (a swapper attribute, a ZeRO-3 method) fails at
    initialize with a DeepSpeedVersionError naming the attribute, its owner and the supported DeepSpeed
    range; the pipelined swapper's read and write handles are wrapped too (W=1)."""
    from ds_muon.integration.zero3 import SUPPORTED_DEEPSPEED
    swap = swap_dir_for(str(tmp_path / "swap"))
    os.makedirs(swap, exist_ok=True)
    (out,) = run_distributed(_nvme_name_cases, 1, swap)
    for hide, owner in (("gradient_swapper", "optimizer swapper (PartitionedOptimizerSwapper)"),
                        ("_release_swap_buffers", "ZeRO-3 optimizer class (DeepSpeedZeroOptimizer_Stage3)")):
        msg = out[hide]
        assert msg and msg.startswith("DeepSpeedVersionError"), msg
        assert f"{owner} has no {hide}" in msg and f"deepspeed{SUPPORTED_DEEPSPEED}" in msg, msg
    assert out["pipelined_unwrapped"] == [], out
