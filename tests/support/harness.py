"""Train a ds_muon ZeRO-3 engine and the single-device oracle on the same data; compare them.

Semantics the oracle encodes (docs/design.md, "One optimizer step"): one optimizer step per ``gradient_accumulation_steps``
micro-batches on the mean gradient over all ranks and micro-batches; ``gradient_clipping`` clips
that raw gradient by its global norm (``torch.nn.utils.clip_grad_norm_``); a trainable parameter
that got no gradient in a step is treated as a zero gradient, as DeepSpeed ZeRO-3 does for every
optimizer.
"""
from __future__ import annotations

from typing import Callable

import torch

from tests.support.models import ParityNet, batch, use_extra

# fp32 Newton–Schulz and an fp32 exchange: the distributed result equals the oracle up to fp32
# rounding (batched vs. single matmuls, reduction order of the gradient reduce-scatter).
PARITY_RTOL = 1e-5

MUON_PARAMS = {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.05, "ns_dtype": "float32",
               "exchange_dtype": "float32"}


def ds_config(gas: int = 1, clip: float = 0.0, micro_batch: int = 2, optimizer: dict | None = None,
              **zero) -> dict:
    """A DeepSpeed config for the parity model: ZeRO-3, fp32, Muon unless ``optimizer`` is given."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": optimizer or {"type": "Muon", "params": dict(MUON_PARAMS)},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


def gathered_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 copies of every parameter (gathers ZeRO-3 partitions)."""
    import deepspeed
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def fp32_master_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 master weights of trainable parameters (what the optimizer steps), gathered via
    ``deepspeed.utils.safe_get_full_fp32_param``; other parameters as gathered. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param
    out = gathered_params(model)
    for n, p in model.named_parameters():
        if p.requires_grad:
            out[n] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
    return out


def build_engine(config: dict, zero_init: bool = False, model_fn: Callable = ParityNet, model_parameters=None,
                 before: Callable | None = None, initialize: Callable | None = None):
    """Seeded model -> ``initialize`` (default ``ds_muon.initialize``; ``deepspeed.initialize`` builds a non-Muon
    config with DeepSpeed alone). Returns ``(engine, model)``."""
    import deepspeed
    import ds_muon
    initialize = initialize or ds_muon.initialize
    torch.manual_seed(0)
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = model_fn()
    else:
        model = model_fn()
    if before is not None:
        before(model)
    params = model_parameters(model) if model_parameters else model.parameters()
    engine, _, _, _ = initialize(model=model, model_parameters=params, config=config)
    return engine, model


def state_snapshot(engine) -> dict:
    """A ZeRO engine's full (gathered, padding-free) fp32 weights and optimizer state per trainable parameter, the
    AdamW step counters (per ZeRO-3 sub-group or ZeRO-1/2 param group) and ``muon_step_count``. Collective (over
    each parameter's partition group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[(name, "fp32")] = safe_get_full_fp32_param(p).clone()
        for key in (("momentum_buffer",) if p.use_muon else ("exp_avg", "exp_avg_sq")):
            out[(name, key)] = safe_get_full_optimizer_state(p, key).clone()
    opt = engine.optimizer
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: every AdamW sub-group's step counter
        flats = {i: opt.fp32_partitioned_groups_flat[i] for i in opt._state_index()}
        steps = {i: opt.optimizer.state[f]["step"] for i, f in flats.items() if "step" in opt.optimizer.state.get(f, {})}
    else:  # ZeRO-1/2: per AdamW param group, the state's counter or the group's
        groups = opt.optimizer.param_groups
        steps = {i: int(opt.optimizer.state.get(f, {}).get("step", groups[i].get("step", 0)))
                 for i, f in enumerate(opt.single_partition_of_fp32_groups) if opt._algorithms[i] == "adamw"}
    return {"tensors": out, "steps": steps, "muon_steps": engine.optimizer.muon_step_count}


def momentum_dtypes(engine) -> list[str]:
    """The dtypes of every Muon momentum buffer this rank's ZeRO optimizer holds (ZeRO-3 sub-groups or ZeRO-1/2
    param groups), sorted: ``["torch.float32"]`` by default, ``["torch.bfloat16"]`` with ``momentum_dtype``."""
    from ds_muon.names import MOMENTUM_KEY
    return sorted({str(s[MOMENTUM_KEY].dtype) for s in engine.optimizer.optimizer.state.values() if MOMENTUM_KEY in s})


def assert_same_state(got: dict, want: dict, where: str) -> None:
    """Two :func:`state_snapshot` results are equal bit for bit (``torch.equal``), naming the first difference."""
    assert got["steps"] == want["steps"] and got["muon_steps"] == want["muon_steps"], where
    assert got["tensors"].keys() == want["tensors"].keys(), where
    for k, x in want["tensors"].items():
        assert torch.equal(got["tensors"][k], x), f"{where} {k}: differs"


def train_steps(engine, rank: int, start: int, stop: int, gas: int, data: Callable = batch, micro_batch: int = 2) -> None:
    """Optimizer steps ``start..stop-1`` of ``gas`` micro-batches each, on the data a continuous run sees at those
    steps (``data(step, rank, micro, micro_batch)``): what a resumed run trains."""
    for step in range(start, stop):
        for micro in range(gas):
            tokens, targets = (t.to(engine.device) for t in data(step, rank, micro, micro_batch))
            engine.backward(engine(tokens, targets, use_extra(step)))
            engine.step()


def resume_phase(engine, rank: int, mode: str, ckpt: str, tag: str, half: int, steps: int, gas: int,
                 snapshot: Callable):
    """One phase of a resume test on ``engine``: ``"continuous"`` (steps ``0..steps-1``; returns ``snapshot``),
    ``"save"`` (steps ``0..half-1``, then ``save_checkpoint(ckpt, tag)``; returns ``snapshot``) or ``"load"``
    (``load_checkpoint(ckpt, tag)``, then steps ``half..steps-1``; returns ``(snapshot after loading, after the
    steps)``)."""
    if mode == "continuous":
        train_steps(engine, rank, 0, steps, gas)
        return snapshot(engine)
    if mode == "save":
        train_steps(engine, rank, 0, half, gas)
        engine.save_checkpoint(ckpt, tag=tag)
        return snapshot(engine)
    engine.load_checkpoint(ckpt, tag=tag)
    loaded = snapshot(engine)
    train_steps(engine, rank, half, steps, gas)
    return loaded, snapshot(engine)


def train_engine(engine, steps: int, rank: int, gas: int, micro_batch: int = 2, start: int = 0) -> list[float]:
    """``steps`` optimizer steps of ``gas`` micro-batches each, on the batches of steps ``start``,
    ``start + 1``, ...; returns the global grad norms."""
    norms = []
    for step in range(start, start + steps):
        for micro in range(gas):
            tokens, targets = (t.to(engine.device) for t in batch(step, rank, micro, micro_batch))
            loss = engine(tokens, targets, use_extra(step))
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return norms


def reference_model(init: dict[str, torch.Tensor], tags: dict[str, bool], model_fn: Callable = ParityNet):
    """A plain model holding ``init`` with the engine's ``use_muon`` tags copied by name, and the
    matrix views (``ds_muon_split``: conv weights, fused and MoE splits) the engine's default
    selection gives; an oracle built from the module (``MuonAdamW(model, **params)``) re-tags them
    with its own config."""
    from ds_muon.model.selection import tag_model
    torch.manual_seed(0)
    model = model_fn()
    for name, p in model.named_parameters():
        p.data.copy_(init[name])
        if name in tags:
            p.use_muon = tags[name]
    tag_model(model, log=False)  # the tags above are explicit and stay; this adds the views
    return model


def train_reference(model, optimizer, steps: int, world_size: int, gas: int, clip: float,
                    micro_batch: int = 2, data: Callable = batch, skip: frozenset = frozenset(),
                    before_step: Callable[[int], None] | None = None,
                    after_step: Callable | None = None, stale_grads: bool = False) -> list[float]:
    """The oracle loop: mean gradient over every rank's micro-batches, raw-norm clip, one step.

    ``data(step, rank, micro, micro_batch) -> (tokens, targets)`` is what each rank trains on
    (default :func:`tests.models.batch`). Steps in ``skip`` are left out entirely (an fp16 overflow
    step: no update, momentum untouched; their norm is reported as nan). ``before_step(step)`` runs
    right before each ``optimizer.step()`` (an lr schedule sets the groups' lrs there);
    ``after_step()`` runs after it, where DeepSpeed steps its lr scheduler. ``stale_grads``: a parameter without
    gradient in a step gets its last gradient again (before clipping; zeros before its first), which is what
    DeepSpeed's ZeRO-3 optimizer alone does (``partition_grads`` only overwrites the gradient partitions of parameters
    that got one; ds_muon zeroes them after each step)."""
    norms = []
    last: dict[torch.nn.Parameter, torch.Tensor] = {}
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        if step in skip:
            norms.append(float("nan"))
            continue
        optimizer.zero_grad(set_to_none=True)
        for rank in range(world_size):
            for micro in range(gas):
                tokens, targets = data(step, rank, micro, micro_batch)
                (model(tokens, targets, use_extra(step)) / (world_size * gas)).backward()
        for p in trainable:
            if p.grad is None:
                p.grad = last[p].clone() if p in last else torch.zeros_like(p)
            if stale_grads:
                last[p] = p.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(trainable, clip if clip > 0 else float("inf"))
        norms.append(float(norm))
        if before_step is not None:
            before_step(step)
        optimizer.step()
        if after_step is not None:
            after_step()
    return norms


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], init: dict[str, torch.Tensor]) -> dict:
    """Per-parameter errors: ``rel`` = ||got-want|| / ||want||, ``rel_update`` = ||got-want|| / ||want-init||."""
    out = {}
    for name, w in want.items():
        diff = (got[name] - w).norm().item()
        out[name] = {"rel": diff / max(w.norm().item(), 1e-30),
                     "rel_update": diff / max((w - init[name]).norm().item(), 1e-30),
                     "moved": (w - init[name]).norm().item()}
    return out


def group_decay(opt) -> dict[str, float]:
    """Each trainable parameter's weight decay as the ZeRO optimizer ``opt`` steps it, by name: that of its param
    group (ZeRO-3: of its sub-group's param group; ZeRO-1/2: of its flat partition's)."""
    if type(opt).__name__ == "MuonZeroOptimizer":
        groups = opt.optimizer.param_groups
        pairs = [(p, groups[opt.sub_group_to_group_id[i]]) for i, params in enumerate(opt.fp16_groups) for p in params]
    else:  # ZeRO-1/2: one flat partition per param group
        pairs = [(p, opt.optimizer.param_groups[i]) for i, params in enumerate(opt.bit16_groups) for p in params]
    return {opt.param_names[p]: group["weight_decay"] for p, group in pairs}


def clone_tags(model) -> dict[str, bool]:
    return {n: bool(getattr(p, "use_muon", False)) for n, p in model.named_parameters()}


def swap_dir_for(path: str) -> str:
    """``path`` for NVMe swap files if its filesystem supports O_DIRECT (DeepSpeed's async_io needs
    it), else a directory under the repository's ``.nvme_tmp/`` (CI machines may mount /tmp as tmpfs,
    which does not). Not created here."""
    import hashlib
    import os

    from ds_muon.integration.probes import _o_direct_problem
    probe = path
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    if _o_direct_problem(probe) is None:
        return path
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(repo, ".nvme_tmp", hashlib.sha1(path.encode()).hexdigest()[:16])


def oracle_schedule(scheduler: dict, init_lrs: list[float], muon_lr: float, steps: int,
                    scaled: bool) -> list[list[float]]:
    """Per optimizer step, the lr of each oracle param group under a DeepSpeed config ``scheduler``
    (``{"type", "params"}``): DeepSpeed's own scheduler class run on a plain SGD holding one group per
    oracle group with the same initial lrs (``init_lrs``). ``scaled``: the scheduler writes one lr
    ``L`` into every group, which ds_muon reads as the Muon lr, so group g gets ``L * init_lrs[g] / muon_lr``."""
    from deepspeed.runtime import lr_schedules
    dummy = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in init_lrs])
    sched = getattr(lr_schedules, scheduler["type"])(dummy, **scheduler.get("params", {}))
    out = []
    for _ in range(steps):
        lrs = [g["lr"] for g in dummy.param_groups]
        out.append([lr * lr0 / muon_lr for lr, lr0 in zip(lrs, init_lrs)] if scaled else lrs)
        sched.step()
    return out


class EventMonitor:
    """A stand-in for DeepSpeed's ``MonitorMaster``: keeps every ``(name, value, step)`` event ds_muon's
    :class:`~ds_muon.integration.monitor.MonitorReporter` writes, in ``events``."""

    def __init__(self) -> None:
        self.events: list = []

    def write_events(self, events) -> None:
        self.events.extend(events)
