"""ds_muon ZeRO-3 vs. the single-device oracle on GPUs over NCCL (the multi-GPU twin of
tests/dist/test_zero3_parity.py, which runs on CPU/gloo in CI).

    torchrun --nproc_per_node 2 scripts/parity_nccl.py [--out results.json]
    # ZeRO++ qwZ/qgZ, ds_muon's Muon and DeepSpeed's AdamW, each against its control (at W=1 nothing is quantized)
    torchrun --nproc_per_node 2 scripts/parity_nccl.py --cases qwZ,qgZ --optimizers muon,adamw --one-gpu-per-node

Runs the parity model for 3 optimizer steps in several configurations; rank 0 replays the same
data through ``ds_muon.MuonAdamW`` on the CPU (fp32) and prints, per configuration, the worst
per-parameter error relative to the parameter's norm and to how far it moved. fp32 Newton–Schulz
(``ns_dtype: float32``) must stay within 1e-5 relative; with the GPU defaults (bf16 NS and
bf16 exchange) the error is bf16 rounding and is reported, not asserted.

``--optimizers muon,adamw`` runs every selected configuration a second time with DeepSpeed's own AdamW
(``"type": "AdamW"`` through ``deepspeed.initialize``, no ds_muon optimizer, no Muon tags: FusedAdam on CUDA)
against ``torch.optim.AdamW`` in fp32 on the CPU with the same hyperparameters, clipping and data; its rows are
reported (fp32 ones match at ~3e-6 on CPU, except under CPU offload, where DeepSpeed's stale gradient is the
clipped one, which the reference does not replay), and the last table gives each optimizer's ratio of the qwZ and
qgZ errors to those of their unquantized bf16 controls, so DeepSpeed's quantization error is told apart from
ds_muon's handling of it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.harness import (MUON_PARAMS, PARITY_RTOL, build_engine, clone_tags, compare, ds_config,  # noqa: E402
                           fp32_master_params, gathered_params, reference_model, train_engine, train_reference)

STEPS = 3
# DeepSpeed's AdamW (FusedAdam on CUDA: adam_w_mode, bias correction) and its fp32 reference, torch.optim.AdamW
ADAMW_PARAMS = {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.05}
CASES = [
    dict(name="fp32-ns gas1", gas=1, clip=0.0, params={}, zero={}),
    dict(name="fp32-ns gas4 clip rs=false", gas=4, clip=0.5, params={}, zero=dict(reduce_scatter=False)),
    dict(name="fp32-ns gas2 zero.Init overlap", gas=2, clip=0.5, params={}, zero=dict(overlap_comm=True),
         zero_init=True),
    dict(name="fp32-ns 4 KiB buckets (pipelined)", gas=1, clip=0.5, params=dict(exchange_bucket_mb=0.004), zero={}),
    # shard and momentum in CPU memory, exchange and Newton-Schulz on the GPU
    dict(name="fp32-ns cpu offload gas2 clip", gas=2, clip=0.5, params={},
         zero=dict(offload_optimizer={"device": "cpu", "pin_memory": True})),
    dict(name="gpu defaults (bf16 NS+exchange)", gas=1, clip=0.5,
         params=dict(ns_dtype="auto", exchange_dtype="auto"), zero={}, strict=False),
    # ZeRO++ on CUDA (DeepSpeed's quantizer op; refused on the CPU accelerator): the error of DeepSpeed's int8
    # weight all-gather (qwZ) and int4 gradient all_to_all reduction (qgZ) against the fp32 oracle, reported.
    # DeepSpeed 0.19.8 quantizes only where there is something to send: qwZ in the all-gather, which a partition of
    # one rank skips (partition_parameters.py, all_gather_coalesced: world size 1 -> no gather), so W >= 2; qgZ only
    # across nodes (stage3.py, __avg_scatter_grads: W // device_count() > 1, else the plain reduce-scatter), and there
    # only for gradients of >= 2 dims whose numel divides by 2 W. On one host --one-gpu-per-node makes each rank a
    # node of one GPU. bf16; DeepSpeed's quantizer kernels read their input as fp16 (``__half*``): qwZ converts to
    # fp16 first (CUDAQuantizer.quantize), qgZ does not (all_to_all_quant_reduce hands swizzle_quant the gradients in
    # the communication dtype, bf16 here), so qgZ is also run with ``communication_data_type: fp16``. ``role`` and
    # ``control``: the summary divides each quantized run's errors by those of its control, the same run unquantized
    # (with and without zero.Init, as qwZ and qgZ run), per optimizer.
    dict(name="qwZ/qgZ control: bf16, no quantization", gas=2, clip=0.5, params={}, zero={},
         top=dict(bf16={"enabled": True}), zero_init=True, strict=False, role="control"),
    dict(name="qgZ control: bf16, no quantization, no zero.Init", gas=2, clip=0.5, params={}, zero={},
         top=dict(bf16={"enabled": True}), strict=False, role="control, no zero.Init"),
    dict(name="qwZ (zero_quantized_weights) bf16 zero.Init", gas=2, clip=0.5, params={},
         zero=dict(zero_quantized_weights=True), top=dict(bf16={"enabled": True}), zero_init=True, strict=False,
         role="qwZ", control="control"),
    dict(name="qgZ (zero_quantized_gradients) bf16", gas=2, clip=0.5, params={},
         zero=dict(zero_quantized_gradients=True), top=dict(bf16={"enabled": True}), strict=False, role="qgZ",
         control="control, no zero.Init"),
    dict(name="qgZ control: bf16, fp16 communication, no quantization", gas=2, clip=0.5, params={}, zero={},
         top=dict(bf16={"enabled": True}, communication_data_type="fp16"), strict=False, role="control, fp16 comm"),
    dict(name="qgZ (zero_quantized_gradients) bf16, fp16 communication", gas=2, clip=0.5, params={},
         zero=dict(zero_quantized_gradients=True), top=dict(bf16={"enabled": True}, communication_data_type="fp16"),
         strict=False, role="qgZ, fp16 comm", control="control, fp16 comm"),
]


def fp16_overflow_check(rank: int, world: int) -> dict:
    """fp16 with dynamic loss scaling; step 2's loss is poisoned (NaN gradients). DeepSpeed must skip
    that step: the Muon momentum and the fp32 weights stay bit-identical, and the run matches the
    oracle that skips the same step (fp16 forward/backward vs. fp32 oracle: reported)."""
    import ds_muon
    from tests.support.harness import fp32_master_params
    from tests.support.models import batch, use_extra
    cfg = ds_config(gas=1, clip=0.5, optimizer={"type": "Muon", "params": dict(MUON_PARAMS)})
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, model = build_engine(cfg)
    init, tags = gathered_params(model), clone_tags(model)
    opt = engine.optimizer
    skipped, same_momentum, same_weights = [], None, None
    for step in range(4):
        if step == 2:
            mom = {i: opt.optimizer.state[opt.fp32_partitioned_groups_flat[i]]["momentum_buffer"].clone()
                   for i in opt.muon_plans}
            w = [t.clone() for t in opt.fp32_partitioned_groups_flat]
        tokens, targets = (t.to(engine.device) for t in batch(step, rank, 0))
        loss = engine(tokens, targets, use_extra(step))
        if step == 2:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        skipped.append(bool(opt.overflow))
        if step == 2:
            same_momentum = all(torch.equal(mom[i], opt.optimizer.state[opt.fp32_partitioned_groups_flat[i]]
                                            ["momentum_buffer"]) for i in opt.muon_plans)
            same_weights = all(torch.equal(a, b) for a, b in zip(w, opt.fp32_partitioned_groups_flat))
    got = fp32_master_params(model)
    engine.destroy()
    out = dict(skipped=skipped, same_momentum=same_momentum, same_weights=same_weights)
    if rank == 0:
        ref = reference_model(init, tags)
        ref_opt = ds_muon.MuonAdamW(ref.parameters(), **cfg["optimizer"]["params"])
        trainable = [p for p in ref.parameters() if p.requires_grad]
        for step in range(4):
            if skipped[step]:
                continue
            ref_opt.zero_grad(set_to_none=True)
            for r in range(world):
                tokens, targets = batch(step, r, 0)
                (ref(tokens, targets, use_extra(step)) / world).backward()
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            torch.nn.utils.clip_grad_norm_(trainable, 0.5)
            ref_opt.step()
        errs = compare(got, {n: p.detach() for n, p in ref.named_parameters()}, init)
        out["max_rel"] = max(e["rel"] for e in errs.values())
        out["max_rel_update"] = max(e["rel_update"] for e in errs.values() if e["moved"] > 0)
    return out


def class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def untag(model: torch.nn.Module) -> None:
    """Drops the parity model's own ``use_muon`` tags (the stacked experts'): the AdamW arm runs DeepSpeed alone."""
    for p in model.parameters():
        if hasattr(p, "use_muon"):
            del p.use_muon


@contextlib.contextmanager
def counting_quantization(counts: dict):
    """While in the block, counts DeepSpeed's quantizing calls into ``counts``: ``qgz_calls`` (qgZ's
    ``all_to_all_quant_reduce``, stage3.py; inside it 1-D gradients and those whose numel does not divide by 2 W go
    through the plain reduce-scatter) and ``qwz_quantizations`` (qwZ's ``CUDAQuantizer.quantize``)."""
    from deepspeed.runtime.zero import partition_parameters, stage3
    reduce, quantize = stage3.all_to_all_quant_reduce, partition_parameters.CUDAQuantizer.quantize
    counts.update(qgz_calls=0, qwz_quantizations=0)

    def counted_reduce(*args, **kwargs):
        counts["qgz_calls"] += 1
        return reduce(*args, **kwargs)

    def counted_quantize(*args, **kwargs):
        counts["qwz_quantizations"] += 1
        return quantize(*args, **kwargs)

    stage3.all_to_all_quant_reduce, partition_parameters.CUDAQuantizer.quantize = counted_reduce, counted_quantize
    try:
        yield
    finally:
        stage3.all_to_all_quant_reduce, partition_parameters.CUDAQuantizer.quantize = reduce, quantize


def worst(errs: dict) -> dict:
    """The largest of :func:`compare`'s errors and the parameter it is on: ``max_rel`` (relative to the parameter's
    norm, over every parameter) and ``max_rel_update`` (relative to how far it moved, over those that moved); a NaN
    error is the largest."""
    def size(name: str, key: str) -> float:
        return math.inf if math.isnan(errs[name][key]) else errs[name][key]

    rel = max(errs, key=lambda n: size(n, "rel"))
    upd = max((n for n in errs if not errs[n]["moved"] <= 0), key=lambda n: size(n, "rel_update"))
    return dict(max_rel=errs[rel]["rel"], worst_param=rel, max_rel_update=errs[upd]["rel_update"],
                worst_update_param=upd)


def run_case(case: dict, optimizer: str, rank: int, world: int) -> dict | None:
    """One configuration with ``optimizer`` (``"muon"``: ds_muon against ``MuonAdamW``; ``"adamw"``: DeepSpeed's AdamW
    against ``torch.optim.AdamW``), 3 steps; on rank 0 its row, else None. The row's worst errors are those of the
    model's weights as gathered (``max_rel``, ``max_rel_update``: in bf16 runs the bf16 weights, whose rounding is a
    floor: a LayerNorm weight near 1 is held to 2**-8) and those of the fp32 master weights the optimizer steps
    (``master_*``), each with the parameter it is on.

    Raises SystemExit where the AdamW arm's engine holds a ds_muon optimizer (it must be DeepSpeed's)."""
    import deepspeed
    import ds_muon
    opt_cfg = ({"type": "Muon", "params": dict(MUON_PARAMS, **case["params"])} if optimizer == "muon"
               else {"type": "AdamW", "params": dict(ADAMW_PARAMS)})
    cfg = ds_config(gas=case["gas"], clip=case["clip"], optimizer=opt_cfg, **case["zero"])
    cfg.update(case.get("top", {}))
    counts: dict = {}
    with counting_quantization(counts):
        if optimizer == "muon":
            engine, model = build_engine(cfg, zero_init=case.get("zero_init", False))
        else:
            engine, model = build_engine(cfg, zero_init=case.get("zero_init", False), before=untag,
                                         initialize=deepspeed.initialize)
        init, tags = gathered_params(model), clone_tags(model)
        norms = train_engine(engine, STEPS, rank, case["gas"])
    classes = dict(engine_optimizer=class_name(engine.optimizer),
                   inner_optimizer=class_name(engine.optimizer.optimizer))
    if optimizer == "adamw" and any(c.startswith("ds_muon") for c in classes.values()):
        raise SystemExit(f"the AdamW arm must run DeepSpeed's optimizers, got {classes}")
    got, master = gathered_params(model), fp32_master_params(model)
    engine.destroy()
    if rank != 0:
        return None
    ref = reference_model(init, tags)
    params = cfg["optimizer"]["params"]
    if optimizer == "muon":
        opt = ds_muon.MuonAdamW(ref.parameters(), **dict(params, ns_dtype="float32"))
    else:
        opt = torch.optim.AdamW(ref.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                                weight_decay=params["weight_decay"])
    # DeepSpeed alone steps a parameter without gradient (``extra`` on odd steps) with its last gradient again
    ref_norms = train_reference(ref, opt, STEPS, world, case["gas"], case["clip"], stale_grads=optimizer == "adamw")
    want = {n: p.detach() for n, p in ref.named_parameters()}
    model_err = worst(compare(got, want, init))
    master_err = {f"master_{k}": v for k, v in worst(compare(master, want, init)).items()}
    worst_rel, worst_upd = model_err["max_rel"], model_err["max_rel_update"]
    ok = worst_rel <= PARITY_RTOL if case.get("strict", True) and optimizer == "muon" else None
    label = case["name"] if optimizer == "muon" else f"{case['name']} [AdamW]"
    if optimizer == "adamw":
        print(f"[parity W={world}] {label}: engine.optimizer {classes['engine_optimizer']}, "
              f"inner {classes['inner_optimizer']}", flush=True)
    print(f"[parity W={world}] {label:<36} max rel err {worst_rel:.2e}  "
          f"max rel-to-update err {worst_upd:.2e}  {'PASS' if ok else ('(reported)' if ok is None else 'FAIL')}",
          flush=True)
    return dict(case=case["name"], optimizer=optimizer, role=case.get("role"), control=case.get("control"), world=world,
                **model_err, **master_err, grad_norm_rel=abs(norms[-1] - ref_norms[-1]) / ref_norms[-1], passed=ok,
                **classes, **counts)


def summary(rows: list[dict], world: int) -> list[dict]:
    """Prints one table of the configuration rows (case, optimizer, worst error relative to the parameter's norm and
    to its update for the model's weights and for the fp32 master weights, the last step's global grad norm relative
    to the reference's, DeepSpeed's quantizing calls (:func:`counting_quantization`), the parameters the master errors
    are on) and, per optimizer, the qwZ and qgZ errors divided by those of their unquantized bf16 controls. Returns
    those ratios as rows (``case`` e.g. ``"qgZ / control, no zero.Init"``, ``optimizer``, ``<error>_ratio`` for each
    of the four errors; only runs whose control ran; failed cases are left out)."""
    print(f"[parity W={world}] {'case':<56} {'optimizer':<9} {'rel err':>9} {'rel-upd':>9} {'master rel':>10} "
          f"{'master rel-upd':>14} {'grad-norm rel':>13} {'qwZ/qgZ calls':>13}  worst master params (rel / rel-upd)")
    rows = [r for r in rows if "error" not in r]
    for r in rows:
        calls = f"{r['qwz_quantizations']}/{r['qgz_calls']}"
        print(f"[parity W={world}] {r['case']:<56} {r['optimizer']:<9} {r['max_rel']:>9.2e} "
              f"{r['max_rel_update']:>9.2e} {r['master_max_rel']:>10.2e} {r['master_max_rel_update']:>14.2e} "
              f"{r['grad_norm_rel']:>13.2e} {calls:>13}  {r['master_worst_param']} / {r['master_worst_update_param']}")
    ratios = []
    by_role = {(r["optimizer"], r["role"]): r for r in rows if r["role"]}
    for r in rows:
        control = by_role.get((r["optimizer"], r["control"]))
        if control is None:
            continue
        ratio = {f"{k}_ratio": r[k] / control[k]
                 for k in ("max_rel", "max_rel_update", "master_max_rel", "master_max_rel_update")}
        ratios.append(dict(case=f"{r['role']} / {r['control']}", optimizer=r["optimizer"], world=world, passed=None,
                           **ratio))
        print(f"[parity W={world}] {r['optimizer']:<5} {r['role']} / {r['control']}: rel err "
              f"{ratio['max_rel_ratio']:.2f}x, rel-upd {ratio['max_rel_update_ratio']:.2f}x; fp32 master: rel err "
              f"{ratio['master_max_rel_ratio']:.2f}x, rel-upd {ratio['master_max_rel_update_ratio']:.2f}x", flush=True)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="", help="run only the cases whose name contains one of these comma-separated "
                                               "texts (and the fp16 overflow check only if one is in 'fp16 overflow')")
    ap.add_argument("--one-gpu-per-node", action="store_true",
                    help="each rank sees only its own GPU (CUDA_VISIBLE_DEVICES=LOCAL_RANK, then LOCAL_RANK=0), so "
                         "DeepSpeed counts W nodes of one GPU and qgZ quantizes on one host (W >= 2)")
    ap.add_argument("--optimizers", default="muon", help="comma-separated: muon (ds_muon vs. MuonAdamW), adamw "
                                                          "(DeepSpeed's AdamW vs. torch.optim.AdamW); each runs every "
                                                          "selected case")
    args = ap.parse_args()
    optimizers = args.optimizers.split(",")
    if not optimizers or set(optimizers) - {"muon", "adamw"}:
        ap.error(f"--optimizers takes muon and/or adamw, got {args.optimizers!r}")
    if args.one_gpu_per_node:  # before anything initializes CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("LOCAL_RANK", "0")
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    import deepspeed
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = []
    wanted = args.cases.split(",")
    for case in [c for c in CASES if any(w in c["name"] for w in wanted)]:
        for optimizer in optimizers:
            try:
                row = run_case(case, optimizer, rank, world)
            except Exception as err:  # noqa: BLE001 - one case failing (a quantizer kernel's error) keeps the others
                traceback.print_exc()
                print(f"[parity W={world}] {case['name']} [{optimizer}] FAIL: {type(err).__name__}: {err}", flush=True)
                row = dict(case=case["name"], optimizer=optimizer, world=world, passed=False,
                           error=f"{type(err).__name__}: {err}") if rank == 0 else None
            if row is not None:
                rows.append(row)
    if rank == 0 and rows:
        rows += summary(rows, world)
    fp16 = fp16_overflow_check(rank, world) if "muon" in optimizers and any(w in "fp16 overflow" for w in wanted) \
        else None
    if rank == 0 and fp16 is not None:
        ok = fp16["skipped"] == [False, False, True, False] and fp16["same_momentum"] and fp16["same_weights"]
        rows.append(dict(case="fp16 overflow at step 2 skipped", world=world, passed=bool(ok), **fp16))
        print(f"[parity W={world}] fp16 overflow: skipped {fp16['skipped']}, momentum unchanged "
              f"{fp16['same_momentum']}, weights unchanged {fp16['same_weights']}, vs oracle max rel err "
              f"{fp16['max_rel']:.2e}, rel-to-update {fp16['max_rel_update']:.2e}  {'PASS' if ok else 'FAIL'}",
              flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    # every rank done, then the process group torn down while Python is fully alive (docs/troubleshooting.md; before
    # rank 0 may exit with the failures, so that no rank waits in the barrier for it)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    failed = [r for r in rows if r["passed"] is False]
    if rank == 0 and failed:
        raise SystemExit(f"parity failed: {failed}")


if __name__ == "__main__":
    main()
