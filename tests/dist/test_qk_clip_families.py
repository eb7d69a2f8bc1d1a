"""QK-clip on the model families with their own rule (issue 26), under ZeRO, against the single-device oracle.

The rules themselves, one process, are tests/unit/test_qk_clip_families.py; Llama/Qwen2/Phi-3/declared attention
under ZeRO are tests/dist/test_qk_clip.py. Here, W = 2 on CPU/gloo, one process group for every case:

* ZeRO-3: DeepSeek-V3 MLA without ``q_lora_rank`` (``q_proj``) and with it (``q_b_proj``, through the production
  ``ds_muon_sdpa`` recording): q_C/k_C by gamma^alpha/gamma^(1-alpha), q_R by gamma, the shared k_R untouched;
  Qwen3 (q/k-norm gains shared by all heads: one gamma per layer); Gemma 3 (the same, gains applied as ``1 + w``);
  OLMo 2 (q/k-norm gains per head); GPT-NeoX (interleaved fused ``query_key_value``, per head ``[q; k; v]``, with
  biases); GPT-OSS (eager-only, attention sinks, q/k biases, MoE experts) through ``ds_muon_eager``.
* ZeRO-2: DeepSeek-V3 MLA with ``q_lora_rank`` (its strided per-head rows cut by the flat partitions' boundaries).
* ZeRO-3 GPT-NeoX with ``until_step: 2``: steps 1 and 2 clip, step 3 neither clips nor reports figures; and the
  same across checkpoints: saved after step 1 and after step 2, a fresh engine loads step 2's (its max-logit
  recording stopped at once, step 3 without figures), then step 1's into itself (recording again) and trains steps
  2 and 3, against the oracle saved after step 1 and resumed from its state dict in a fresh oracle.
* The refusal of a non-recording ``attn_implementation`` (GPT-OSS with ``"eager"``) at ``ds_muon.initialize``.

Each case trains 3 optimizer steps of 2 micro-batches per rank, gradient clipping 0.5 (active), fp32, with a
threshold ``tau`` per model between its heads' max logits, so the clip fires (in some step, on some heads and not
all; per step the same number of heads as the oracle's). Every parameter must match the oracle trained on all ranks'
micro-batches to 1e-5 relative to the parameter and 1e-3 relative to its update (as tests/dist/test_qk_clip.py);
the per-head max logits to 1e-5 (GPT-NeoX's to 1e-4: NEOX_LOGIT_RTOL). The oracles of the cases are split over
the ranks (rank ``k % W`` trains case ``k``'s), so the group's time is the engines' plus half the oracles'.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                                   reference_model, train_reference, train_steps)
from tests.support.models import batch
from tests.support.spawn import run_distributed

transformers = pytest.importorskip("transformers")

from tests.support.qk_models import FAMILIES  # noqa: E402

STEPS, GAS, CLIP, WORLD = 3, 2, 0.5, 2
RTOL_UPDATE = 1e-3
#: GPT-NeoX's fused bias, compared per part (q, k, v rows of every head). Its key part gets a gradient of zero in
#: exact arithmetic on the non-rotary dimensions (softmax is invariant to the q.b_k shift it adds to a whole row of
#: logits; as Qwen2's k_proj.bias in tests/dist/test_qk_clip.py): only rounding noise there, which AdamW normalizes
#: into full-size steps. It starts at zero, so it is held to KEY_BIAS_RTOL_UPDATE of its update (measured at most
#: 1.1e-2 over the part); its q and v parts to the strict tolerances (measured below 1e-5 of their update).
INTERLEAVED_BIAS = "attention.query_key_value.bias"
KEY_BIAS_RTOL_UPDATE = 0.05
#: GPT-NeoX's per-head max logits: every logit of a query row includes q.b_k, so the key bias part's noise (above)
#: reaches them from the second step on; measured 1.5e-5 relative at step 3 (on a CPU with AVX512-FP16/AMX; the
#: other families stay within 1e-5), held to 1e-4. The heads clipped per step must still be the oracle's exactly.
NEOX_LOGIT_RTOL = 1e-4

#: name -> (model in tests.support.qk_models.MODELS, its keyword arguments, tau, extra zero_optimization keys,
#: extra qk_clip keys)
CASES = {
    "z3-deepseek-v3-mla": ("deepseek_v3", {}, 5.5, {}, {}),
    "z3-deepseek-v3-mla-q-lora-ds_muon_sdpa": ("deepseek_v3_q_lora", {"attn_implementation": "ds_muon_sdpa"}, 3.5, {}, {}),
    "z3-qwen3-qk-norm-per-layer": ("qwen3", {}, 7.5, {}, {}),
    "z3-gemma3-qk-norm-plus-one": ("gemma3", {}, 5.5, {}, {}),
    "z3-olmo2-qk-norm-per-head": ("olmo2", {}, 10.0, {}, {}),
    "z3-gpt-neox-interleaved-qkv": ("gpt_neox", {}, 6.0, {}, {}),
    "z3-gpt-oss-sinks-ds_muon_eager": ("gpt_oss", {"attn_implementation": "ds_muon_eager"}, 11.0, {}, {}),
    "z2-deepseek-v3-mla-q-lora": ("deepseek_v3_q_lora", {}, 3.5, {"stage": 2}, {}),
    # the until_step window: steps 1 and 2 clip, step 3 neither clips nor reports figures (as the oracle)
    "z3-gpt-neox-until-step-2": ("gpt_neox", {}, 6.0, {}, {"until_step": 2}),
    # the same window across checkpoints (RESUME_CASE): the oracle saved after step 1 and resumed in a fresh oracle
    "z3-gpt-neox-until-step-2-resume": ("gpt_neox", {}, 6.0, {}, {"until_step": 2}),
}
#: Saves after steps 1 ("t1", in the window) and 2 ("t2", its last step); a fresh engine loads t2 (its recording
#: must be stopped right after the load) and trains step 3, then loads t1 into itself (recording again) and trains
#: steps 2 and 3. Its figures and weights are those of t1's steps 2-3, against the oracle resumed after step 1.
RESUME_CASE = "z3-gpt-neox-until-step-2-resume"


def _model_fn(model: str, kwargs: dict):
    from tests.support.qk_models import MODELS
    return lambda: MODELS[model](**kwargs)


def _params(tau: float, extra: dict | None = None) -> dict:
    cfg = ds_config()
    return dict(cfg["optimizer"]["params"], qk_clip={"enabled": True, "threshold": tau, "alpha": 0.5, **(extra or {})})


def _clipped(stats: list) -> list:
    """Heads clipped per step; None for a step past the until_step window (no figures)."""
    return [None if s is None else s["heads_clipped"] for s in stats]


def _per_head(stats: list) -> list:
    return [None if s is None else s["max_logit_per_head"] for s in stats]


def _steps(engine, rank: int, start: int, stop: int) -> list:
    """Optimizer steps ``start..stop-1``; each step's QK-clip figures."""
    stats = []
    for step in range(start, stop):
        train_steps(engine, rank, step, step + 1, GAS)
        stats.append(engine.optimizer.qk_clip_stats)
    return stats


def _recording(engine) -> list[bool]:
    from ds_muon.model.max_logits import RECORDER
    return [RECORDER.wants(t.module) for t in engine.optimizer.qk_clip_targets]


def _engine_run(rank: int, name: str, ckpt: str) -> dict:
    """Train case ``name`` under ZeRO on this rank; every rank returns the same gathered figures."""
    model, kwargs, tau, zero, extra = CASES[name]
    cfg = ds_config(gas=GAS, clip=CLIP, **zero)
    cfg["optimizer"]["params"] = _params(tau, extra)
    engine, module = build_engine(cfg, model_fn=_model_fn(model, kwargs))
    init, tags = gathered_params(module), clone_tags(module)
    resume = {}
    if name == RESUME_CASE:
        stats = _steps(engine, rank, 0, 1)
        engine.save_checkpoint(ckpt, tag="t1")
        _steps(engine, rank, 1, 2)
        engine.save_checkpoint(ckpt, tag="t2")
        engine.destroy()
        engine, module = build_engine(cfg, model_fn=_model_fn(model, kwargs))
        engine.load_checkpoint(ckpt, tag="t2")
        resume["recording after loading t2"] = _recording(engine)
        resume["figures of step 3 after t2"] = _clipped(_steps(engine, rank, 2, 3))
        engine.load_checkpoint(ckpt, tag="t1")
        resume["recording after loading t1"] = _recording(engine)
        stats += _steps(engine, rank, 1, STEPS)
    else:
        stats = _steps(engine, rank, 0, STEPS)
    opt = engine.optimizer
    targets = opt.qk_clip_targets
    out = {"type": type(opt).__name__, "rules": sorted({t.rule for t in targets}), "resume": resume,
           "leaves": sorted({hr.name.split(".")[-2] for t in targets for hr in t.rows}),
           "qk_params": sorted({hr.name for t in targets for hr in t.rows}),
           "clipped": _clipped(stats), "per_head": _per_head(stats),
           "heads": sum(t.num_heads for t in targets), "init": init, "tags": tags, "got": gathered_params(module)}
    engine.destroy()
    return out


def _oracle(name: str, run: dict) -> dict:
    """The single-device oracle of case ``name`` from the engine's initial weights; its errors against ``run``."""
    import ds_muon
    model, kwargs, tau, _, extra = CASES[name]
    ref = reference_model(run["init"], run["tags"], _model_fn(model, kwargs))
    opt = ds_muon.MuonAdamW(ref, **_params(tau, extra))
    stats = []
    first = 1 if name == RESUME_CASE else STEPS
    train_reference(ref, opt, first, WORLD, GAS, CLIP, after_step=lambda: stats.append(opt.qk_clip_stats))
    if first < STEPS:  # a fresh oracle loads the state dict and trains the rest
        weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
        state = opt.state_dict()
        ref = reference_model(weights, run["tags"], _model_fn(model, kwargs))
        opt = ds_muon.MuonAdamW(ref, **_params(tau, extra))
        opt.load_state_dict(state)
        train_reference(ref, opt, STEPS - first, WORLD, GAS, CLIP, after_step=lambda: stats.append(opt.qk_clip_stats),
                        data=lambda step, *a: batch(step + first, *a))
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    got, init = dict(run["got"]), dict(run["init"])
    for pname in [n for n in want if n.endswith(INTERLEAVED_BIAS)]:  # per head [q; k; v]: compared part by part
        heads = ref.config.num_attention_heads
        for part, index in (("q", 0), ("k", 1), ("v", 2)):
            for d in (want, got, init):
                d[f"{pname}[{part}]"] = d[pname].view(heads, 3, -1)[:, index]
        for d in (want, got, init):
            del d[pname]
    return {"errors": compare(got, want, init),
            "ref_clipped": _clipped(stats), "ref_per_head": _per_head(stats)}


def _refusal(rank: int) -> str:
    """GPT-OSS with attn_implementation="eager" (records nothing): ds_muon.initialize must refuse QK-clip."""
    from ds_muon.errors import ConfigError
    cfg = ds_config(gas=GAS, clip=CLIP)
    cfg["optimizer"]["params"] = _params(5.0)
    try:
        build_engine(cfg, model_fn=_model_fn("gpt_oss", {"attn_implementation": "eager"}))
    except ConfigError as err:
        return str(err)
    return "no error"


def families_worker(rank: int, world_size: int, names: list[str], ckpt_root: str) -> dict:
    import os

    import ds_muon
    from tests.support.qk_models import register_test_attention
    register_test_attention()  # transformers' modeling code imported before any engine (as test_qk_clip)
    ds_muon.register_attention()
    runs = {name: _engine_run(rank, name, os.path.join(ckpt_root, name)) for name in names}
    out = {"refusal": _refusal(rank)}
    for k, name in enumerate(names):
        run = runs[name]
        res = {key: run[key] for key in ("type", "rules", "leaves", "qk_params", "clipped", "per_head", "heads",
                                         "resume")}
        if k % world_size == rank:
            res.update(_oracle(name, run))
        out[name] = res
    return out


def _check(name: str, res: dict, oracle: dict, per_rank: list[dict]) -> list[str]:
    """What is wrong with case ``name`` (empty: nothing): ``res`` rank 0's figures, ``oracle`` its oracle's."""
    model, _, tau, zero, extra = CASES[name]
    rule, leaves = FAMILIES[model]
    want_type = "MuonZeroOptimizer" if zero.get("stage", 3) == 3 else "MuonZero12Optimizer"
    problems = []
    if res["type"] != want_type:
        problems.append(f"optimizer {res['type']}, not {want_type}")
    if not res["rules"] or not all(r.startswith(rule) for r in res["rules"]) or set(res["leaves"]) != leaves:
        problems.append(f"targets {res['rules']} on {res['leaves']}, not {rule!r} on {sorted(leaves)}")
    # one all_reduce(MAX): every rank clips the same heads, on the same max logits
    if not all(r[name]["clipped"] == res["clipped"] and r[name]["per_head"] == res["per_head"] for r in per_rank):
        problems.append("the ranks' QK-clip figures differ")
    # the clip fired, on some heads and not all in a step, and exactly as in the oracle
    until = extra.get("until_step")
    if until is not None and (None in res["clipped"][:until] or res["clipped"][until:] != [None] * (STEPS - until)):
        problems.append(f"until_step {until}: figures per step {res['clipped']}, not {until} steps then none")
    if not any(c is not None and 0 < c < res["heads"] for c in res["clipped"]):
        problems.append(f"heads clipped per step {res['clipped']} of {res['heads']} at tau {tau}: no step clipped "
                        "some heads and not all")
    if res["clipped"] != oracle["ref_clipped"]:
        problems.append(f"heads clipped per step {res['clipped']}, the oracle's {oracle['ref_clipped']}")
    for step, (got, want) in enumerate(zip(res["per_head"], oracle["ref_per_head"])):
        if got is None or want is None:
            if got is not want:
                problems.append(f"step {step}: max logits {got}, the oracle's {want}")
            continue
        if list(got) != list(want):
            problems.append(f"step {step}: max logits of {list(got)}, the oracle's of {list(want)}")
            continue
        for module in got:
            a, b = torch.tensor(got[module]), torch.tensor(want[module])
            rtol = NEOX_LOGIT_RTOL if model == "gpt_neox" else 1e-5
            if not torch.allclose(a, b, rtol=rtol, atol=0):
                problems.append(f"step {step} {module}: max logits {a.tolist()}, the oracle's {b.tolist()}")
    if name == RESUME_CASE:
        heads = len(res["resume"]["recording after loading t1"])
        want = {"recording after loading t2": [False] * heads, "figures of step 3 after t2": [None],
                "recording after loading t1": [True] * heads}
        if res["resume"] != want:
            problems.append(f"resume: {res['resume']}, not {want}")
    errors = oracle["errors"]
    compared = {n.split("[")[0] for n in errors}
    if not set(res["qk_params"]) <= compared:
        problems.append(f"clipped parameters {sorted(set(res['qk_params']) - compared)} not compared")
    for pname, err in errors.items():
        rtol, rtol_update = ((float("inf"), KEY_BIAS_RTOL_UPDATE) if pname.endswith(f"{INTERLEAVED_BIAS}[k]")
                             else (PARITY_RTOL, RTOL_UPDATE))
        if err["rel"] > rtol or (err["moved"] > 0 and err["rel_update"] > rtol_update):
            problems.append(f"{pname} rel {err['rel']:.2e} (max {rtol}), of its update {err['rel_update']:.2e} "
                            f"(max {rtol_update})")
    return [f"{name}: {p}" for p in problems]


def test_qk_clip_families_zero_parity_with_oracle(tmp_path):
    names = list(CASES)
    per_rank = run_distributed(families_worker, WORLD, names, str(tmp_path))
    problems = []
    for rank in range(WORLD):
        refusal = per_rank[rank]["refusal"]
        if not ("runs attn_implementation='eager'" in refusal and "ds_muon_eager" in refusal):
            problems.append(f"rank {rank}: GPT-OSS with attn_implementation='eager' was not refused: {refusal}")
    for k, name in enumerate(names):
        res, oracle = per_rank[0][name], per_rank[k % WORLD][name]
        worst = max(oracle["errors"].items(), key=lambda kv: kv[1]["rel_update"] if kv[1]["moved"] > 0 else 0)
        print(f"{name}: heads clipped {res['clipped']} (oracle {oracle['ref_clipped']}) of {res['heads']}; worst "
              f"{worst[0]}: {worst[1]['rel']:.1e} of itself, {worst[1]['rel_update']:.1e} of its update")
        problems += _check(name, res, oracle, per_rank)
    assert not problems, "\n".join(problems)
