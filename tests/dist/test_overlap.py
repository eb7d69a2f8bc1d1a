"""The overlapped Muon step (``optimizer.params.overlap_backward``, ds_muon/sharded/overlap.py) is exact.

CPU, gloo: no streams, so the speculative step runs inline in the last micro-batch's backward, which tests its
logic and its exactness (the GPU timing is the benchmark's). Each case trains the parity model (or a real MoE,
transformers' Mixtral from a config) with overlap on and with overlap off in the same process group and requires
the two end states bit for bit equal (weights, momentum, AdamW state, step counts); the plain case also checks the
oracle at test_zero3_parity.py's tolerances. The fallback counters say which path ran: clipping that fires on
every step must fall back on every Muon sub-group step, clipping that never fires must commit the speculation, and
an expert without tokens (a zero-gradient block of a stacked parameter) commits with that block set aside. One
process group per world size runs every case.
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import pytest
import torch

from tests.support import families
from tests.support.harness import (PARITY_RTOL, EventMonitor, build_engine, clone_tags, compare, ds_config,
                                   gathered_params, momentum_dtypes, reference_model, resume_phase, state_snapshot,
                                   train_engine, train_reference)
from tests.support.models import ParityNet
from tests.support.spawn import run_distributed

STEPS = 4

CASES = [
    {"name": "plain", "oracle": True},
    {"name": "gas2", "gas": 2},
    {"name": "bf16", "bf16": True, "params": {"ns_dtype": "bfloat16", "exchange_dtype": "bfloat16"}},
    # bf16 momentum (the built-in's state precision; the benchmark's like-for-like memory arm): the speculation
    # reads a copy of the bf16 momentum and the commit rounds as the ordinary step does
    {"name": "bf16_momentum", "bf16": True, "gas": 2,
     "params": {"momentum_dtype": "bfloat16", "ns_dtype": "bfloat16", "exchange_dtype": "bfloat16"}},
    {"name": "clip_every_step", "clip": 1e-4},
    {"name": "clip_never", "clip": 1e6},
    {"name": "no_nesterov", "params": {"nesterov": False}},
    {"name": "small_buckets", "params": {"exchange_bucket_mb": 1e-4}},
    # many ipg flushes (partition_grads calls) and several sub-groups; the all-reduce path of DeepSpeed
    {"name": "small_ipg_subgroups", "zero": {"reduce_bucket_size": 100, "sub_group_size": 500}},
    {"name": "allreduce_gas2_clip", "gas": 2, "clip": 0.5,
     "zero": {"reduce_scatter": False, "contiguous_gradients": False, "overlap_comm": True}},
    # an expert without tokens: one block of the stacked experts gets an exactly zero gradient on even steps while
    # the parameter gets one, so the speculation completes and the commit sets that block aside
    {"name": "idle_expert", "idle_expert": True},
    # a real MoE (transformers' Mixtral, 8 stacked experts, top 1, from a config): experts that route no token in a
    # step, as the router decides (at W = 1 and 2 in most steps here; at W = 4 the 64 tokens reach every expert)
    {"name": "mixtral_top1", "model": families.mixtral},
    # overlap paused on odd steps (OverlapHooks.overlap_paused, the benchmark's bench.alternate_overlap): every step
    # is exact either way, and only the overlapped steps commit
    {"name": "alternate", "alternate": True},
    {"name": "alternate_gas2", "alternate": True, "gas": 2},
]


class Trained(NamedTuple):
    """One case trained by :func:`_train`. ``state``: :func:`state_snapshot` (weights, momentum, AdamW state, step
    counts); ``stats``: the optimizer's ``overlap_stats``; ``init``/``tags``: the parameters before training and their
    Muon tags (for the oracle); ``got``: the trained parameters gathered; ``cfg``: the DeepSpeed config used;
    ``momentum_dtypes``: :func:`momentum_dtypes`; ``bucket``: ``(engine.zero_reduce_bucket_size(), the ZeRO
    optimizer's reduce_bucket_size)`` in elements."""
    state: dict
    stats: dict
    init: dict
    tags: dict
    got: dict
    cfg: dict
    momentum_dtypes: dict
    bucket: tuple


def _train(rank: int, case: dict, overlap: bool, steps: int = STEPS) -> Trained:
    cfg = ds_config(gas=case.get("gas", 1), clip=case.get("clip", 0.0), **case.get("zero", {}))
    cfg["optimizer"]["params"].update(case.get("params", {}), overlap_backward=overlap)
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    cfg.update(case.get("config", {}))  # further top-level sections
    torch.manual_seed(0)
    engine, model = build_engine(cfg, model_fn=case.get("model", ParityNet))
    init, tags = gathered_params(model), clone_tags(model)
    if case.get("idle_expert"):
        model.experts.register_hook(idle_expert_hook(engine))
    if case.get("alternate"):  # odd steps paused: the benchmark's paired overlapped / ordinary steps
        monitor = EventMonitor()
        engine.optimizer.attach_monitor(monitor, lambda: engine.global_steps)
        if overlap:
            check_pause_guards(engine)
        for step in range(steps):
            with engine.optimizer.overlap_paused() if step % 2 else contextlib.nullcontext():
                train_engine(engine, 1, rank, case.get("gas", 1), start=step)
        # the monitor's overlap counters come every step, the paused ones too (none with overlap off)
        written = [s for name, _, s in monitor.events if name == "Train/ds_muon/overlap/commits"]
        assert written == (list(range(steps)) if overlap else []), written
    else:
        train_engine(engine, steps, rank, case.get("gas", 1))
    state = state_snapshot(engine)
    stats = dict(engine.optimizer.overlap_stats)
    got = gathered_params(model)
    dtypes = momentum_dtypes(engine)
    bucket = (engine.zero_reduce_bucket_size(), int(engine.optimizer.reduce_bucket_size))
    engine.destroy()
    return Trained(state, stats, init, tags, got, cfg, dtypes, bucket)


def check_pause_guards(engine) -> None:
    """``overlap_paused`` refuses a second entry while paused and, whatever ends the ``with`` (an exception too),
    gives the speculative step back; AssertionError otherwise."""
    opt = engine.optimizer
    spec = opt.speculative
    assert spec is not None
    with pytest.raises(KeyError):
        with opt.overlap_paused():
            assert opt.speculative is None and opt.overlap_stats == spec.stats()
            with pytest.raises(RuntimeError, match="between optimizer steps, once at a time"):
                with opt.overlap_paused():
                    pass
            raise KeyError("user code failed inside the pause")
    assert opt.speculative is spec and opt._paused is None


def idle_expert_hook(engine, expert: int = 1):
    """A gradient hook for ParityNet's stacked ``experts`` ``(3, dim, expert)``: on even optimizer steps (those where
    ``extra`` has a gradient, so that the rest of the sub-group can be speculated) its block ``expert`` gets an
    exactly zero gradient, as an expert that routed no token has (the parameter as a whole still has a gradient)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if engine.global_steps % 2 == 1:
            return grad
        grad = grad.clone()
        grad[expert] = 0
        return grad
    return hook


@contextlib.contextmanager
def deepspeed_unscale_calls():
    """Count the calls that reach DeepSpeed's own ``unscale_and_clip_grads`` (ZeRO-3's and ZeRO-1/2's) while the
    block runs; yields ``[count]``. ds_muon skips the call where its factor is exactly 1 and known so on the host
    (``DsMuonZeroSteps.unscale_and_clip_grads``)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    calls, saved = [0], {cls: cls.unscale_and_clip_grads for cls in (DeepSpeedZeroOptimizer_Stage3,
                                                                       DeepSpeedZeroOptimizer)}

    def counted(real):
        def call(self, *args, **kwargs):
            calls[0] += 1
            return real(self, *args, **kwargs)
        return call

    for cls, real in saved.items():
        cls.unscale_and_clip_grads = counted(real)
    try:
        yield calls
    finally:
        for cls, real in saved.items():
            cls.unscale_and_clip_grads = real


def train_on_off(rank: int, world_size: int, cases: list[dict]) -> dict:
    """Each case trained with overlap on and off: the end states equal bit for bit (else AssertionError naming the
    case); per case its ``overlap_stats`` on and off and, for an ``"oracle"`` case on rank 0, its oracle errors."""
    from tests.support.harness import assert_same_state
    out = {}
    for case in cases:
        with deepspeed_unscale_calls() as on_calls:
            on = _train(rank, case, True)
        with deepspeed_unscale_calls() as off_calls:
            off = _train(rank, case, False)
        assert_same_state(on.state, off.state, f"{case['name']} W={world_size}")
        out[case["name"]] = {"stats": on.stats, "off_stats": off.stats, "momentum_dtypes": on.momentum_dtypes,
                             "reduce_bucket_size": {"on": on.bucket, "off": off.bucket},
                             "unscale_calls": {"on": on_calls[0], "off": off_calls[0]}}
        if case.get("oracle") and rank == 0:
            out[case["name"]]["errors"] = oracle_errors(case, on.cfg, on.init, on.tags, on.got, world_size)
    return out


def oracle_errors(case: dict, cfg: dict, init: dict, tags: dict, got: dict, world_size: int) -> dict:
    """Per-parameter errors (:func:`tests.support.harness.compare`) of ``got`` against the oracle ``MuonAdamW``
    trained from ``init`` on every rank's micro-batches with the case's settings."""
    import ds_muon
    ref = reference_model(init, tags)
    opt = ds_muon.MuonAdamW(ref.parameters(), **{k: v for k, v in cfg["optimizer"]["params"].items()
                                                 if k != "overlap_backward"})
    train_reference(ref, opt, STEPS, world_size, case.get("gas", 1), case.get("clip", 0.0))
    return compare(got, {n: p.detach() for n, p in ref.named_parameters()}, init)


def check_oracle(errors: dict) -> None:
    """Every parameter within ``PARITY_RTOL`` of the oracle's, and of its update 1e-3 where it moved (the ZeRO-3
    and ZeRO-1/2 parity tests' fp32 tolerances)."""
    for pname, err in errors.items():
        assert err["rel"] <= PARITY_RTOL, f"{pname} rel error {err['rel']:.2e}"
        if err["moved"] > 0:
            assert err["rel_update"] <= 1e-3, f"{pname} update rel error {err['rel_update']:.2e}"


def check_unscale_calls(r: dict) -> dict:
    """Assert the calls of DeepSpeed's ``unscale_and_clip_grads`` that :func:`train_on_off` counted: none without
    clipping (``plain``), every step's with clipping that fires (``clip_every_step``), none with overlap on and some
    with it off where clipping never fires; returns ``clip_never``'s counts."""
    assert r["plain"]["unscale_calls"] == {"on": 0, "off": 0}, r["plain"]
    assert min(r["clip_every_step"]["unscale_calls"].values()) >= STEPS, r["clip_every_step"]
    never = r["clip_never"]["unscale_calls"]
    assert never["on"] == 0 and never["off"] >= STEPS, r["clip_never"]
    return never


def _cases(rank: int, world_size: int, ckpt_root: str) -> dict:
    out = train_on_off(rank, world_size, CASES)
    out.update(resume_and_evaluation(rank, world_size, ckpt_root))
    return out


def resume_and_evaluation(rank: int, world_size: int, ckpt_root: str, zero: dict | None = None) -> dict:
    """With overlap on (``zero``: the ``zero_optimization`` keys, ZeRO-3 by default): a resumed run ends as the
    continuous one, and a boundary backward never followed by a step leaves nothing behind (the next window ends
    as with overlap off); bit for bit, else AssertionError. Returns ``{"resume": {"stats": ...}, "eval_stats": ...}``."""
    from tests.support.harness import assert_same_state
    out = {}
    # resume: save after 2 steps with overlap on, load into a fresh overlapped engine, 2 more steps == continuous
    cfg = ds_config(**(zero or {}))
    cfg["optimizer"]["params"]["overlap_backward"] = True
    ckpt = os.path.join(ckpt_root, "resume")
    snaps = {}
    for mode in ("continuous", "save", "load"):
        torch.manual_seed(0)
        engine, _ = build_engine(cfg)
        snaps[mode] = resume_phase(engine, rank, mode, ckpt, "t", 2, STEPS, 1, state_snapshot)
        snaps[mode + "_stats"] = dict(engine.optimizer.overlap_stats)
        engine.destroy()
    assert_same_state(snaps["load"][1], snaps["continuous"], f"resume W={world_size}")
    out["resume"] = {"stats": snaps["load_stats"]}
    # a boundary backward never followed by a step (evaluation) leaves nothing behind: the next window is exact
    from tests.support.models import batch, use_extra
    on_off = []
    for overlap in (True, False):
        torch.manual_seed(0)
        engine, _ = build_engine({**cfg, "optimizer": {"type": "Muon", "params": {**cfg["optimizer"]["params"],
                                                                                  "overlap_backward": overlap}}})
        tokens, targets = batch(99, rank, 0)
        engine.backward(engine(tokens, targets, True))  # no step
        engine.optimizer.zero_grad()
        train_engine(engine, 2, rank, 1)
        on_off.append(state_snapshot(engine))
        out.setdefault("eval_stats", dict(engine.optimizer.overlap_stats))
        engine.destroy()
    assert_same_state(on_off[0], on_off[1], f"backward without step W={world_size}")
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_overlap_exact(world_size, tmp_path):
    results = run_distributed(_cases, world_size, str(tmp_path), timeout=900)
    r = results[0]
    # which path ran: every case has two Muon-step kinds of window (the parity model's `extra` layer has no
    # gradient on odd steps, so its sub-group cannot be speculated there)
    assert r["plain"]["stats"]["commits"] > 0, r["plain"]["stats"]
    assert r["plain"]["off_stats"]["commits"] == 0
    assert r["clip_never"]["stats"]["commits"] > 0 and r["clip_never"]["stats"]["fallback_clip"] == 0, r["clip_never"]
    every = r["clip_every_step"]["stats"]
    assert every["commits"] == 0 and every["fallback_clip"] > 0, every
    # DeepSpeed's unscale_and_clip_grads (a full pass over every fp32 gradient) runs only where its factor may not
    # be 1: skipped without clipping, and with clipping that the overlapped step knows does not fire
    assert check_unscale_calls(r) == r["clip_never"]["unscale_calls"], r["clip_never"]
    assert r["bf16_momentum"]["momentum_dtypes"] == ["torch.bfloat16"], r["bf16_momentum"]
    assert r["plain"]["momentum_dtypes"] == ["torch.float32"], r["plain"]
    # with bf16 gradients and fp32 momentum every commit reads the gradient slice in place (no float32 copy); with
    # fp32 gradients, or bf16 momentum, none does
    assert r["bf16"]["stats"]["commits_from_grad"] == r["bf16"]["stats"]["commits"] > 0, r["bf16"]["stats"]
    for name in ("plain", "gas2", "clip_never", "bf16_momentum", "mixtral_top1"):
        assert r[name]["stats"]["commits_from_grad"] == 0, (name, r[name]["stats"])
    for name in ("gas2", "bf16", "bf16_momentum", "no_nesterov", "small_buckets", "small_ipg_subgroups", "resume"):
        assert r[name]["stats"]["commits"] > 0, (name, r[name])
    # the idle expert's steps committed with the block set aside (2 of 4 steps), not recomputed
    assert r["idle_expert"]["stats"]["commits_idle_blocks"] >= 2, r["idle_expert"]
    assert r["plain"]["stats"]["commits_idle_blocks"] == 0, r["plain"]
    mixtral = r["mixtral_top1"]["stats"]  # every step committed, none fell back
    assert mixtral["commits"] == STEPS and sum(v for k, v in mixtral.items() if k.startswith("fallback_")) == 0, mixtral
    if world_size <= 2:
        assert mixtral["commits_idle_blocks"] > 0, mixtral
    assert r["eval_stats"]["commits"] > 0, r["eval_stats"]
    check_oracle(r["plain"]["errors"])  # test_zero3_parity.py's tolerances
    # reduce_bucket_size unset: the overlapped step runs with ds_muon's bucket (engine and ZeRO optimizer agree),
    # without it DeepSpeed's default; a set value is kept either way
    from ds_muon.integration.overlap import OVERLAP_REDUCE_BUCKET_SIZE
    assert r["plain"]["reduce_bucket_size"] == {"on": (OVERLAP_REDUCE_BUCKET_SIZE,) * 2,
                                                "off": (500_000_000,) * 2}, r["plain"]
    assert r["small_ipg_subgroups"]["reduce_bucket_size"] == {"on": (100, 100), "off": (100, 100)}
    # every rank took the same path
    assert all(x["plain"]["stats"] == r["plain"]["stats"] for x in results)
    check_alternate(r)


def check_alternate(r: dict) -> None:
    """The ``alternate`` case (odd steps paused) against ``plain``: ParityNet's ``extra`` layer has no gradient on
    odd steps, so ``plain`` commits on the even steps and counts its odd steps ``not_ready``. With the odd steps
    paused, the even steps still commit (the pause ended each time) and the paused steps count nothing."""
    alt, plain = r["alternate"]["stats"], r["plain"]["stats"]
    assert alt["commits"] == plain["commits"] > 0, (alt, plain)
    assert alt["fallback_not_ready"] == 0 < plain["fallback_not_ready"], (alt, plain)
    if "alternate_gas2" in r:  # with gradient accumulation: the same, the pause entered between windows
        gas2, alt2 = r["gas2"]["stats"], r["alternate_gas2"]["stats"]
        assert alt2["commits"] == gas2["commits"] > 0 and alt2["fallback_not_ready"] == 0, (alt2, gas2)


def _fp16_overflow(rank: int, world_size: int) -> dict:
    """fp16, dynamic loss scale, step 2's loss times NaN (skipped): overlap on and off end bit for bit equal, and
    the skipped step's speculation is dropped (counted as an overflow fallback)."""
    from tests.support.harness import assert_same_state
    from tests.support.models import batch, use_extra
    states, stats = [], []
    for overlap in (True, False):
        cfg = ds_config()
        cfg["optimizer"]["params"]["overlap_backward"] = overlap
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        torch.manual_seed(0)
        engine, _ = build_engine(cfg)
        for step in range(4):
            tokens, targets = (t.to(engine.device) for t in batch(step, rank, 0))
            loss = engine(tokens, targets, use_extra(step))
            engine.backward(loss * float("nan") if step == 2 else loss)
            engine.step()
        states.append(state_snapshot(engine))
        stats.append(dict(engine.optimizer.overlap_stats))
        engine.destroy()
    assert_same_state(states[0], states[1], f"fp16 overflow W={world_size}")
    return stats[0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_overlap_fp16_overflow(world_size):
    from tests.support.precision import FP16_SKIP, fp16_supported
    if not fp16_supported():
        pytest.skip(FP16_SKIP)
    stats = run_distributed(_fp16_overflow, world_size, timeout=600)[0]
    assert stats["fallback_overflow"] > 0 and stats["commits"] > 0, stats


def _offload(rank: int, world_size: int) -> dict:
    """CPU optimizer offload keeps today's step: "auto" builds no speculative step; true is refused."""
    from ds_muon.errors import ConfigError
    out = {}
    for setting in ("auto", True):  # "auto" is off on the CPU anyway; offload must keep it off on CUDA too
        cfg = ds_config(offload_optimizer={"device": "cpu"})
        cfg["optimizer"]["params"]["overlap_backward"] = setting
        try:
            engine, _ = build_engine(cfg)
        except ConfigError as exc:
            out[str(setting)] = str(exc)
            continue
        train_engine(engine, 1, rank, 1)
        out[str(setting)] = engine.optimizer.speculative
        engine.destroy()
    return out


def test_overlap_offload_keeps_todays_step():
    out = run_distributed(_offload, 1, timeout=600)[0]
    assert out["auto"] is None, out
    assert "overlap_backward is true" in out["True"] and "offload_optimizer" in out["True"], out
