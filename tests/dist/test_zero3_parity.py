"""ds_muon ZeRO-3 vs. the single-device oracle ``ds_muon.MuonAdamW``, parameter by parameter.

CPU, gloo, fp32 (Newton–Schulz and exchange in fp32). Tolerance: ``harness.PARITY_RTOL`` = 1e-5
relative to each parameter's norm, and 1e-3 relative to how far the parameter moved (the bf16
case states its own, looser tolerances).
Each world size spawns one process group and runs several configurations in it.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.precision import FP16_SKIP, fp16_supported
from tests.support.spawn import run_distributed
from tests.support.models import ParityNet, late_groups, late_parity_net, wide_parity_net
from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, fp32_master_params,
                           gathered_params, momentum_dtypes, reference_model, swap_dir_for, train_engine,
                           train_reference)

STEPS = 3


def _wd_groups(model):
    """Per-group weight decay: matrices and embeddings decay at 0.1, 1-D parameters not at all."""
    from ds_muon.model.structure import param_shape
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if len(param_shape(p)) >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if len(param_shape(p)) < 2], "weight_decay": 0.0}]


def _untag_o(model):
    model.o.weight.use_muon = False  # a user's explicit AdamW choice for a 2-D weight


_GRAM_CALLS: list = []


def _spy_gram_start(engine) -> None:
    """Count the calls of the Gram kernel (``orthogonalize`` looks it up in its module at each call)."""
    import ds_muon.core.newton_schulz as ns
    real = ns.gram_newton_schulz
    _GRAM_CALLS[:] = [real, 0]

    def counted(*args, **kwargs):
        _GRAM_CALLS[1] += 1
        return real(*args, **kwargs)

    ns.gram_newton_schulz = counted


def _spy_gram_finish(engine) -> dict:
    import ds_muon.core.newton_schulz as ns
    ns.gram_newton_schulz = _GRAM_CALLS[0]
    return {"gram_calls": _GRAM_CALLS[1]}


_SYM_CALLS: list = []


def _spy_sym_start(engine) -> None:
    """Count the matrices of every ``symmetric_product`` call by ``(rows, cols, block rows)`` (the ``sym2`` form's
    two products; ``_quintic_iterations`` looks it up in its module at each call)."""
    import collections

    import ds_muon.core.newton_schulz as ns
    real = ns.symmetric_product
    _SYM_CALLS[:] = [real, collections.Counter()]

    def recorded(L, R, blocks):
        _SYM_CALLS[1][(int(L.shape[-2]), int(L.shape[-1]), blocks)] += int(L.shape[0]) if L.dim() == 3 else 1
        return real(L, R, blocks)

    ns.symmetric_product = recorded


def _spy_sym_finish(engine) -> list:
    """Restore ``symmetric_product``; the counts as ``[(rows, cols, blocks, matrices), ...]``."""
    import ds_muon.core.newton_schulz as ns
    ns.symmetric_product = _SYM_CALLS[0]
    return sorted((*k, n) for k, n in _SYM_CALLS[1].items())


def _run_case(rank: int, world_size: int, case: dict, nvme_dir: str = "") -> dict | None:
    """One case on this rank; ``sym2_min_rows`` lowers the ``auto`` form's threshold for the whole case (engine and
    oracle), so that the small model's matrices run both quintic forms."""
    from ds_muon.core import ns_cost
    saved = ns_cost.SYM2_MIN_ROWS
    ns_cost.SYM2_MIN_ROWS = case.get("sym2_min_rows", saved)
    try:
        return _run_case_body(rank, world_size, case, nvme_dir)
    finally:
        ns_cost.SYM2_MIN_ROWS = saved


def _run_case_body(rank: int, world_size: int, case: dict, nvme_dir: str = "") -> dict | None:
    """:func:`_run_case`'s work: the ZeRO-3 run on every rank, the oracle and its alternatives on rank 0."""
    import ds_muon
    from ds_muon.integration.zero3 import MuonZeroOptimizer

    cfg = ds_config(gas=case.get("gas", 1), clip=case.get("clip", 0.0), **case.get("zero", {}))
    cfg["optimizer"]["params"].update(case.get("params", {}))
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if case.get("scheduler"):
        cfg["scheduler"] = case["scheduler"]
    groups_fn = _wd_groups if case.get("groups") else (late_groups if case.get("late") else None)
    model_fn = late_parity_net if case.get("late") else (wide_parity_net if case.get("wide") else ParityNet)
    zero = cfg["zero_optimization"]
    if zero.get("offload_optimizer", {}).get("device") == "nvme":  # a fresh swap folder per case
        zero["offload_optimizer"]["nvme_path"] = swap_dir_for(os.path.join(nvme_dir, case["name"]))
        os.makedirs(zero["offload_optimizer"]["nvme_path"], exist_ok=True)
    engine, model = build_engine(cfg, zero_init=case.get("zero_init", False), model_parameters=groups_fn,
                                 before=_untag_o if case.get("untag_o") else None, model_fn=model_fn)
    assert type(engine.optimizer) is MuonZeroOptimizer, type(engine.optimizer)
    assert engine.optimizer.use_muon is False  # DeepSpeed's built-in ZeRO-3 Muon path is off
    init = gathered_params(model)
    tags = clone_tags(model)
    padding = _partition_padding(engine.optimizer, rank)
    probe_start, probe_finish = case.get("probe", (None, None))
    if probe_start:
        probe_start(engine)
    norms = train_engine(engine, STEPS, rank, case.get("gas", 1))
    probe = probe_finish(engine) if probe_finish else None
    got = fp32_master_params(model) if case.get("bf16") else gathered_params(model)
    result = {"steps": engine.optimizer.muon_step_count,
              "n_buckets": sum(len(p.buckets) for p in engine.optimizer.muon_plans.values()), "norms": norms, "tags": tags,
              "n_sub_groups": len(engine.optimizer.fp16_groups), "n_muon_sub_groups": len(engine.optimizer.muon_plans),
              "probe": probe, "padding": padding}
    engine.destroy()
    if rank != 0:
        return result

    ref = reference_model(init, tags, model_fn)
    params = groups_fn(ref) if groups_fn else ref.parameters()
    opt = ds_muon.MuonAdamW(params, **cfg["optimizer"]["params"])
    result["ref_norms"] = train_reference(ref, opt, STEPS, world_size, case.get("gas", 1), case.get("clip", 0.0),
                                          after_step=_oracle_scheduler(opt, case))
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    result["errors"] = compare(got, want, init)

    # The same run with every parameter on AdamW, and with plain SGD+momentum: a silent fallback to
    # either would land near one of these, far outside the parity tolerance.
    alt = {}
    if case.get("scheduler"):  # the lr schedule ignored: constant lr
        m = reference_model(init, tags, model_fn)
        train_reference(m, ds_muon.MuonAdamW(m.parameters(), **cfg["optimizer"]["params"]), STEPS, world_size,
                        case.get("gas", 1), case.get("clip", 0.0))
        alt["no_scheduler"] = compare(got, {n: p.detach() for n, p in m.named_parameters()}, init)
    for label in ("adamw", "sgd"):
        m = reference_model(init, {n: False for n in tags}, model_fn)
        if label == "adamw":
            o = ds_muon.MuonAdamW(m.parameters(), **cfg["optimizer"]["params"])
        else:
            o = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.02, momentum=0.9)
        train_reference(m, o, STEPS, world_size, case.get("gas", 1), case.get("clip", 0.0))
        alt[label] = compare(got, {n: p.detach() for n, p in m.named_parameters()}, init)
    # The oracle with one Newton-Schulz setting changed back (``alt_params``): a ZeRO-3 path that
    # ignored the setting would land there instead.
    for k, override in enumerate(case.get("alt_params", ())):
        m = reference_model(init, tags, model_fn)
        o = ds_muon.MuonAdamW(groups_fn(m) if groups_fn else m.parameters(), **{**cfg["optimizer"]["params"], **override})
        train_reference(m, o, STEPS, world_size, case.get("gas", 1), case.get("clip", 0.0))
        alt[f"setting{k}"] = compare(got, {n: p.detach() for n, p in m.named_parameters()}, init)
    result["alt"] = alt
    return result


def _partition_padding(opt, rank: int) -> list[float]:
    """The values in every parameter's partition padding after initialize (its ``ds_tensor`` and the fp32
    master partition past the parameter's last element; resident sub-groups): DeepSpeed leaves them as the
    memory was (``torch.empty``), ds_muon zeroes them (``MuonZeroOptimizer._create_fp32_partitions``)."""
    values = []
    for i, group in enumerate(opt.fp16_groups):
        fp32 = None if opt._swappable_optimizer_subgroup(i) else opt.fp32_partitioned_groups_flat[i]
        offset = 0
        for p in group:
            numel = p.partition_numel()
            real = max(0, min(p.ds_numel - rank * numel, numel))
            values += p.ds_tensor.data[real:].float().tolist()
            if fp32 is not None:
                values += fp32[offset + real:offset + numel].tolist()
            offset += numel
    return values


def _oracle_scheduler(optimizer, case: dict):
    """The case's DeepSpeed lr scheduler built on the oracle's optimizer; returns its ``step``."""
    if not case.get("scheduler"):
        return None
    from deepspeed.runtime import lr_schedules
    sched = getattr(lr_schedules, case["scheduler"]["type"])(optimizer, **case["scheduler"]["params"])
    return sched.step


def _exchange_dtypes(engine) -> list[str]:
    """Probe: the wire dtype of every Muon sub-group's exchange."""
    return sorted({str(ex.exchange_dtype) for ex in (s.exchange for s in engine.optimizer.muon_steps.values())})


def _lrs(engine) -> list[float]:
    """Probe: every inner param group's lr after the run (Muon and AdamW groups)."""
    return sorted({g["lr"] for g in engine.optimizer.optimizer.param_groups})


def _grad_views_start(engine) -> None:
    """Record, at each sub-group's ``_optimizer_step``, whether its fp32 partition's ``.grad`` is a view of
    DeepSpeed's ``grad_partitions_flat_buffer``, and count the calls of DeepSpeed's own
    ``_prepare_fp32_grad_for_sub_group`` (its concatenated copy, which ``MuonZeroOptimizer`` replaces) and
    ``unscale_and_clip_grads`` (a pass over the gradient, which ds_muon skips where its factor is 1)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    opt = engine.optimizer
    real_step, seen, calls = opt._optimizer_step, [], {"prepare": 0, "unscale": 0}
    saved = {"prepare": Stage3._prepare_fp32_grad_for_sub_group, "unscale": Stage3.unscale_and_clip_grads}

    def recorded(i):
        grad, buffer = opt.fp32_partitioned_groups_flat[i].grad, opt.grad_partitions_flat_buffer
        seen.append(grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr())
        return real_step(i)

    def counted(key):
        def call(self, *args):
            calls[key] += 1
            return saved[key](self, *args)
        return call

    opt._optimizer_step = recorded
    Stage3._prepare_fp32_grad_for_sub_group, Stage3.unscale_and_clip_grads = counted("prepare"), counted("unscale")
    opt._probe_grad_views = (seen, calls, saved)


def _grad_views_finish(engine) -> list:
    """``[every sub-group step read a view of the buffer, DeepSpeed's concatenated copy never made, sub-group steps
    > sub-groups, DeepSpeed's unscale_and_clip_grads called]``."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    seen, calls, saved = engine.optimizer._probe_grad_views
    Stage3._prepare_fp32_grad_for_sub_group, Stage3.unscale_and_clip_grads = saved["prepare"], saved["unscale"]
    return [all(seen), calls["prepare"] == 0, len(seen) > len(engine.optimizer.fp16_groups), calls["unscale"] > 0]


FP16_STEPS, FP16_POISONED = 4, 2


def _fp16_overflow_case(rank: int, world_size: int, case: dict, nvme_dir: str = "") -> dict | None:
    """fp16 model with dynamic loss scaling; step ``FP16_POISONED``'s loss is multiplied by NaN, so its
    gradients overflow. DeepSpeed must skip that step: no update, Muon momentum and fp32 weights
    bit-identical across it, ``muon_step_count`` not advanced. The run is then compared with the fp32
    oracle that leaves the same step out."""
    import ds_muon
    from tests.support.harness import fp32_master_params
    from tests.support.models import batch, use_extra
    cfg = ds_config(gas=1, clip=case.get("clip", 0.0), stage=case.get("stage", 3))
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, model = build_engine(cfg)
    init, tags = gathered_params(model), clone_tags(model)
    opt = engine.optimizer
    flats = getattr(opt, "fp32_partitioned_groups_flat", None) or opt.single_partition_of_fp32_groups  # ZeRO-3, 1/2
    out: dict = {"skipped": [], "scales": []}
    for step in range(FP16_STEPS):
        if step == FP16_POISONED:
            momentum = {i: opt.optimizer.state[flats[i]]["momentum_buffer"].clone() for i in opt.muon_plans}
            weights = [t.clone() for t in flats]
            muon_steps = opt.muon_step_count
        tokens, targets = batch(step, rank, 0)
        loss = engine(tokens, targets, use_extra(step))
        assert loss.dtype == torch.float16, loss.dtype
        if step == FP16_POISONED:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        out["skipped"].append(bool(opt.overflow))
        out["scales"].append(float(opt.loss_scale))
        if step == FP16_POISONED:
            out["same_momentum"] = all(torch.equal(momentum[i], opt.optimizer.state[flats[i]]["momentum_buffer"])
                                       for i in opt.muon_plans)
            out["same_weights"] = all(torch.equal(a, b) for a, b in zip(weights, flats))
            # for the message if not: (sub-group, Muon?, elements changed, of, max |change|)
            out["changed"] = [(i, i in opt.muon_plans, int((a != b).sum()), a.numel(), float((a - b).abs().max()))
                              for i, (a, b) in enumerate(zip(weights, flats))
                              if not torch.equal(a, b)]
            out["muon_steps_across"] = (muon_steps, opt.muon_step_count)
    out["steps"] = opt.muon_step_count
    out["named"] = opt.last_non_finite_param
    got = fp32_master_params(model)
    engine.destroy()
    if rank != 0:
        return out
    ref = reference_model(init, tags)
    ref_opt = ds_muon.MuonAdamW(ref.parameters(), **cfg["optimizer"]["params"])
    train_reference(ref, ref_opt, FP16_STEPS, world_size, 1, case.get("clip", 0.0), skip=frozenset({FP16_POISONED}))
    out["errors"] = compare(got, {n: p.detach().clone() for n, p in ref.named_parameters()}, init)
    out["tags"] = tags
    return out


def parity_worker(rank: int, world_size: int, cases: list[dict], nvme_dir: str = "") -> list[dict | None]:
    return [(_fp16_overflow_case if case.get("fp16_overflow") else _run_case)(rank, world_size, case, nvme_dir)
            for case in cases]


CASES = {
    1: [dict(name="w1-clip", gas=1, clip=0.5)],
    # every sub-group's step reads its gradient in place, in the buffer DeepSpeed reduced it into (no copy)
    2: [dict(name="w2-plain", gas=1, probe=(_grad_views_start, _grad_views_finish),
             want_probe=[True, True, True, False]),  # clipping off: DeepSpeed's multiply by 1 skipped
        dict(name="w2-gas4-clip-allreduce", gas=4, clip=0.5,
             zero=dict(reduce_scatter=False, contiguous_gradients=False, overlap_comm=True)),
        dict(name="w2-zeroinit-groups-untag-small-buckets", gas=1, zero_init=True, groups=True, untag_o=True,
             zero=dict(reduce_bucket_size=100, sub_group_size=500)),
        dict(name="w2-cpu-offload-gas2-clip", gas=2, clip=0.5, zero=dict(offload_optimizer={"device": "cpu"})),
        # bf16 momentum storage on both sides (the oracle rounds the same way), fp32 everything else
        dict(name="w2-bf16-momentum-gas2-clip", gas=2, clip=0.5, params=dict(momentum_dtype="bfloat16"),
             probe=(None, momentum_dtypes), want_probe=["torch.bfloat16"]),
        # bf16 model (fp32 master weights and optimizer) against the fp32 oracle: forward/backward
        # in bf16 differ from fp32 by bf16 rounding (unit roundoff 2^-9), hence the looser, stated
        # tolerances for every parameter, Muon or AdamW: 1e-2 of the parameter, 5e-2 of its update
        # (measured: 2.2e-3 and 3.2e-2, embed.weight). Two AdamW parameters whose gradients are at bf16
        # noise level are held only to 0.5 of their update (Adam normalizes that noise into full-size
        # steps): norm1.bias (zero-initialised; measured 0.22) and v.bias (its gradient goes through
        # k(h) * silu'(v(h)); measured 0.35).
        dict(name="w2-bf16-gas2-clip", gas=2, clip=0.5, bf16=True, rtol=1e-2, rtol_update=5e-2, rtol_norm=5e-3,
             loose_update={"norm1.bias": 0.5, "v.bias": 0.5}, probe=(_grad_views_start, _grad_views_finish),
             want_probe=[False, True, True, True]),  # bf16 accumulation: converted once to fp32, not concatenated
        # fp32 model, bf16 on the wire (u in, the scaled update out): each crossing rounds to 2^-9
        # relative; stated tolerance 5e-3 of the parameter, 5e-2 of its update, 1e-4 of the later
        # steps' grad norms (measured 1.4e-3 and 1.8e-2, down.weight; 2.2e-5)
        dict(name="w2-bf16-exchange", gas=1, clip=0.5, params=dict(exchange_dtype="bfloat16"),
             probe=(None, _exchange_dtypes), want_probe=["torch.bfloat16"], rtol=5e-3, rtol_update=5e-2, rtol_norm=1e-4),
        # a DeepSpeed scheduler in a training run; Muon's and AdamW's lrs are equal (0.02), so it may
        # write one absolute lr into every group. Linear warmup: the steps use 0.005, 0.005, 0.01 and
        # every group ends at 0.015; the oracle steps the same scheduler class.
        dict(name="w2-warmup-lr-scheduler", gas=1, params=dict(adam_lr=0.02), probe=(None, _lrs), want_probe=[0.015],
             scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.02,
                                                       "warmup_num_steps": 3, "warmup_type": "linear"}}),
        # fp16 model (unit roundoff 2^-11), dynamic loss scale, an overflow step: 3e-3 of the parameter,
        # 2e-2 of its update (measured 1.0e-3, norm2.bias, and 5.3e-3, extra.weight)
        dict(name="w2-fp16-loss-scale-overflow", fp16_overflow=True, clip=0.5, rtol=3e-3, rtol_update=2e-2)],
    3: [dict(name="w3-gas4-clip-overlap-no-nesterov", gas=4, clip=0.5, params=dict(nesterov=False),
             zero=dict(reduce_scatter=True, overlap_comm=True), probe=(_grad_views_start, _grad_views_finish),
             want_probe=[True, True, True, True]),
        dict(name="w3-subgroups-small-buckets", gas=1, params=dict(exchange_bucket_mb=0.004),
             zero=dict(sub_group_size=300), probe=(_grad_views_start, _grad_views_finish),
             want_probe=[True, True, True, False]),
        # the other Newton-Schulz settings through the ZeRO-3 path; ``alt_params``: the oracle with one
        # setting changed back must be far away (Gram NS equals the quintic up to rounding, so a probe
        # counts its kernel's calls instead)
        dict(name="w3-gram-rms-match", gas=1, clip=0.5, params=dict(ns_method="gram", update_scale="rms_match"),
             probe=(_spy_gram_start, _spy_gram_finish), expect_gram=True, alt_params=[dict(update_scale="shape")]),
        dict(name="w3-polar-express-3-steps", gas=1, params=dict(ns_method="polar_express", ns_steps=3),
             alt_params=[dict(ns_steps=5), dict(ns_method="standard")]),
        # the default quintic form "auto" with its threshold lowered to 20 rows (2048 in the package): the owners run
        # sym2 on the matrices with a 24-row short side and plain on the others (12, 16, 5 and 1 rows), as the oracle
        # does; sym2 equals plain up to fp32 rounding, so a probe counts the matrices of each symmetric product over
        # all owner ranks. Per step, 5 iterations of two products on q, o, extra (24x24), conv (24x72), up and down
        # (24x41 wide): X X^T on (24, 24) 3, (24, 72) 1, (24, 41) 2 matrices; P A on (24, 24) 6; times 3 steps
        # (ZeRO-3 runs Newton-Schulz on ``extra`` in its step without a gradient too)
        dict(name="w3-auto-form-sym2-above-20-rows", gas=2, clip=0.5, sym2_min_rows=20,
             probe=(_spy_sym_start, _spy_sym_finish),
             want_probe_sum=[(24, 24, 2, 3 * 5 * (3 + 6)), (24, 41, 2, 3 * 5 * 2), (24, 72, 2, 3 * 5 * 1)])],
    4: [dict(name="w4-clip", gas=1, clip=0.5),
        dict(name="w4-gas4-zeroinit-buckets", gas=4, zero_init=True, params=dict(exchange_bucket_mb=0.004)),
        # pad_b (3 elements) leaves rank 3 only padding: DeepSpeed sets that rank's gradient for it to
        # None every step, so the ranks disagree on which parameters have a gradient; under CPU offload
        # that gradient is never written on rank 3. The exchange still runs the same collectives on
        # every rank (no hang) and the result matches the oracle.
        dict(name="w4-cpu-offload-rank-without-grad", gas=2, clip=0.5, zero=dict(offload_optimizer={"device": "cpu"}))],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_parity_with_oracle(world_size: int) -> None:
    cases = [c for c in CASES[world_size] if not c.get("fp16_overflow")]
    results = run_distributed(parity_worker, world_size, cases)
    for k, case in enumerate(cases):
        check_parity(case, [r[k] for r in results])


@pytest.mark.skipif(not fp16_supported(), reason=FP16_SKIP)
def test_fp16_loss_scale_overflow_parity() -> None:
    """The fp16 cases of :data:`CASES` (their own process group: only where the accelerator trains fp16)."""
    for world_size, all_cases in CASES.items():
        cases = [c for c in all_cases if c.get("fp16_overflow")]
        if cases:
            results = run_distributed(parity_worker, world_size, cases)
            for k, case in enumerate(cases):
                check_parity(case, [r[k] for r in results])


def check_fp16_overflow(case: dict, per_rank: list[dict]) -> None:
    """Assert :func:`_fp16_overflow_case`: the poisoned step (only it) skipped on every rank, nothing
    changed across it, the loss scale reacted, and parity with the oracle that leaves it out."""
    res, name = per_rank[0], case["name"]
    for r in per_rank:
        assert r["skipped"] == [s == FP16_POISONED for s in range(FP16_STEPS)], (name, r["skipped"])
        assert r["same_momentum"] and r["same_weights"], \
            f"{name}: the overflow step changed the state (sub-group, Muon, changed, of, max): {r.get('changed')}"
        assert r["muon_steps_across"] == (FP16_POISONED, FP16_POISONED), f"{name}: Muon steps {r['muon_steps_across']}"
        assert r["steps"] == FP16_STEPS - 1, f"{name}: {r['steps']} Muon steps"
    assert res["tags"]["q.weight"] and not res["tags"]["embed.weight"]
    scales = res["scales"]  # 2^8, halved by the overflow (hysteresis 1), not raised again (window 1000)
    assert scales == [2.0 ** 8] * FP16_POISONED + [2.0 ** 7] * (FP16_STEPS - FP16_POISONED), scales
    for pname, err in res["errors"].items():
        if err["moved"] == 0:
            assert pname.startswith("frozen"), f"{name}: trainable {pname} did not move"
            continue
        assert err["rel"] <= case["rtol"], f"{name}: {pname} rel error {err['rel']:.2e}"
        assert err["rel_update"] <= case["rtol_update"], f"{name}: {pname} update rel error {err['rel_update']:.2e}"


def check_parity(case: dict, per_rank: list[dict]) -> None:
    """Assert one case's results (``per_rank[r]`` from :func:`_run_case` on rank r) against the oracle."""
    if case.get("fp16_overflow"):
        return check_fp16_overflow(case, per_rank)
    res = per_rank[0]
    name = case["name"]
    if name == "w2-plain":
        assert any(r["padding"] for r in per_rank), f"{name}: no rank holds partition padding"
    for rank, r in enumerate(per_rank):  # bit patterns: a NaN would fail ==, as it failed torch.equal
        assert all(v == 0.0 for v in r["padding"]), f"{name}: rank {rank}'s partition padding {r['padding']}"
    if case.get("expect_gram"):  # the Gram kernel ran (it equals the standard one up to rounding)
        assert sum(r["probe"]["gram_calls"] for r in per_rank) >= STEPS, [r["probe"] for r in per_rank]
    assert res["steps"] == STEPS, (name, res["steps"])
    if "want_probe" in case:
        assert all(r["probe"] == case["want_probe"] for r in per_rank), (name, [r["probe"] for r in per_rank])
    if "want_probe_sum" in case:  # summed over the owner ranks: each owns some of the matrices
        total: dict = {}
        for r in per_rank:
            for *key, n in r["probe"]:
                total[tuple(key)] = total.get(tuple(key), 0) + n
        got = sorted((*k, n) for k, n in total.items())
        assert got == case["want_probe_sum"], (name, [r["probe"] for r in per_rank])
    assert res["n_muon_sub_groups"] >= 1
    if case.get("params", {}).get("exchange_bucket_mb"):
        assert res["n_buckets"] >= res["n_muon_sub_groups"] + 2, f"{name}: expected several buckets"
    if case.get("zero", {}).get("sub_group_size"):
        assert res["n_muon_sub_groups"] >= 2, f"{name}: sub_group_size should split the Muon group"
    # every rank reports the same global grad norm, equal to the raw gradient norm of the oracle
    for other in per_rank:
        assert other["norms"] == res["norms"]
    torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(res["ref_norms"]),
                               rtol=case.get("rtol_norm", 1e-5), atol=0)
    if case.get("clip"):
        assert max(res["ref_norms"]) > case["clip"], f"{name}: clipping was never active"
    tags = res["tags"]
    assert tags["experts"] and tags["q.weight"] and tags["conv.weight"] and tags["pad_b.weight"]
    assert not tags["embed.weight"] and not tags["norm1.weight"]
    assert tags["o.weight"] is (not case.get("untag_o", False))
    rtol, rtol_update = case.get("rtol", PARITY_RTOL), case.get("rtol_update", 1e-3)
    for pname, err in res["errors"].items():
        if pname in case.get("loose_update", {}):
            assert err["rel_update"] <= case["loose_update"][pname], f"{name}: {pname} {err['rel_update']:.2e}"
            continue
        assert err["rel"] <= rtol, f"{name}: {pname} rel error {err['rel']:.2e} > {rtol}"
        if err["moved"] > 0:
            assert err["rel_update"] <= rtol_update, f"{name}: {pname} update rel error {err['rel_update']:.2e}"
        else:
            assert pname.startswith("frozen"), f"{name}: trainable {pname} did not move"
    for label, errs in res["alt"].items():
        worst = max(errs[p]["rel"] for p in ("q.weight", "experts", "conv.weight", "down.weight"))
        assert worst > 1000 * PARITY_RTOL, f"{name}: result is indistinguishable from {label}"
