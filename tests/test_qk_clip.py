"""QK-clip (MuonClip, Kimi K2 arXiv 2507.20534 §2.1): the rule, the weights it finds, the oracle, ZeRO-3 parity.

The attention of every test model records its exact per-head max logits brute force
(:mod:`tests.qk_models`), so the clip acts on real logits. Thresholds are chosen inside the range of
the models' logits (4-11), so some heads clip and some do not (asserted).

* Rule: :func:`ds_muon.qk_clip.clip_factors` against a per-head loop written from the paper's
  formulas (GQA: a key head takes the largest logit of its query heads), several alphas.
* Plan: :func:`ds_muon.qk_clip.local_head_ranges` against a brute-force head map of every element,
  W = 1..4, for a weight, a fused QKV's key block and a bias.
* Oracle (``ds_muon.MuonAdamW`` with a learning rate of 1e-9, so the clip alone moves the weights): each
  head's query rows are scaled by exactly gamma^alpha and its key rows by gamma_kv^(1-alpha), computed
  here from the recorded logits; recomputed on the same batch (one-layer models, so the inputs of the
  attention do not change), every clipped head's max logit is <= tau, and == tau without GQA
  (relative 1e-5), biases included (Qwen2).
* ZeRO-3 parity with the oracle (W = 1, 2, 3; GAS 2; gradient clipping 0.5; Llama GQA, Qwen2 with q/k
  biases, Phi-3 fused QKV, a custom attention declaring ``muon_qk_clip()``; bf16; CPU offload; zero.Init;
  resume from a checkpoint bit-identical to the uninterrupted run). Tolerance as
  tests/test_zero3_parity.py: 1e-5 relative to each parameter, 1e-3 relative to its update (bf16: 1e-2
  and 5e-2). Every case also trains the oracle without QK-clip: the result must be far from it. The
  number of heads clipped per step equals the oracle's on every rank and is > 0, and the monitor gets it.
* NVMe optimizer offload (W = 2, both the Muon and the AdamW sub-group swapped): parity as above.
* fp16 with an overflow step (NaN loss): the skipped step clips nothing (fp32 partitions bit-identical
  across it, its recorded logits dropped).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_util import run_distributed
from tests.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, fp32_master_params,
                           gathered_params, reference_model, swap_dir_for, train_reference)
from tests.models import batch

transformers = pytest.importorskip("transformers")

from tests.qk_models import MODELS, DeclaredNet, brute_max_logits, llama_gqa, phi3_fused, qwen2_bias  # noqa: E402

STEPS, GAS, CLIP = 4, 2, 0.5
TAU = 6.0


# ------------------------------------------------------------------------------------------------
# rule and plan (no process group)
# ------------------------------------------------------------------------------------------------
def _expected_factors(s: list[float], nkv: int, tau: float, alpha: float):
    """The rule per head, written out: gamma = tau/S if S > tau else 1; a key head uses its query heads' max."""
    group = len(s) // nkv
    q = [(tau / x if x > tau else 1.0) ** alpha for x in s]
    k = []
    for g in range(nkv):
        m = max(s[g * group:(g + 1) * group])
        k.append((tau / m if m > tau else 1.0) ** (1 - alpha))
    return q, k


@pytest.mark.parametrize("nkv", [1, 2, 3, 6])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_rule_matches_the_paper_per_head(nkv, alpha):
    from ds_muon.qk_clip import clip_factors
    s = [3.0, 12.0, 7.0, 6.0, 25.0, float("-inf")]
    q, k = clip_factors(torch.tensor(s), nkv, 6.5, alpha)
    want_q, want_k = _expected_factors(s, nkv, 6.5, alpha)
    torch.testing.assert_close(q, torch.tensor(want_q), rtol=1e-6, atol=0)
    torch.testing.assert_close(k, torch.tensor(want_k), rtol=1e-6, atol=0)


def test_rule_leaves_non_finite_and_small_logits_alone():
    from ds_muon.qk_clip import clip_factors
    q, k = clip_factors(torch.tensor([float("nan"), float("inf"), 1.0, float("-inf")]), 4, 2.0, 0.5)
    assert q.tolist() == [1.0] * 4 and k.tolist() == [1.0] * 4


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_local_head_ranges_cover_each_head_exactly(world_size):
    from ds_muon.qk_clip import HeadRows, local_head_ranges
    for rows, cols, start, hd, heads in ((24, 7, 0, 6, 4), (40, 5, 16, 4, 2), (24, 1, 0, 6, 4), (9, 3, 3, 3, 2)):
        hr = HeadRows(None, "p", start, hd, heads, cols)
        numel = rows * cols
        chunk = -(-numel // world_size)
        want = torch.full((numel,), -1)
        for h in range(heads):
            want[(start + h * hd) * cols:(start + (h + 1) * hd) * cols] = h
        got = torch.full((numel,), -1)
        for r in range(world_size):
            for offset, n, h in local_head_ranges(hr, numel, chunk, r):
                lo = r * chunk + offset
                assert 0 <= offset and offset + n <= chunk and lo + n <= numel
                assert (got[lo:lo + n] == -1).all(), "a range is covered twice"
                got[lo:lo + n] = h
        assert torch.equal(got, want), (rows, cols, start, world_size)


def test_find_clip_targets_geometry():
    from ds_muon.qk_clip import find_clip_targets
    torch.manual_seed(0)
    llama = find_clip_targets(llama_gqa())
    assert [(t.name, t.num_heads, t.num_kv_heads) for t in llama] == [
        ("model.layers.0.self_attn", 4, 2), ("model.layers.1.self_attn", 4, 2)]
    assert [(h.name.rsplit(".", 2)[-2], h.start, h.head_dim, h.cols) for h in llama[0].query + llama[0].key] == [
        ("q_proj", 0, 8, 32), ("k_proj", 0, 8, 32)]
    qwen = find_clip_targets(qwen2_bias())[0]
    assert [h.name.rsplit(".", 1)[-1] for h in qwen.query + qwen.key] == ["weight", "bias", "weight", "bias"]
    phi = find_clip_targets(phi3_fused())[0]
    assert [(h.name.rsplit(".", 2)[-2], h.start) for h in phi.query + phi.key] == [("qkv_proj", 0), ("qkv_proj", 32)]
    declared = find_clip_targets(DeclaredNet())
    assert [(t.name, len(t.query), len(t.key), t.query[0].head_dim) for t in declared] == [
        ("attn.0", 2, 1, 6), ("attn.1", 2, 1, 6)]


def test_example_model_declares_its_attention():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    try:
        import model as example
    finally:
        sys.path.pop(0)
    from ds_muon.qk_clip import find_clip_targets
    targets = find_clip_targets(example.CausalLM(example.ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                                    ffn_hidden=48, max_seq_len=16)))
    assert len(targets) == 2 and all((t.num_heads, t.num_kv_heads) == (4, 2) for t in targets)
    assert targets[0].query[0].name.endswith("q_proj.weight") and targets[0].key[0].name.endswith("k_proj.weight")


def test_refusals():
    from ds_muon import MuonAdamW
    from ds_muon.config import ConfigError
    clip = {"qk_clip": {"enabled": True, "threshold": TAU}}
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))
    with pytest.raises(ConfigError, match=r"q_norm, k_norm.*undoes any scaling.*qk_clip.enabled to false"):
        MuonAdamW(qwen3, **clip)
    with pytest.raises(ConfigError, match=r"no attention module was found.*muon_qk_clip"):
        MuonAdamW(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), **clip)
    model = llama_gqa()
    with pytest.raises(ConfigError, match="pass model="):
        MuonAdamW(list(model.parameters()), **clip)
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"k_proj.weight.*not trained by this optimizer"):
        MuonAdamW([p for p in model.parameters() if p.requires_grad], model=model, **clip)
    # enabled, but the attention never records (plain sdpa): the step says how to record
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_implementation="sdpa"))
    opt = MuonAdamW(plain, **clip)
    plain(input_ids=torch.randint(0, 64, (2, 5)), labels=torch.randint(0, 64, (2, 5))).loss.backward()
    with pytest.raises(RuntimeError, match=r"no attention module recorded.*ds_muon_sdpa.*record_max_logits"):
        opt.step()


def test_config_errors_name_key_and_allowed_values():
    from ds_muon.config import ConfigError, parse_muon_params
    assert parse_muon_params({}).qk_clip.model_dump() == {"enabled": False, "threshold": 100.0, "alpha": 0.5,
                                                          "monitor_per_head": True}
    for bad, match in (({"threshold": 0}, r"qk_clip\.threshold: 0 is invalid.*allowed: a number > 0"),
                       ({"alpha": 1.5}, r"qk_clip\.alpha: 1\.5 is invalid.*allowed: a number in \[0, 1\]"),
                       ({"enabled": "yes"}, r"qk_clip\.enabled: 'yes' is invalid.*allowed: true or false"),
                       ({"monitor_per_head": 1}, r"qk_clip\.monitor_per_head: 1 is invalid.*allowed: true or false"),
                       ({"treshold": 5}, r"qk_clip\.treshold: unknown key.*did you mean 'threshold'"),
                       (3, r"qk_clip: 3 is invalid.*enabled \(true or false\), threshold")):
        with pytest.raises(ConfigError, match=match):
            parse_muon_params({"qk_clip": bad})


# ------------------------------------------------------------------------------------------------
# the oracle: the clip alone (lr 1e-9), checked against the recorded logits
# ------------------------------------------------------------------------------------------------
EXACT_MODELS = {
    "llama-gqa": lambda: llama_gqa(num_hidden_layers=1),
    "llama-mha": lambda: llama_gqa(num_hidden_layers=1, num_key_value_heads=4),
    "qwen2-mha-bias": lambda: qwen2_bias(num_hidden_layers=1, num_key_value_heads=4),
    "phi3-fused-gqa": lambda: phi3_fused(num_hidden_layers=1),
    "declared-gqa": lambda: DeclaredNet(num_hidden_layers=1),
    "declared-mha": lambda: DeclaredNet(num_hidden_layers=1, num_key_value_heads=4),
}


@pytest.mark.parametrize("name", sorted(EXACT_MODELS))
@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_oracle_clip_scales_heads_and_bounds_logits(name, alpha):
    from ds_muon import MuonAdamW
    from ds_muon.max_logits import RECORDER
    from ds_muon.qk_clip import find_clip_targets
    torch.manual_seed(0)
    model = EXACT_MODELS[name]()
    tokens, targets = batch(0, 0, 0)
    (module,) = [t.module for t in find_clip_targets(model)]
    RECORDER.clear()
    model(tokens, targets)
    ordered = RECORDER.take(module).sort().values
    tau = float(ordered[1] + ordered[2]) / 2  # between the heads' max logits: some clip, some do not
    opt = MuonAdamW(model, lr=1e-9, adam_lr=1e-9, weight_decay=0.0,
                    qk_clip={"enabled": True, "threshold": tau, "alpha": alpha})
    (target,) = opt.qk_clip_targets
    model(tokens, targets).backward()
    s = RECORDER._max[target.module].clone()  # what the step will take
    before = [hr.param.detach().clone() for hr in target.query + target.key]
    opt.step()
    assert opt.qk_clip_stats["heads_clipped"] == 2, (s, tau, opt.qk_clip_stats)
    want_q, want_k = _expected_factors(s.tolist(), target.num_kv_heads, tau, alpha)
    for hr, old in zip(target.query + target.key, before):
        want = want_q if any(hr is q for q in target.query) else want_k
        new = hr.param.detach().view(-1)
        for h in range(hr.num_heads):
            lo, hi = hr.head_span(h)
            torch.testing.assert_close(new[lo:hi], old.view(-1)[lo:hi] * want[h], rtol=1e-6, atol=1e-7)
    with torch.enable_grad():
        model(tokens, targets)
    s_new = RECORDER.take(target.module)
    # every logit of head h scales by q_h * k_(its key head): so does the max; a clipped head ends <= tau
    group = target.num_heads // target.num_kv_heads
    scale = torch.tensor([want_q[h] * want_k[h // group] for h in range(target.num_heads)])
    torch.testing.assert_close(s_new, s * scale, rtol=1e-5, atol=0)
    clipped = s > tau
    assert (s_new[clipped] <= tau * (1 + 1e-5)).all(), (s, s_new)
    if target.num_kv_heads == target.num_heads:  # no GQA: exactly tau
        torch.testing.assert_close(s_new[clipped], torch.full_like(s_new[clipped], tau), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------
# ZeRO-3 parity
# ------------------------------------------------------------------------------------------------
class _Monitor:
    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events.extend(events)


def _events_by_step(monitor: _Monitor, marker: str, per_head: bool) -> list[dict]:
    """``[{event name: value}]`` per monitor step of the QK-clip events whose name contains ``marker``:
    per-head events (``.../head_<h>``) or the per-layer ones."""
    steps: dict[int, dict] = {}
    for name, value, step in monitor.events:
        if "qk_clip" in name and marker in name and ("/head_" in name) == per_head:
            steps.setdefault(step, {})[name] = value
    return [steps[k] for k in sorted(steps)]


def _train(engine, steps: int, rank: int, start: int = 0) -> list:
    stats = []
    for step in range(start, start + steps):
        for micro in range(GAS):
            tokens, targets = (t.to(engine.device) for t in batch(step, rank, micro))
            engine.backward(engine(tokens, targets))
            engine.step()
        stats.append(engine.optimizer.qk_clip_stats)
    return stats


def _clip_case(rank: int, world_size: int, case: dict, tmp: str) -> dict | None:
    import ds_muon
    from tests.qk_models import register_test_attention
    register_test_attention()  # imports transformers' modeling code now: inside zero.Init it fails (torch._dynamo)
    model_fn = MODELS[case["model"]]
    cfg = ds_config(gas=GAS, clip=CLIP, **case.get("zero", {}))
    offload = cfg["zero_optimization"].get("offload_optimizer", {})
    if offload.get("device") == "nvme":
        offload["nvme_path"] = swap_dir_for(tmp + "-swap")
        os.makedirs(offload["nvme_path"], exist_ok=True)
    params = cfg["optimizer"]["params"]
    params.update(qk_clip={"enabled": True, "threshold": TAU, "alpha": case.get("alpha", 0.5),
                           "monitor_per_head": case.get("monitor_per_head", True)}, **case.get("params", {}))
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    engine, model = build_engine(cfg, zero_init=case.get("zero_init", False), model_fn=model_fn)
    init, tags = gathered_params(model), clone_tags(model)
    monitor = _Monitor()
    engine.optimizer.attach_monitor(monitor, lambda: engine.global_samples)
    if case.get("resume"):  # half, save, a fresh engine loads it, the other half
        stats = _train(engine, STEPS // 2, rank)
        engine.save_checkpoint(tmp, tag="half")
        engine.destroy()
        engine, model = build_engine(cfg, zero_init=case.get("zero_init", False), model_fn=model_fn)
        engine.load_checkpoint(tmp, tag="half")
        engine.optimizer.attach_monitor(monitor, lambda: engine.global_samples)
        stats += _train(engine, STEPS - STEPS // 2, rank, start=STEPS // 2)
        resumed = gathered_params(model)
        engine.destroy()
        engine, model = build_engine(cfg, zero_init=case.get("zero_init", False), model_fn=model_fn)
        stats_once = _train(engine, STEPS, rank)
        once = gathered_params(model)
        result = {"resume_identical": all(torch.equal(resumed[n], once[n]) for n in once),
                  "resume_stats_identical": stats == stats_once}
    else:
        stats = _train(engine, STEPS, rank)
        opt = engine.optimizer
        # sub-groups holding query/key rows that the NVMe swapper swaps (0 without NVMe)
        result = {"swapped_qk_sub_groups": sum(bool(opt._swappable_optimizer_subgroup(i)) for i in opt._qk_ranges)}
    got = fp32_master_params(model) if case.get("bf16") else gathered_params(model)
    result.update(stats=[(s["heads_clipped"], s["max_logit"]) for s in stats],
                  events=sorted({e[0] for e in monitor.events if "qk_clip" in e[0]}),
                  clipped_events=[e[1] for e in monitor.events if e[0] == "Train/ds_muon/qk_clip/heads_clipped"],
                  per_head=[s["max_logit_per_head"] for s in stats],
                  # the monitor's per-layer and per-head events, one dict per applied step, in write order
                  layer_events=_events_by_step(monitor, "/max_logit/", per_head=False),
                  head_events=_events_by_step(monitor, "/max_logit/", per_head=True))
    engine.destroy()
    if rank != 0:
        return result
    ref_stats = []
    runs = {}
    for label, enabled in (("oracle", True), ("no_clip", False)):
        ref = reference_model(init, tags, model_fn)
        opt = ds_muon.MuonAdamW(ref, **{**params, "qk_clip": {**params["qk_clip"], "enabled": enabled}})
        train_reference(ref, opt, STEPS, world_size, GAS, CLIP,
                        after_step=(lambda o=opt: ref_stats.append(o.qk_clip_stats)) if enabled else None)
        runs[label] = compare(got, {n: p.detach().clone() for n, p in ref.named_parameters()}, init)
    result.update(errors=runs["oracle"], alt=runs["no_clip"],
                  ref_stats=[(s["heads_clipped"], s["max_logit"]) for s in ref_stats],
                  ref_per_head=[s["max_logit_per_head"] for s in ref_stats])
    return result


def _fp16_overflow_case(rank: int, world_size: int, case: dict, tmp: str) -> dict:
    """fp16 with QK-clip; the loss of step 1 (of 3) is multiplied by NaN: that step is skipped, and it must not
    clip either (fp32 partitions bit-identical across it, its recorded logits dropped, stats not updated)."""
    cfg = ds_config(gas=1, clip=CLIP)
    cfg["optimizer"]["params"].update(qk_clip={"enabled": True, "threshold": TAU})
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, model = build_engine(cfg, model_fn=MODELS[case["model"]])
    opt = engine.optimizer
    out = {"stats": [], "skipped": []}
    for step in range(3):
        weights = [t.clone() for t in opt.fp32_partitioned_groups_flat]
        tokens, targets = batch(step, rank, 0)
        loss = engine(tokens, targets)
        engine.backward(loss * float("nan") if step == 1 else loss)
        engine.step()
        out["skipped"].append(bool(opt.overflow))
        out["stats"].append(None if opt.qk_clip_stats is None else opt.qk_clip_stats["heads_clipped"])
        if step == 1:
            out["unchanged"] = all(torch.equal(a, b) for a, b in zip(weights, opt.fp32_partitioned_groups_flat))
    from ds_muon.max_logits import RECORDER
    out["recorder_empty"] = not len(RECORDER._max)
    engine.destroy()
    return out


def clip_worker(rank: int, world_size: int, cases: list[dict], ckpt_root: str) -> list:
    return [(_fp16_overflow_case if case.get("fp16_overflow") else _clip_case)(
        rank, world_size, case, os.path.join(ckpt_root, case["name"])) for case in cases]


CASES = {
    1: [dict(name="w1-llama", model="llama")],
    2: [dict(name="w2-llama-gqa", model="llama"),
        dict(name="w2-llama-ds_muon_sdpa", model="llama_ds_muon_sdpa"),  # the production attention function
        dict(name="w2-phi3-fused-alpha0.3", model="phi3", alpha=0.3),
        # Qwen2's key bias has a gradient of exactly zero in exact arithmetic (softmax is invariant to the
        # q.b_k shift it adds to every logit of a row): only rounding noise, which AdamW normalizes into
        # full-size steps, so it is held to 1e-3 of itself and 0.5 of its update (measured 2.7e-5)
        dict(name="w2-qwen2-bias-cpu-offload", model="qwen2", zero=dict(offload_optimizer={"device": "cpu"}),
             loose={"k_proj.bias": (1e-3, 0.5)}),
        # bf16 model against the fp32 oracle: bf16 rounding of forward/backward (as tests/test_zero3_parity.py's
        # bf16 tolerances: 1e-2 of the parameter, 5e-2 of its update; the tied embedding/head 1e-1 of its update
        # (measured 5.2e-2: its update is the smallest relative to the bf16 noise)
        dict(name="w2-declared-bf16", model="declared", bf16=True, rtol=1e-2, rtol_update=5e-2, stats_rtol=2e-2,
             loose={"embed.weight": (1e-2, 1e-1)}),
        dict(name="w2-fp16-overflow-step-does-not-clip", model="declared", fp16_overflow=True),
        # resume: exact AdamW betas (see tests/test_checkpoint.py) so the resumed run is bit-identical
        dict(name="w2-llama-resume", model="llama", resume=True, params=dict(betas=[0.5, 0.75]))],
    3: [dict(name="w3-llama-no-per-head-events", model="llama", monitor_per_head=False),
        dict(name="w3-phi3-cpu-offload", model="phi3", zero=dict(offload_optimizer={"device": "cpu"})),
        # zero.Init: parameters are partitioned at construction, geometry from ds_shape (a transformers model
        # cannot be built directly under zero.Init: its weight init indexes the empty placeholders)
        dict(name="w3-declared-zeroinit", model="declared", zero_init=True)],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_qk_clip_parity_with_oracle(world_size, tmp_path):
    cases = CASES[world_size]
    results = run_distributed(clip_worker, world_size, cases, str(tmp_path))
    for k, case in enumerate(cases):
        check_case(case, [r[k] for r in results])


NVME_CASES = [dict(name="w2-declared-wide-nvme", model="declared_wide", zero=dict(offload_optimizer={"device": "nvme"}))]


def test_qk_clip_parity_with_oracle_nvme(tmp_path):
    """NVMe optimizer offload (its own process group: DeepSpeed's async_io op is loaded only here)."""
    results = run_distributed(clip_worker, 2, NVME_CASES, str(tmp_path))
    for k, case in enumerate(NVME_CASES):
        check_case(case, [r[k] for r in results])


def check_case(case: dict, per_rank: list[dict]) -> None:
    name, res = case["name"], per_rank[0]
    if case.get("fp16_overflow"):
        for r in per_rank:
            assert r["skipped"] == [False, True, False] and r["unchanged"] and r["recorder_empty"], (name, r)
            assert r["stats"][0] and r["stats"][1] == r["stats"][0] and r["stats"][2], (name, r["stats"])
        return
    for r in per_rank:  # one all_reduce: every rank clips the same heads
        assert r["stats"] == res["stats"], (name, r["stats"], res["stats"])
    clipped = [n for n, _ in res["stats"]]
    assert [n for n, _ in res["ref_stats"]] == clipped, (name, res["stats"], res["ref_stats"])
    assert sum(clipped) > 0 and min(clipped) < 8, f"{name}: heads clipped per step {clipped}"
    torch.testing.assert_close(torch.tensor([m for _, m in res["stats"]]), torch.tensor([m for _, m in res["ref_stats"]]),
                               rtol=case.get("stats_rtol", 1e-5), atol=0)
    assert res["events"][:2] == ["Train/ds_muon/qk_clip/heads_clipped", "Train/ds_muon/qk_clip/max_logit"], res["events"]
    assert res["clipped_events"] == clipped, (name, res["clipped_events"])
    # per-head max logits: the same on every rank, the oracle's per head, and on the monitor per layer and per head
    assert all(r["per_head"] == res["per_head"] for r in per_rank), name
    per_head_events = case.get("monitor_per_head", True)
    head_events = res["head_events"] if per_head_events else [{}] * len(res["per_head"])
    assert per_head_events or not res["head_events"], (name, "per-head events written with monitor_per_head off")
    assert len(res["per_head"]) == len(res["ref_per_head"]) == len(head_events) == len(res["layer_events"])
    for step, (got, want, heads, layers) in enumerate(zip(res["per_head"], res["ref_per_head"], head_events,
                                                          res["layer_events"])):
        assert list(got) == list(want) and got, (name, step, list(got), list(want))
        for module, values in got.items():
            torch.testing.assert_close(torch.tensor(values), torch.tensor(want[module]),
                                       rtol=case.get("stats_rtol", 1e-5), atol=0)
            if per_head_events:
                assert [heads[f"Train/ds_muon/qk_clip/max_logit/{module}/head_{h}"]
                        for h in range(len(values))] == values, (name, module)
            assert layers[f"Train/ds_muon/qk_clip/max_logit/{module}"] == max(values), (name, module)
        assert len(heads) == per_head_events * sum(map(len, got.values())) and len(layers) == len(got), (name, step)
    if case.get("resume"):
        assert all(r["resume_identical"] and r["resume_stats_identical"] for r in per_rank), name
    if case.get("zero", {}).get("offload_optimizer", {}).get("device") == "nvme":  # Muon (q/k) and AdamW (q bias)
        assert all(r["swapped_qk_sub_groups"] == 2 for r in per_rank), (name, [r["swapped_qk_sub_groups"] for r in per_rank])
    rtol, rtol_update = case.get("rtol", PARITY_RTOL), case.get("rtol_update", 1e-3)
    qk = [p for p in res["errors"] if any(k in p for k in ("q_proj", "k_proj", "qkv_proj", ".q.", ".k."))]
    assert qk, name
    for pname, err in res["errors"].items():
        tol, tol_update = next((v for k, v in case.get("loose", {}).items() if k in pname), (rtol, rtol_update))
        assert err["rel"] <= tol, f"{name}: {pname} rel error {err['rel']:.2e} > {tol}"
        if err["moved"] > 0:
            assert err["rel_update"] <= tol_update, f"{name}: {pname} update rel error {err['rel_update']:.2e}"
    worst = max(res["alt"][p]["rel"] for p in qk)
    assert worst > 1000 * PARITY_RTOL, f"{name}: indistinguishable from the run without QK-clip ({worst:.2e})"


def test_brute_max_logits_matches_a_loop():
    """The test models' recorder: max over batch and causal positions, GQA key heads shared."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 3), torch.randn(2, 2, 5, 3)
    want = torch.full((4,), float("-inf"))
    for b in range(2):
        for h in range(4):
            for i in range(5):
                for j in range(i + 1):
                    want[h] = max(want[h], float(q[b, h, i] @ k[b, h // 2, j]) * 0.5)
    torch.testing.assert_close(brute_max_logits(q, k, 0.5), want)
