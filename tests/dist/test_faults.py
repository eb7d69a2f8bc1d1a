"""Faults and edge inputs (issue 17): each test injects the fault and asserts the outcome.

CPU, gloo, W = 2 unless a test says otherwise. Non-finite gradients are compared with the
single-device oracle run that never saw the skipped steps (fp32: ``harness.PARITY_RTOL`` relative
of each parameter, 1e-3 of its update), and in bf16/fp16 with the same-dtype ds_muon run that never
saw them (``TOL``).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.precision import FP16_SKIP, fp16_supported
from tests.support.spawn import run_distributed
from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                           fp32_master_params, reference_model)
from tests.support.models import batch, use_extra

GAS, CLIP = 2, 0.5
STEPS = 5
# (step, rank, micro, parameter, value): a NaN on rank 1 and an Inf on rank 0, in different steps
INJECT = ((1, 1, 1, "o.weight", float("nan")), (3, 0, 0, "down.weight", float("inf")))
SKIPPED = tuple(s for s, *_ in INJECT)
# (relative of the parameter, relative of its update). bf16/fp16 are compared with the same arithmetic.
# fp16 uses a static loss scale: a dynamic one is halved by the skip, which moves fp16 gradient rounding
# (measured: up to 5e-4 relative on a LayerNorm bias), so the two runs would differ by more than the skip.
TOL = {"fp32": (PARITY_RTOL, 1e-3), "bf16": (1e-6, 1e-4), "fp16": (1e-6, 1e-4)}


def _poison_hooks(model, rank: int, when: dict):
    """Gradient hooks that fill parameter ``name``'s gradient with ``value`` at ``when[(step, micro)]``
    on this rank (an entry ``(step, rank, micro, name, value, element)``: only that element of the flattened
    gradient); ``when`` is read at backward time (the caller sets ``when["now"]``)."""
    named = dict(model.named_parameters())

    def hook_for(name):
        def hook(grad):
            for step, r, micro, pname, value, *element in when["inject"]:
                if (step, micro) == when["now"] and r == rank and pname == name:
                    if not element:
                        return torch.full_like(grad, value)
                    out = grad.clone(memory_format=torch.contiguous_format)  # (an einsum's grad is not)
                    out.view(-1)[element[0]] = value
                    return out
            return grad
        return hook

    return [named[name].register_hook(hook_for(name)) for name in {i[3] for i in when["inject"]}]


def _train_steps(engine, rank: int, steps, when: dict | None = None) -> list[float]:
    """Optimizer steps over the data of the given step indices (GAS micro-batches each)."""
    losses = []
    for step in steps:
        for micro in range(GAS):
            if when is not None:
                when["now"] = (step, micro)
            tokens, targets = batch(step, rank, micro)
            loss = engine(tokens, targets, use_extra(step))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _adam_steps(engine) -> list[int]:
    """The Adam ``step`` of every AdamW sub-group's state (DeepSpeed keeps it per sub-group; ZeRO-1/2: per
    param group)."""
    opt = engine.optimizer
    steps = []
    flats = getattr(opt, "fp32_partitioned_groups_flat", None) or opt.single_partition_of_fp32_groups
    for i, fp32 in enumerate(flats):
        if i not in opt.muon_plans:
            value = opt.optimizer.state.get(fp32, {}).get("step")
            steps.append(int(value) if value is not None else 0)
    return steps


def _dtype_cfg(dtype: str, stage: int = 3, **params) -> dict:
    cfg = ds_config(gas=GAS, clip=CLIP, stage=stage)
    cfg["optimizer"]["params"].update(params)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["optimizer"]["params"].update(ns_dtype="auto", exchange_dtype="auto")
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 128}
        cfg["optimizer"]["params"].update(ns_dtype="auto", exchange_dtype="auto")
    return cfg


def _one_rank_elements(opt, world_size: int) -> tuple[tuple[str, int], tuple[str, int]]:
    """Two gradient elements that only one rank's partition holds, from the optimizer's layout (ZeRO-3's chunks or
    ZeRO-1/2's flat partitions): ``(name, flat element)`` of the first parameter (sub-group order, the order in
    which the first non-finite gradient is named) with an element on rank 1, and of the last parameter with an
    element on rank 0, which comes after it. ``extra`` (no gradient on odd steps) is left out."""
    from ds_muon.partitions import chunked_pieces
    if type(opt).__name__ == "MuonZeroOptimizer":
        ordered = [(p, chunked_pieces(int(p.ds_numel), world_size, 0)) for group in opt.fp16_groups for p in group]
    else:
        ordered = [(p, pieces) for group in opt.pieces for p, pieces in group]
    ordered = [(opt.param_names[p], pieces) for p, pieces in ordered if not opt.param_names[p].startswith("extra")]
    a = next(k for k, (_, pieces) in enumerate(ordered) if pieces[1].length)
    b = max(k for k, (_, pieces) in enumerate(ordered) if pieces[0].length)
    assert a < b, [(n, [(x.start, x.length) for x in pieces]) for n, pieces in ordered]
    return (ordered[a][0], ordered[a][1][1].start), (ordered[b][0], ordered[b][1][0].start)


def _non_finite_cases(rank: int, world_size: int, csv_dir: str, dtypes: tuple = ("fp32", "bf16"),
                      stage: int = 3) -> dict:
    import ds_muon
    out = {}
    for dtype in dtypes:
        cfg = _dtype_cfg(dtype, stage)
        if dtype == "fp32":
            cfg["csv_monitor"] = {"enabled": True, "output_path": csv_dir, "job_name": "faults"}
        engine, model = build_engine(cfg)
        init = gathered_params(model)
        tags = clone_tags(model)
        when = {"inject": INJECT, "now": None}
        hooks = _poison_hooks(model, rank, when)
        _train_steps(engine, rank, range(STEPS), when)
        for h in hooks:
            h.remove()
        opt = engine.optimizer
        res = {"skipped": opt.skipped_step_count, "consecutive": opt.consecutive_skipped_steps,
               "muon_steps": opt.muon_step_count, "adam_steps": _adam_steps(engine),
               "named": opt.last_non_finite_param,
               "got": fp32_master_params(model)}
        engine.destroy()
        clean_steps = [s for s in range(STEPS) if s not in SKIPPED]
        if dtype == "fp32":
            if rank == 0:  # the oracle, on the steps that were applied
                ref = reference_model(init, tags)
                oracle = ds_muon.MuonAdamW(ref.parameters(), **cfg["optimizer"]["params"])
                trainable = [p for p in ref.parameters() if p.requires_grad]
                for step in clean_steps:
                    oracle.zero_grad(set_to_none=True)
                    for r in range(world_size):
                        for micro in range(GAS):
                            tokens, targets = batch(step, r, micro)
                            (ref(tokens, targets, use_extra(step)) / (world_size * GAS)).backward()
                    for p in trainable:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                    torch.nn.utils.clip_grad_norm_(trainable, CLIP)
                    oracle.step()
                want = {n: p.detach().clone() for n, p in ref.named_parameters()}
                res["errors"] = compare(res["got"], want, init)
        else:  # the same dtype's ds_muon run that never saw the skipped steps
            engine, model = build_engine(_dtype_cfg(dtype, stage))
            _train_steps(engine, rank, clean_steps)
            want = fp32_master_params(model)
            res["errors"] = compare(res["got"], want, init)
            res["clean_adam_steps"] = _adam_steps(engine)
            engine.destroy()
        del res["got"]
        out[dtype] = res

    if "fp32" not in dtypes:
        return out
    # N consecutive skips stop the run, naming the first parameter with a non-finite gradient. Each step one NaN
    # element that only rank 1's partition holds (rank 0 poisons it) and a later one that only rank 0's holds:
    # alone, each rank would name its own; the all_reduce makes both name the first
    engine, model = build_engine(_dtype_cfg("fp32", stage, max_consecutive_skipped_steps=3))
    first, later = _one_rank_elements(engine.optimizer, world_size)
    when = {"inject": [i for s in range(1, 10) for i in ((s, 0, 0, first[0], float("nan"), first[1]),
                                                         (s, 1, 0, later[0], float("nan"), later[1]))],
            "now": None}
    _poison_hooks(model, rank, when)
    skipped = []
    try:
        for step in range(10):
            _train_steps(engine, rank, [step], when)
            skipped.append(engine.optimizer.skipped_step_count)
        out["stop"] = None
    except RuntimeError as err:
        if "consecutive optimizer steps skipped" not in str(err):
            raise  # any other error: fail now, not after the peer waits out the group's timeout
        out["stop"] = (str(err), engine.optimizer.muon_step_count, engine.optimizer.skipped_step_count)
    out["stop_poisoned"] = (first[0], later[0])
    out["stop_named"] = engine.optimizer.last_non_finite_param
    out["stop_skipped"] = skipped
    engine.destroy()
    if rank == 0:
        import csv
        import glob
        out["csv"] = {}
        for path in glob.glob(f"{csv_dir}/faults/Train_ds_muon_*.csv"):
            with open(path) as f:
                out["csv"][path.rsplit("/", 1)[-1]] = list(csv.reader(f))
    return out


def _check_non_finite(results: list[dict], dtypes: tuple) -> None:
    applied = STEPS - len(SKIPPED)
    for rank, out in enumerate(results):
        for dtype in dtypes:
            res = out[dtype]
            assert res["skipped"] == len(SKIPPED), (dtype, res)
            assert res["consecutive"] == 0, (dtype, res)
            assert res["muon_steps"] == applied, (dtype, res)
            assert res["adam_steps"] and set(res["adam_steps"]) == {applied}, (dtype, res)
            assert res["named"] == "down.weight", (dtype, res)  # the last skipped step's poisoned parameter
            if "errors" in res:
                tol_rel, tol_upd = TOL[dtype]
                for name, e in res["errors"].items():
                    assert e["rel"] <= tol_rel and (e["rel_update"] <= tol_upd or e["moved"] == 0), (dtype, name, e)
        if "fp32" not in dtypes:
            continue
        msg, muon_steps, skipped = out["stop"]
        first, later = out["stop_poisoned"]
        assert out["stop_poisoned"] == results[0]["stop_poisoned"], (rank, out["stop_poisoned"])
        assert "3 consecutive optimizer steps skipped" in msg and f"non-finite gradient: {first})" in msg, (rank, msg)
        assert out["stop_named"] == first, (rank, out["stop_named"], first, later)  # rank 0 alone sees only `later`
        assert "max_consecutive_skipped_steps" in msg, msg
        assert (muon_steps, skipped) == (1, 3), (rank, out["stop"])
        assert out["stop_skipped"] == [0, 1, 2], (rank, out["stop_skipped"])  # skipped counts after steps 0, 1, 2
    if "fp32" in dtypes:
        csv_rows = results[0]["csv"]["Train_ds_muon_skipped_steps.csv"]
        assert [float(r[1]) for r in csv_rows[1:]] == [1.0, 2.0], csv_rows


@pytest.mark.parametrize("stage", [3, 2])
def test_non_finite_gradients_skip_count_report_and_stop(tmp_path, stage):
    """A NaN (rank 1) and an Inf (rank 0) injected into one parameter's gradient, GAS 2, clipping 0.5,
    in fp32 and bf16, at ZeRO stage 3 and 2: both steps are skipped, counted, logged and reported to the
    monitor; the state equals the run that never saw them (Adam counts applied steps only); three skips in a
    row stop the run with an error naming the poisoned parameter. In those, one NaN element per step lies in
    rank 1's partition only and one, of a later parameter, in rank 0's only: every rank names the first and
    skips the same steps."""
    dtypes = ("fp32", "bf16")
    _check_non_finite(run_distributed(_non_finite_cases, 2, str(tmp_path), dtypes, stage), dtypes)


@pytest.mark.skipif(not fp16_supported(), reason=FP16_SKIP)
def test_non_finite_gradients_fp16(tmp_path):
    """As above in fp16 (static loss scale 128), ZeRO stage 3."""
    _check_non_finite(run_distributed(_non_finite_cases, 2, str(tmp_path), ("fp16",)), ("fp16",))


# ------------------------------------------------------------------------------------------------
# tiny gradients: Muon's update does not depend on the loss scale (through the ZeRO-3 path)
# ------------------------------------------------------------------------------------------------
TINY_CASES = {  # name: Muon params
    "standard_fp32": {"ns_method": "standard"},
    "polar_express_bf16": {"ns_method": "polar_express", "ns_dtype": "bfloat16", "exchange_dtype": "bfloat16"},
    "gram_fp16": {"ns_method": "gram", "ns_dtype": "float16"},
}
# powers of two scale every gradient exactly (fp32 model, no clipping): the Muon weights must be
# bit-identical; 1e-10 rounds the gradient, so equal to fp32 rounding (<= 1e-3 of the update). The
# AdamW parameters are frozen: Adam's eps is not scale-invariant, and their updates would change the
# Muon gradients of later steps.
TINY_SCALES = {"standard_fp32": (2.0**-100, 1e-10), "polar_express_bf16": (2.0**-100,), "gram_fp16": (2.0**-100,)}


def _freeze_adamw(model):
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith(("embed", "head")):
            p.requires_grad_(False)


def _tiny_cases(rank: int, world_size: int) -> dict:
    out = {}
    for name, params in TINY_CASES.items():
        runs = {}
        for scale in (1.0,) + TINY_SCALES[name]:
            cfg = ds_config(gas=GAS)
            cfg["optimizer"]["params"].update(params)
            engine, model = build_engine(cfg, before=_freeze_adamw,
                                         model_parameters=lambda m: [p for p in m.parameters() if p.requires_grad])
            if scale == 1.0:
                init = gathered_params(model)
            for step in range(3):
                for micro in range(GAS):
                    tokens, targets = batch(step, rank, micro)
                    engine.backward(engine(tokens, targets, use_extra(step)) * scale)
                    engine.step()
            runs[scale] = gathered_params(model)
            engine.destroy()
        muon = [n for n in runs[1.0] if (runs[1.0][n] - init[n]).norm() > 0]
        out[name] = {scale: compare({n: runs[scale][n] for n in muon}, {n: runs[1.0][n] for n in muon}, init)
                     for scale in TINY_SCALES[name]}
        out[name]["exact"] = {scale: all(torch.equal(runs[scale][n], runs[1.0][n]) for n in runs[1.0])
                              for scale in TINY_SCALES[name]}
        out[name]["n_moved"] = len(muon)
    return out


def test_tiny_gradients_scale_invariant_through_zero3():
    """The loss x 2^-100 (and x 1e-10) leaves every Muon weight as at scale 1 after 3 steps (GAS 2, W = 2),
    for standard NS in fp32, Polar Express in bf16 (bf16 exchange) and Gram NS in fp16: bit-identical for
    the power of two, within 1e-3 of the update for 1e-10 (99% off before the normalization was made
    scale-safe)."""
    out = run_distributed(_tiny_cases, 2)[0]
    for name in TINY_CASES:
        assert out[name]["n_moved"] >= 10, out[name]  # the Muon weights moved (the AdamW ones are frozen)
        for scale in TINY_SCALES[name]:
            if scale != 1e-10:
                assert out[name]["exact"][scale], (name, scale, out[name][scale])
            for pname, e in out[name][scale].items():
                assert e["rel_update"] <= 1e-3, (name, scale, pname, e)


# ------------------------------------------------------------------------------------------------
# edge parameters
# ------------------------------------------------------------------------------------------------
def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return None


def _edge_cases(rank: int, world_size: int, ckpt_dir: str) -> dict:
    from torch import nn
    out = {}

    def with_extra(name, module_or_param):
        def before(model):
            setattr(model, name, module_or_param)
        return before

    # a 0-D trainable parameter and a zero-element one: refused before DeepSpeed allocates anything
    out["zero_dim"] = _error_of(lambda: build_engine(ds_config(gas=GAS), before=with_extra("temp", nn.Parameter(torch.tensor(1.0)))))
    out["empty"] = _error_of(lambda: build_engine(ds_config(gas=GAS), before=with_extra("empty", nn.Linear(16, 0))))

    # requires_grad switched after initialize: the next step says so
    engine, model = build_engine(ds_config(gas=GAS))
    _train_steps(engine, rank, range(2))
    model.q.weight.requires_grad_(False)
    out["frozen_later"] = _error_of(lambda: _train_steps(engine, rank, range(2, 3)))
    engine.destroy()
    engine, model = build_engine(ds_config(gas=GAS))
    _train_steps(engine, rank, range(1))
    model.frozen.weight.requires_grad_(True)
    out["unfrozen_later"] = _error_of(lambda: _train_steps(engine, rank, range(1, 2)))
    engine.destroy()

    # an ordinary error inside DeepSpeed's step (not a collective's), on every rank alike, propagates as
    # itself: in the element-wise momentum step, and inside the owner exchange (Newton-Schulz)
    import ds_muon.core.newton_schulz as newton_schulz
    import ds_muon.sharded.muon_step as muon_step
    for label, module, attr in (("elementwise_error", muon_step, "momentum_update_"),
                                ("newton_schulz_error", newton_schulz, "newton_schulz_quintic")):
        real = getattr(module, attr)

        def broken(*args, **kwargs):
            raise RuntimeError(f"injected failure of {attr}")
        engine, model = build_engine(ds_config(gas=1))
        setattr(module, attr, broken)
        try:
            out[label] = _error_of(lambda: _train_steps(engine, rank, range(1)))
        finally:
            setattr(module, attr, real)
        engine.destroy()

    # load_checkpoint(tag=..., load_optimizer_states=False) and load_module_only load that tag's weights
    engine, model = build_engine(ds_config(gas=GAS))
    _train_steps(engine, rank, range(2))
    engine.save_checkpoint(ckpt_dir, tag="t2")
    w2 = gathered_params(model)
    _train_steps(engine, rank, range(2, 4))
    engine.save_checkpoint(ckpt_dir, tag="t4")
    w4 = gathered_params(model)
    engine.destroy()
    for label, kwargs in (("no_optimizer_states", {"load_optimizer_states": False}),
                          ("module_only", {"load_module_only": True})):
        engine, model = build_engine(ds_config(gas=GAS))
        engine.load_checkpoint(ckpt_dir)  # latest = t4, with its optimizer state
        engine.load_checkpoint(ckpt_dir, tag="t2", **kwargs)
        got = gathered_params(model)
        out[label] = {"is_t2": all(torch.equal(got[n], w2[n]) for n in w2),
                      "differs_from_t4": any(not torch.equal(got[n], w4[n]) for n in w4),
                      "muon_steps": engine.optimizer.muon_step_count}
        _train_steps(engine, rank, range(4, 5))  # trains on from there
        out[label]["finite"] = all(torch.isfinite(t).all() for t in gathered_params(model).values())
        engine.destroy()
    return out


def test_edge_parameters(tmp_path):
    """0-D and zero-element trainable parameters get a clear error at initialize; requires_grad switched
    after initialize (either way) stops the next step naming the parameter; an ordinary RuntimeError
    inside the step (element-wise momentum, Newton-Schulz in the exchange) surfaces as itself, not as a
    dead-peer CollectiveError; load_checkpoint(tag="t2",
    load_optimizer_states=False) and load_module_only=True install t2's weights (not latest's t4),
    keeping the live optimizer state (muon_step_count of t4)."""
    results = run_distributed(_edge_cases, 2, str(tmp_path / "ckpt"))
    for out in results:
        assert out["zero_dim"] and "'temp' is 0-D" in out["zero_dim"] and "shape (1,)" in out["zero_dim"], out
        assert out["empty"] and "'empty.weight' has no elements" in out["empty"], out
        assert out["frozen_later"] and "'q.weight' was trainable at initialize and is now frozen" in out["frozen_later"]
        assert out["unfrozen_later"] and "'frozen.weight' was frozen" in out["unfrozen_later"], out["unfrozen_later"]
        for label, attr in (("elementwise_error", "momentum_update_"), ("newton_schulz_error", "newton_schulz_quintic")):
            assert out[label] == f"RuntimeError: injected failure of {attr}", (label, out[label])
        for label in ("no_optimizer_states", "module_only"):
            assert out[label] == {"is_t2": True, "differs_from_t4": True, "muon_steps": 4, "finite": True}, (label, out)


# ------------------------------------------------------------------------------------------------
# corrupt checkpoint files, crash during a save
# ------------------------------------------------------------------------------------------------
def _optim_file(ckpt_dir: str, rank: int) -> str:
    import glob
    import os
    (path,) = glob.glob(os.path.join(ckpt_dir, f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    return path


def _flip_bit(path: str) -> None:
    """Flip one bit in the middle of the largest member's data of a torch.save zip file."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        where = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x04]))


def _corrupt_cases(rank: int, world_size: int, ckpt_dir: str) -> dict:
    import os
    import shutil
    import torch.distributed as dist
    from ds_muon.checkpoint import CheckpointError
    engine, model = build_engine(ds_config(gas=GAS))
    _train_steps(engine, rank, range(1))
    engine.save_checkpoint(ckpt_dir, tag="t1")
    w1 = gathered_params(model)
    _train_steps(engine, rank, range(1, 2))
    engine.save_checkpoint(ckpt_dir, tag="t2")
    engine.destroy()
    leftovers = sorted(f for _, _, fs in os.walk(ckpt_dir) for f in fs if f.endswith(".tmp"))
    if rank == 0:  # three broken copies of t2, each damaging rank 1's optimizer file
        for label in ("truncated", "flipped", "missing"):
            shutil.copytree(os.path.join(ckpt_dir, "t2"), os.path.join(ckpt_dir, label))
            path = _optim_file(os.path.join(ckpt_dir, label), 1)
            if label == "truncated":
                os.truncate(path, os.path.getsize(path) // 2)
            elif label == "flipped":
                _flip_bit(path)
            else:
                os.remove(path)
    dist.barrier()
    out = {"leftovers": leftovers}
    for label in ("truncated", "flipped", "missing"):
        engine, model = build_engine(ds_config(gas=GAS))
        try:
            engine.load_checkpoint(ckpt_dir, tag=label)
            out[label] = None
        except CheckpointError as err:
            out[label] = str(err)
        engine.destroy()
    engine, model = build_engine(ds_config(gas=GAS))
    engine.load_checkpoint(ckpt_dir, tag="t1")  # an intact tag still loads
    got = gathered_params(model)
    out["t1_loads"] = all(torch.equal(got[n], w1[n]) for n in w1)
    engine.destroy()
    return out


def test_corrupt_checkpoint_file_is_named(tmp_path):
    """Rank 1's optimizer file of a tag truncated to half, one bit flipped in it (which torch.load reads
    silently), or removed: loading that tag fails on every rank with a CheckpointError naming the file,
    before DeepSpeed loads anything; an intact tag of the same directory still loads; the atomic save
    leaves no temporary files."""
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_corrupt_cases, 2, ckpt)
    for out in results:
        assert out["leftovers"] == [], out["leftovers"]
        for label, what in (("truncated", "is truncated or damaged"), ("flipped", "fails the CRC-32 check"),
                            ("missing", "has no ZeRO optimizer file of data-parallel rank 1")):
            msg = out[label]
            assert msg is not None and what in msg, (label, msg)
            assert f"{label}/" in msg and ("zero_pp_rank_1_mp_rank_00_optim_states.pt" in msg), (label, msg)
        assert out["t1_loads"], out


def _crash_in_save(rank: int, world_size: int, ckpt_dir: str) -> None:
    """Save t1, then save t2 with rank 1 SIGKILLed halfway through writing its optimizer file (after a
    pause, so rank 0 has written all it would write)."""
    import os
    import signal
    import time
    engine, model = build_engine(ds_config(gas=GAS))
    _train_steps(engine, rank, range(1))
    engine.save_checkpoint(ckpt_dir, tag="t1")
    _train_steps(engine, rank, range(1, 2))
    if rank == 1:
        real_save = torch.save

        def dying_save(obj, f, *args, **kwargs):
            if isinstance(f, str) and "optim_states" in f:
                import io
                buf = io.BytesIO()
                real_save(obj, buf, *args, **kwargs)
                with open(f, "wb") as out:
                    out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                    out.flush()
                time.sleep(5)  # rank 0 finishes its own files meanwhile
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, f, *args, **kwargs)

        torch.save = dying_save
    engine.save_checkpoint(ckpt_dir, tag="t2")


def _after_crash(rank: int, world_size: int, ckpt_dir: str) -> dict:
    from ds_muon.checkpoint import CheckpointError
    out = {}
    engine, model = build_engine(ds_config(gas=GAS))
    path, _ = engine.load_checkpoint(ckpt_dir)  # latest
    out["latest_loaded"] = path
    out["steps"] = engine.optimizer.muon_step_count
    engine.destroy()
    engine, model = build_engine(ds_config(gas=GAS))
    try:
        engine.load_checkpoint(ckpt_dir, tag="t2")
        out["t2"] = None
    except CheckpointError as err:
        out["t2"] = str(err)
    engine.destroy()
    return out


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    """SIGKILL of rank 1 in the middle of writing its optimizer file: `latest` still names t1, t1 loads
    (muon_step_count 1), and loading t2 explicitly is refused: no file of the killed save was renamed into place
    (rank 0's files wait for every rank's, as ``.tmp``), so t2 has no model-states file."""
    import os
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError):
        run_distributed(_crash_in_save, 2, ckpt, timeout=120)
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "t1"
    results = run_distributed(_after_crash, 2, ckpt)
    for out in results:
        assert "/t1/" in out["latest_loaded"] and out["steps"] == 1, out
        assert out["t2"] and "has no mp_rank_00_model_states.pt: the save did not finish" in out["t2"], out["t2"]


# ------------------------------------------------------------------------------------------------
# a dead rank
# ------------------------------------------------------------------------------------------------
DEAD_RANK_DEADLINE_S = 60  # gloo reports a closed peer at once (measured: < 1 s); the bound is generous


def _dead_rank(rank: int, world_size: int, where: str, out_dir: str) -> None:
    """Rank 1 exits (status 0, so the spawner waits for rank 0) in the owner exchange's all_to_all or
    just before DeepSpeed's end-of-backward gradient reduce-scatter, in step 1; rank 0 records the error
    it ends with and how long it took, in ``out_dir/rank0.json``."""
    import json
    import os
    import time
    engine, _ = build_engine(ds_config(gas=1))
    when = {"step": 0}
    if rank == 1:
        opt = engine.optimizer

        def die_in_step_1(real):
            def wrapper(*args, **kwargs):
                if when["step"] == 1:
                    os._exit(0)
                return real(*args, **kwargs)
            return wrapper

        if where == "exchange":
            for exchange in (s.exchange for s in opt.muon_steps.values()):
                exchange._all_to_all = die_in_step_1(exchange._all_to_all)
        else:
            opt.independent_gradient_partition_epilogue = die_in_step_1(opt.independent_gradient_partition_epilogue)
    start, error = None, None
    try:
        for step in range(3):
            when["step"] = step
            if step == 1:
                start = time.monotonic()
            tokens, targets = batch(step, rank, 0)
            engine.backward(engine(tokens, targets, use_extra(step)))
            engine.step()
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        error = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "seconds": time.monotonic() - start}, f)


@pytest.mark.parametrize("where,collective", [("exchange", "the Muon owner exchange (all_to_all)"),
                                              ("reduce_scatter", "DeepSpeed's gradient reduce-scatter")])
def test_dead_rank_ends_the_others_with_a_named_collective(tmp_path, where, collective):
    """Rank 1 exits mid-step; rank 0 ends within DEAD_RANK_DEADLINE_S with a CollectiveError naming the
    collective it was in (no hang until the job's time limit)."""
    import json
    with pytest.raises((RuntimeError, FileNotFoundError)):  # rank 1 reports nothing: it is gone
        run_distributed(_dead_rank, 2, where, str(tmp_path), timeout=DEAD_RANK_DEADLINE_S + 120)
    with open(tmp_path / "rank0.json") as f:
        out = json.load(f)
    assert out["error"] and out["error"].startswith("CollectiveError") and collective in out["error"], out
    assert out["seconds"] < DEAD_RANK_DEADLINE_S, out


# ------------------------------------------------------------------------------------------------
# a full disk under NVMe swap
# ------------------------------------------------------------------------------------------------
def _full_swap_disk(rank: int, world_size: int, nvme_dir: str, free: int) -> str | int:
    """Build an NVMe-offloaded engine with the swap filesystem reporting ``free`` bytes free (an injected
    full disk); the construction error, or the engine's swap_bytes_needed()."""
    import shutil
    from collections import namedtuple
    import ds_muon.integration.nvme as nvme
    from tests.support.models import wide_parity_net
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    nvme.shutil.disk_usage = lambda path: usage(free, 0, free) if free >= 0 else real(path)
    cfg = ds_config(offload_optimizer={"device": "nvme", "nvme_path": nvme_dir})
    try:
        engine, _ = build_engine(cfg, model_fn=wide_parity_net)
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    need = engine.optimizer.swap_bytes_needed()
    engine.destroy()
    return need


def test_full_swap_disk_names_nvme_path_and_bytes(tmp_path):
    """A swap filesystem with too little room (injected: one byte below the need of the node's ranks) is
    refused at initialize, on every rank, before the first swap, naming nvme_path, the bytes needed and
    the bytes free; with real free space the same engine builds."""
    import os
    from tests.support.harness import swap_dir_for
    swap = swap_dir_for(str(tmp_path / "swap"))
    os.makedirs(swap, exist_ok=True)
    need = run_distributed(_full_swap_disk, 2, swap, -1)
    assert all(isinstance(n, int) for n in need), f"the engine did not build with real free space: {need}"
    assert need[0] == need[1] and need[0] > 4 * 262144, need  # both sub-groups swapped (> 1 MiB each)
    short = 2 * need[0] - 1  # LOCAL_WORLD_SIZE = 2 ranks share the filesystem
    for msg in run_distributed(_full_swap_disk, 2, swap, short):
        assert isinstance(msg, str) and msg.startswith("ConfigError"), msg
        assert "offload_optimizer.nvme_path" in msg and f"has {short} bytes free" in msg, msg
        assert f"need {need[0]} bytes per rank ({2 * need[0]} for the 2 rank(s)" in msg, msg


# ------------------------------------------------------------------------------------------------
# soak (short version of scripts/soak.py)
# ------------------------------------------------------------------------------------------------
def test_soak_short():
    """The main job (examples/train.py) for 24 steps in 3 segments: W=2, killed with SIGKILL mid-training after its
    step-8 save; W=1 resumed through the universal path, killed after step 16; W=2 through it again, to the end.
    Against the uninterrupted W=2 run: the first segment is identical, every step's loss within 1e-4 relative
    (measured: identical, as --data-streams 2 keeps the global batch), and no rank's resident or peak resident
    memory grows by more than 32 MiB within a segment."""
    from scripts.soak import soak
    import tempfile
    with tempfile.TemporaryDirectory() as work:
        out = soak(24, 8, work, worlds=(2, 1), warmup=2, extra=("--max-bytes", "200000", "--seq-len", "64"))
    assert out["n_compared"] == 24 and out["worlds"] == [2, 1, 2], out
    assert out["outcomes"] == ["killed", "killed", "exited"], out
    assert out["first_segment_worst_rel_diff"] == 0.0, out  # before any resume: the same run
    assert out["worst_loss_rel_diff"] <= 1e-4, out
    assert out["max_rss_growth_mib"] <= 32.0, out


# ------------------------------------------------------------------------------------------------
# a swap write that fails during the run (after the start-up free-space check)
# ------------------------------------------------------------------------------------------------
SWAP_FAIL_LIMIT = 512 * 1024  # rank 1's file size limit: below every swap file (>= 1 MiB each)
SWAP_FAIL_DEADLINE_S = 60


def _swap_write_fails(rank: int, world_size: int, nvme_dir: str, ckpt_dir: str) -> dict:
    """Save t0, then run step 0 with rank 1's file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) below the
    swap files it creates in that step (gradients, optimizer state): a real kernel write error (EFBIG),
    which DeepSpeed's async I/O completes silently. Each rank records the error it ends the step with and
    how long that took, then tries to save t1."""
    import resource
    import signal
    import time
    from ds_muon.errors import NvmeSwapError
    from tests.support.models import wide_parity_net
    cfg = ds_config(gas=GAS, offload_optimizer={"device": "nvme", "nvme_path": nvme_dir})
    engine, model = build_engine(cfg, model_fn=wide_parity_net)
    out = {"need": engine.optimizer.swap_bytes_needed(), "folder": engine.optimizer.optimizer_swapper.swap_folder}
    engine.save_checkpoint(ckpt_dir, tag="t0")
    out["w0"] = gathered_params(model)
    real_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (SWAP_FAIL_LIMIT, real_limit[1]))
    start = time.monotonic()
    try:
        _train_steps(engine, rank, range(1))
        out["step"] = None
    except Exception as err:  # noqa: BLE001 - the type and message are what is checked
        out["step"] = f"{type(err).__name__}: {err}"
    out["seconds"] = time.monotonic() - start
    resource.setrlimit(resource.RLIMIT_FSIZE, real_limit)  # the save below is refused by ds_muon, not the limit
    try:
        engine.save_checkpoint(ckpt_dir, tag="t1")
        out["save"] = None
    except NvmeSwapError as err:
        out["save"] = str(err)
    return out


def _load_after_swap_failure(rank: int, world_size: int, nvme_dir: str, ckpt_dir: str) -> dict:
    from tests.support.models import wide_parity_net
    cfg = ds_config(gas=GAS, offload_optimizer={"device": "nvme", "nvme_path": nvme_dir})
    engine, model = build_engine(cfg, model_fn=wide_parity_net)
    torch.manual_seed(1)  # the live weights differ from t0's until it is loaded
    for p in model.parameters():
        p.ds_tensor.data.add_(torch.randn_like(p.ds_tensor.data))
    path, _ = engine.load_checkpoint(ckpt_dir)
    out = {"path": path, "weights": gathered_params(model)}
    _train_steps(engine, rank, range(1))  # and trains on, swap files intact
    out["finite"] = all(torch.isfinite(t).all() for t in gathered_params(model).values())
    return out


def test_swap_write_error_during_the_run_named_on_every_rank(tmp_path):
    """Rank 1's NVMe swap writes fail in step 0 (a real EFBIG from the kernel, which DeepSpeed's async I/O
    ignores): both ranks end that step with NvmeSwapError within SWAP_FAIL_DEADLINE_S (rank 0 does not wait
    in a collective), naming nvme_path, the bytes per rank, rank 1's sub-group and file, and the OS error;
    saving afterwards is refused on both, `latest` still names t0, and t0 loads (weights equal) and trains."""
    import os
    from tests.support.harness import swap_dir_for
    swap, ckpt = swap_dir_for(str(tmp_path / "swap")), str(tmp_path / "ckpt")
    os.makedirs(swap, exist_ok=True)
    results = run_distributed(_swap_write_fails, 2, swap, ckpt, timeout=SWAP_FAIL_DEADLINE_S + 240)
    for rank, out in enumerate(results):
        msg = out["step"]
        assert msg and msg.startswith("NvmeSwapError: ds_muon: the NVMe optimizer swap failed during an "
                                      "optimizer step"), (rank, msg)
        assert "zero_optimization.offload_optimizer.nvme_path" in msg and out["folder"] in msg, msg
        assert f"the optimizer swap files need {out['need']} bytes per rank" in msg, msg
        assert "rank 1, ZeRO sub-group " in msg and "rank 0," not in msg, msg
        assert f"of {os.path.join(results[1]['folder'], '')}" in msg, msg  # rank 1's failing file
        assert "[Errno 27] File too large" in msg and f"(ulimit -f) is {SWAP_FAIL_LIMIT} bytes" in msg, msg
        assert out["seconds"] < SWAP_FAIL_DEADLINE_S, out["seconds"]
        assert out["save"] and "is not stepped or saved any more" in out["save"], out["save"]
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "t0"
    swap2 = swap_dir_for(str(tmp_path / "swap2"))
    os.makedirs(swap2, exist_ok=True)
    loaded = run_distributed(_load_after_swap_failure, 2, swap2, ckpt)
    for out in loaded:
        assert "/t0/" in out["path"], out["path"]
        w0 = results[0]["w0"]
        assert all(torch.equal(out["weights"][n], w0[n]) for n in w0), "t0 did not load intact"
        assert out["finite"]


# ------------------------------------------------------------------------------------------------
# a disk that fills during the run (a real, small ext4 filesystem: tests/support/small_fs.py)
# ------------------------------------------------------------------------------------------------
DISK_FULL_DEADLINE_S = 120  # a failed save or swap ends on every rank at once; a hang would last 30 minutes


def _tag_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _save_fills_disk(rank: int, world_size: int, ckpt_dir: str, stage: int) -> dict:
    """Save t1 into the small filesystem, train a step, fill the filesystem but a third of t1's bytes, save t2
    (fails), look at what is left, try to load t2; free the space, save t2 again; record each rank's view."""
    import time
    import torch.distributed as dist
    from ds_muon.errors import CheckpointError
    from tests.support.small_fs import fill, unfill
    engine, model = build_engine(ds_config(gas=GAS, stage=stage))
    _train_steps(engine, rank, range(1))
    engine.save_checkpoint(ckpt_dir, tag="t1")
    out = {"w1": gathered_params(model), "t1_bytes": _tag_bytes(os.path.join(ckpt_dir, "t1"))}
    _train_steps(engine, rank, range(1, 2))
    if rank == 0:
        out["free"] = fill(ckpt_dir, out["t1_bytes"] // 3)
    dist.barrier()
    start = time.monotonic()
    try:
        engine.save_checkpoint(ckpt_dir, tag="t2")
        out["save"] = None
    except CheckpointError as err:
        out["save"] = str(err)
    out["seconds"] = time.monotonic() - start
    dist.barrier()
    with open(os.path.join(ckpt_dir, "latest")) as f:
        out["latest_after_failure"] = f.read().strip()
    t2 = os.path.join(ckpt_dir, "t2")
    out["t2_left"] = sorted(os.listdir(t2)) if os.path.isdir(t2) else []
    try:
        engine.load_checkpoint(ckpt_dir, tag="t2")
        out["t2_load"] = None
    except CheckpointError as err:
        out["t2_load"] = str(err)
    dist.barrier()
    if rank == 0:
        unfill(ckpt_dir)
    dist.barrier()
    engine.save_checkpoint(ckpt_dir, tag="t2")  # space freed: the same engine saves
    with open(os.path.join(ckpt_dir, "latest")) as f:
        out["latest_after_retry"] = f.read().strip()
    out["w2"] = gathered_params(model)
    engine.destroy()
    for tag in ("t1", "t2"):  # a fresh run resumes from either
        engine, model = build_engine(ds_config(gas=GAS, stage=stage))
        engine.load_checkpoint(ckpt_dir, tag=tag)
        out[f"{tag}_loaded"] = gathered_params(model)
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [3, 2])
def test_save_into_a_full_disk_fails_on_every_rank_and_keeps_latest(tmp_path, stage):
    """``save_checkpoint`` into a real filesystem that fills during the save (ext4 on a loop device, 24 MiB, filled
    to a third of a tag's bytes): every rank raises the same CheckpointError within DISK_FULL_DEADLINE_S (no rank
    waits in a barrier), naming the tag, a failed file, the bytes it needed and the bytes free; ``latest`` still
    names t1; no file of t2 is left in place (no ``.tmp`` either) and loading t2 is refused naming a missing file;
    after the space is freed the same engine saves t2, ``latest`` names it, and fresh engines load t1 and t2
    bit-identical to what was saved."""
    from tests.support.small_fs import small_filesystem
    with small_filesystem(tmp_path, 24) as mnt:
        ckpt = str(mnt / "ckpt")
        results = run_distributed(_save_fills_disk, 2, ckpt, stage, timeout=DISK_FULL_DEADLINE_S + 300)
    msgs = [out["save"] for out in results]
    assert msgs[0] and msgs[0] == msgs[1], msgs
    msg = msgs[0]
    assert msg.startswith(f"ds_muon: save_checkpoint({ckpt!r}, tag='t2') failed, on every rank"), msg
    assert "`latest` still names 't1'" in msg, msg
    assert "No space left on device" in msg, msg
    assert f"writing {os.path.join(ckpt, 't2', '')}" in msg and "bytes (its tensors)" in msg, msg
    assert " bytes free" in msg, msg
    for out in results:
        assert out["seconds"] < DISK_FULL_DEADLINE_S, out["seconds"]
        assert out["latest_after_failure"] == "t1", out["latest_after_failure"]
        assert [f for f in out["t2_left"] if f.endswith(".pt") or f.endswith(".tmp")] == [], out["t2_left"]
        assert out["t2_load"] and "the save did not finish" in out["t2_load"], out["t2_load"]
        assert out["latest_after_retry"] == "t2"
        for tag, want in (("t1", out["w1"]), ("t2", out["w2"])):
            assert all(torch.equal(out[f"{tag}_loaded"][n], want[n]) for n in want), f"{tag} did not load intact"
    assert any(not torch.equal(results[0]["w1"][n], results[0]["w2"][n]) for n in results[0]["w1"])


def _tag_files(folder: str) -> dict:
    """``{relative path: bytes}`` of every file under ``folder``."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), folder)] = fh.read()
    return out


def _resave_fills_disk(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Save t1, train a step, fill the filesystem but a third of t1's bytes, save t1 again (fails); record t1's files
    before and after and load t1 into a fresh engine; free the space, save t1 again (succeeds) and load it."""
    import torch.distributed as dist
    from ds_muon.errors import CheckpointError
    from tests.support.small_fs import fill, unfill
    engine, model = build_engine(ds_config(gas=GAS))
    _train_steps(engine, rank, range(1))
    engine.save_checkpoint(ckpt_dir, tag="t1")
    t1 = os.path.join(ckpt_dir, "t1")
    out = {"w1": gathered_params(model), "files_before": _tag_files(ckpt_dir) if rank == 0 else None}
    _train_steps(engine, rank, range(1, 2))
    if rank == 0:
        out["free"] = fill(ckpt_dir, _tag_bytes(t1) // 3)
    dist.barrier()
    try:
        engine.save_checkpoint(ckpt_dir, tag="t1")
        out["save"] = None
    except CheckpointError as err:
        out["save"] = str(err)
    dist.barrier()
    if rank == 0:
        unfill(ckpt_dir)
        out["files_after"] = _tag_files(ckpt_dir)
    w2 = gathered_params(model)
    engine.destroy()
    engine, model = build_engine(ds_config(gas=GAS))
    engine.load_checkpoint(ckpt_dir)  # latest = t1, the first save
    out["t1_loaded"] = gathered_params(model)
    out["steps_loaded"] = engine.optimizer.muon_step_count
    engine.destroy()
    engine, model = build_engine(ds_config(gas=GAS))
    _train_steps(engine, rank, range(2))
    engine.save_checkpoint(ckpt_dir, tag="t1")  # space freed: the same tag is overwritten, whole
    out["w2_retry"] = gathered_params(model)
    engine.destroy()
    engine, model = build_engine(ds_config(gas=GAS))
    engine.load_checkpoint(ckpt_dir, tag="t1")
    out["t1_reloaded"] = gathered_params(model)
    out["w2"] = w2
    engine.destroy()
    return out


def test_failed_save_over_an_existing_tag_keeps_its_previous_files(tmp_path):
    """``save_checkpoint`` to an existing tag (t1, also ``latest``) into a filesystem that fills during the save (ext4
    on a loop device, filled to a third of the tag's bytes): every rank raises the same CheckpointError, which says
    the previous save of the tag keeps all its files; every file of the directory is byte-identical to before the
    failed save (no ``.tmp`` or staging folder left); a fresh engine loads t1 with the first save's weights and step
    count. After the space is freed, saving t1 again replaces it whole (it loads with the new weights).
    (Fails with files renamed into place as they are written: the tag then loses the files the failed save had
    replaced.)"""
    from tests.support.small_fs import small_filesystem
    with small_filesystem(tmp_path, 24) as mnt:
        ckpt = str(mnt / "ckpt")
        results = run_distributed(_resave_fills_disk, 2, ckpt, timeout=DISK_FULL_DEADLINE_S + 300)
    msgs = [out["save"] for out in results]
    assert msgs[0] and msgs[0] == msgs[1], msgs
    assert "a previous save of tag 't1', if any, keeps all its files" in msgs[0], msgs[0]
    assert "`latest` still names 't1'" in msgs[0] and "No space left on device" in msgs[0], msgs[0]
    before, after = results[0]["files_before"], results[0]["files_after"]
    assert sorted(after) == sorted(before), (sorted(before), sorted(after))
    assert all(after[name] == before[name] for name in before), [n for n in before if after[n] != before[n]]
    for out in results:
        assert out["steps_loaded"] == 1, out["steps_loaded"]
        assert all(torch.equal(out["t1_loaded"][n], out["w1"][n]) for n in out["w1"]), "t1 did not survive intact"
        assert all(torch.equal(out["t1_reloaded"][n], out["w2_retry"][n]) for n in out["w1"]), "the retry did not replace t1"
        assert any(not torch.equal(out["w1"][n], out["w2"][n]) for n in out["w1"])


class _FakeAio:
    """A stand-in for DeepSpeed's aio handle: ``async_pwrite`` fails (-1) for paths in ``fail``."""

    def __init__(self, fail):
        self.fail, self.pending = fail, 0

    def async_pwrite(self, buffer, path, offset=0):
        if path in self.fail:
            return -1
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            f.seek(offset)
            f.write(buffer.numpy().tobytes())
        self.pending += 1
        return 0

    def wait(self):
        assert self.pending > 0  # as the real handle's C++ assert
        done, self.pending = self.pending, 0
        return done

    def is_pinned(self, buffer):
        return True


def test_checked_aio_handle_reports_failed_submissions_and_short_files(tmp_path):
    """The swapper's handle wrapper: a write that cannot start (no directory: ENOENT) is reported with the OS
    error and counted as completed by wait() (DeepSpeed asserts the count); a write that leaves the file short
    is reported with the sizes; good writes report nothing; other attributes are the wrapped handle's."""
    from ds_muon.integration.nvme import _CheckedAioHandle
    errors = []
    missing = str(tmp_path / "gone" / "1_2.tensor.swp")
    handle = _CheckedAioHandle(_FakeAio({missing}), lambda *e: errors.append(e))
    good, short = str(tmp_path / "a.swp"), str(tmp_path / "b.swp")
    data = torch.arange(256, dtype=torch.float32)
    assert handle.async_pwrite(data, good, 0) == 0 and handle.async_pwrite(data, missing, 0) == 0
    assert handle.wait() == 2 and len(errors) == 1
    path, write, nbytes, cause = errors[0]
    assert (path, write, nbytes) == (missing, True, 1024) and "[Errno 2] No such file or directory" in cause, errors
    handle._handle.async_pwrite = lambda b, p, o=0: (_FakeAio.async_pwrite(handle._handle, b[: b.numel() // 2], p, o))
    assert handle.async_pwrite(data, short, 0) == 0 and handle.wait() == 1
    assert errors[1][:3] == (short, True, 1024) and "the file holds 512 of 1024 bytes" in errors[1][3], errors
    del handle._handle.async_pwrite  # writes whole again
    assert handle.is_pinned(data) and handle.async_pwrite(data, good, 1024) == 0 and handle.wait() == 1
    assert len(errors) == 2


def test_named_collective_wraps_collective_errors_only():
    """In process, no ranks: a backend's error (DistBackendError, gloo's plain RuntimeError text, an error
    raised under torch.distributed's frames) becomes a CollectiveError naming the collective; any other
    RuntimeError passes through unchanged (same object, own message)."""
    import torch.distributed as dist
    from ds_muon.errors import CollectiveError
    from ds_muon.sharded.collectives import named_collective as _named_collective

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19861: "
                        "Connection reset by peer")

    def raised_in(module):  # a plain RuntimeError raised by code of ``module``'s folder
        import os
        namespace: dict = {}
        code = "def comm_call():\n    raise RuntimeError('mismatched collective')\n"
        exec(compile(code, os.path.join(os.path.dirname(module.__file__), "simulated.py"), "exec"), namespace)
        return namespace["comm_call"]

    import deepspeed.comm
    for cause in (dist.DistBackendError("NCCL error: remote process exited"), gloo, raised_in(dist),
                  raised_in(deepspeed.comm)):
        with pytest.raises(CollectiveError, match="the test all_reduce failed on rank 0") as info:
            with _named_collective("the test all_reduce"):
                raise cause if isinstance(cause, BaseException) else cause()
        assert "peer rank probably exited" in str(info.value) and info.value.__cause__ is not None
    ordinary = RuntimeError("The size of tensor a (3) must match the size of tensor b (4)")
    with pytest.raises(RuntimeError) as info:
        with _named_collective("the test all_reduce"):
            raise ordinary
    assert info.value is ordinary and not isinstance(info.value, CollectiveError)
