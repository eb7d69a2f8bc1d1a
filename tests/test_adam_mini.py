"""Adam-mini: the single-device reference (ds_muon.AdamMini) and the ZeRO-3 Adam-mini step against it.

Reference checks (no process group): the block rules on a tiny GQA Llama, per-element blocks equal
torch.optim.AdamW, and a block step equals the formula written out by hand.

ZeRO-3 parity (CPU, gloo, fp32): a tiny transformers Llama with GQA (4 query heads, 2 KV heads),
3 optimizer steps of GAS 2 with gradient clipping, against the reference trained on the same data;
W = 1, 2, 3 and 4 (the neuron block rule at W=4), each world size one process group running all its cases (W=2 also CPU offload and
save/load/continue against an uninterrupted run). Tolerance as
tests/test_zero3_parity.py: 1e-5 relative to each parameter, 1e-3 relative to its update. Each run
also asserts that some Adam-mini block is split across ranks and (W=3) that some sub-group has padding
(so the cross-rank reduction and the padding are exercised), and that the ZeRO-3 result is far from
AdamW's (so a path that ignores the blocks cannot pass).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.dist_util import run_distributed
from tests.harness import PARITY_RTOL, build_engine, compare, ds_config, gathered_params, train_engine, train_reference

transformers = pytest.importorskip("transformers")

STEPS, GAS, CLIP = 3, 2, 0.5
PARAMS = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def llama():
    from tests.test_moe_parity import llama as build
    return build()


def mini_config(gas: int = GAS, clip: float = CLIP, params: dict | None = None, **zero) -> dict:
    return ds_config(gas=gas, clip=clip, optimizer={"type": "AdamMini", "params": dict(PARAMS, **(params or {}))},
                     **zero)


# ------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------
def test_block_rules_on_gqa_llama() -> None:
    from ds_muon.adam_mini import PER_ELEMENT, adam_mini_blocks, adam_mini_plan
    model = llama()
    blocks = adam_mini_blocks(model)
    assert blocks["model.embed_tokens.weight"] == PER_ELEMENT
    assert blocks["lm_head.weight"] == PER_ELEMENT
    assert blocks["model.layers.0.self_attn.q_proj.weight"] == 8 * 32  # 4 heads of head_dim 8 rows x 32 cols
    assert blocks["model.layers.0.self_attn.k_proj.weight"] == 8 * 32  # GQA: 2 kv heads
    assert blocks["model.layers.0.self_attn.v_proj.weight"] == 16 * 32  # whole tensor
    assert blocks["model.layers.0.mlp.down_proj.weight"] == 32 * 48
    assert blocks["model.norm.weight"] == 32
    plan = adam_mini_plan(model)
    assert not plan["model.norm.weight"].decay and plan["model.layers.0.mlp.up_proj.weight"].decay
    neuron = adam_mini_blocks(model, "neuron")
    assert neuron["model.layers.0.mlp.down_proj.weight"] == 48 and neuron["lm_head.weight"] == 32
    assert neuron["model.layers.0.self_attn.k_proj.weight"] == 8 * 32
    with pytest.raises(ValueError, match="block_rule"):
        adam_mini_plan(model, "rows")


def test_reference_per_element_is_adamw_and_block_matches_formula() -> None:
    import ds_muon
    from ds_muon.adam_mini import BLOCK_ATTR
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    p_elem, p_block, p_torch = (torch.nn.Parameter(w.clone()) for _ in range(3))
    setattr(p_block, BLOCK_ATTR, 8)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mini = ds_muon.AdamMini([dict(params=[p_elem], adam_mini=False, use_muon=False, **kw),
                             dict(params=[p_block], adam_mini=True, use_muon=False, **kw)], lr=1e-2)
    ref = torch.optim.AdamW([p_torch], **kw)
    m = torch.zeros(24)
    v = torch.zeros(3)
    x = w.clone().view(-1)
    for t in range(1, 4):
        g = torch.randn(6, 4)
        for p in (p_elem, p_block, p_torch):
            p.grad = g.clone()
        mini.step()
        ref.step()
        gf = g.view(-1)
        m = 0.9 * m + 0.1 * gf
        v = 0.95 * v + 0.05 * gf.view(3, 8).square().mean(1)
        denom = (v.sqrt() / math.sqrt(1 - 0.95**t) + 1e-8).repeat_interleave(8)
        x = x * (1 - 1e-2 * 0.1) - 1e-2 * (m / (1 - 0.9**t)) / denom
    torch.testing.assert_close(p_elem.data, p_torch.data, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p_block.data.view(-1), x, rtol=1e-6, atol=1e-7)
    assert mini.state[p_block]["block_exp_avg_sq"].shape == (3,)


def test_config_errors_name_the_key() -> None:
    from ds_muon.config import ConfigError, parse_adam_mini_params, validate_adam_mini_config
    with pytest.raises(ConfigError, match=r"optimizer.params.betaz: unknown key.*did you mean 'betas'"):
        parse_adam_mini_params({"betaz": [0.9, 0.9]})
    with pytest.raises(ConfigError, match=r"optimizer.params.block_rule: 'rows' is invalid.*'default', 'neuron'"):
        parse_adam_mini_params({"block_rule": "rows"})
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: 2 is invalid.*stage 3"):
        validate_adam_mini_config({"optimizer": {"type": "AdamMini"}, "zero_optimization": {"stage": 2}})
    assert validate_adam_mini_config({"optimizer": {"type": "AdamW"}}) is None
    base = {"optimizer": {"type": "AdamMini"}, "zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match=r"zero_optimization.zenflow: is not supported"):
        validate_adam_mini_config(dict(base, zero_optimization={"stage": 3, "zenflow": {"topk_ratio": 0.1}}))
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size: 2 is invalid"):
        validate_adam_mini_config(dict(base, tensor_parallel={"autotp_size": 2}))


def test_zero_d_parameter_is_refused_before_the_engine() -> None:
    """The AdamMini path checks parameters as the Muon path does: a 0-D trainable parameter is named."""
    import types

    from ds_muon import integration
    model = torch.nn.Module()
    model.temperature = torch.nn.Parameter(torch.tensor(1.0))
    cfg = types.SimpleNamespace(_param_dict={"optimizer": {"type": "AdamMini", "params": {"lr": 1e-3}},
                                             "zero_optimization": {"stage": 3}})
    with pytest.raises(Exception, match=r"temperature.*0-D"):
        integration._set_optimizer_flags(cfg, model)


# ------------------------------------------------------------------------------------------------
# ZeRO-3 parity
# ------------------------------------------------------------------------------------------------
def _oracle(init: dict, world_size: int, params: dict, adamw: bool = False):
    import ds_muon
    torch.manual_seed(0)
    ref = llama()
    for name, p in ref.named_parameters():
        p.data.copy_(init[name])
    if adamw:
        opt = torch.optim.AdamW(ref.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                                weight_decay=params["weight_decay"])
    else:
        opt = ds_muon.AdamMini(ref, **params)
    train_reference(ref, opt, STEPS, world_size, GAS, CLIP)
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _layout(opt, rank: int) -> dict:
    """Which blocks have elements on this rank, and whether this rank's shards hold padding."""
    from ds_muon.blocks import PADDING
    present, padding = {}, False
    for i, bm in opt.adam_mini_maps.items():
        present[i] = sorted({b for b, n in zip(bm.block_of_segment, bm.lengths) if b != PADDING and n})
        padding |= any(b == PADDING and n for b, n in zip(bm.block_of_segment, bm.lengths))
    return {"present": present, "padding": padding, "n_blocks": {i: bm.n_blocks for i, bm in opt.adam_mini_maps.items()}}


def _state_snapshot(engine) -> dict:
    """Full fp32 weights and first moments per parameter, and every sub-group's step and block moments. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from ds_muon.adam_mini import BLOCK_STATE_KEY
    opt = engine.optimizer
    out = {}
    for name, p in engine.module.named_parameters():
        out[(name, "fp32")] = safe_get_full_fp32_param(p).clone()
        out[(name, "exp_avg")] = safe_get_full_optimizer_state(p, "exp_avg").clone()
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        state = opt.optimizer.state.get(fp32, {})
        out[(i, "step")] = int(state["step"])
        if BLOCK_STATE_KEY in state:
            out[(i, BLOCK_STATE_KEY)] = state[BLOCK_STATE_KEY].clone()
    return out


def _resume_case(rank: int, world_size: int, case: dict) -> dict:
    """4 steps uninterrupted vs. 2 steps, save, a new engine loads and runs 2 more: bit-exact."""
    from tests.test_checkpoint import _train_range
    ckpt = os.path.join(case["root"], "ckpt")
    snaps = {}
    for mode in ("continuous", "save", "load"):
        engine, _ = build_engine(mini_config(), model_fn=llama)
        if mode == "continuous":
            _train_range(engine, rank, 0, 4, GAS)
        elif mode == "save":
            _train_range(engine, rank, 0, 2, GAS)
            engine.save_checkpoint(ckpt, tag="t")
        else:
            engine.load_checkpoint(ckpt, tag="t")
            _train_range(engine, rank, 2, 4, GAS)
        snaps[mode] = _state_snapshot(engine)
        engine.destroy()
    want, got = snaps["continuous"], snaps["load"]
    assert want.keys() == got.keys()
    same = {k: torch.equal(want[k], got[k]) if torch.is_tensor(want[k]) else want[k] == got[k] for k in want}
    return {"differ": [str(k) for k, ok in same.items() if not ok],
            "n_block_states": sum(1 for k in want if k[1] == "block_exp_avg_sq")}


def _run_case(rank: int, world_size: int, case: dict) -> dict:
    if case.get("resume"):
        return _resume_case(rank, world_size, case)
    cfg = mini_config(params=case.get("params"), **case.get("zero", {}))
    if case.get("monitor"):
        cfg["csv_monitor"] = {"enabled": True, "output_path": case["root"], "job_name": "mini"}
    engine, model = build_engine(cfg, model_fn=llama)
    init = gathered_params(model)
    norms = train_engine(engine, STEPS, rank, GAS)
    got = gathered_params(model)
    layout = _layout(engine.optimizer, rank)
    engine.destroy()
    out = {"norms": norms, "layout": layout}
    if case.get("monitor") and rank == 0:
        import csv
        import glob
        out["csv"] = {}
        for path in glob.glob(os.path.join(case["root"], "mini", "Train_ds_muon_*.csv")):
            with open(path) as f:
                out["csv"][os.path.basename(path)] = [row[1] for row in list(csv.reader(f))[1:]]
    if rank == 0:
        params = cfg["optimizer"]["params"]
        out["errors"] = compare(got, _oracle(init, world_size, params), init)
        out["adamw"] = compare(got, _oracle(init, world_size, params, adamw=True), init)
    return out


def adam_mini_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [_run_case(rank, world_size, case) for case in cases]


CASES = {
    1: [dict(name="plain")],
    2: [dict(name="plain", monitor=True), dict(name="cpu-offload", zero={"offload_optimizer": {"device": "cpu"}}),
        dict(name="resume", resume=True)],
    3: [dict(name="plain")],
    4: [dict(name="neuron-rule", params={"block_rule": "neuron"})],
}


def _check(world_size: int, case: dict, results: list[dict]) -> None:
    errors = results[0]["errors"]
    worst = max(errors.values(), key=lambda e: e["rel"])
    for name, e in errors.items():
        assert e["moved"] > 0, f"{case['name']}: {name} did not move"
        assert e["rel"] < PARITY_RTOL, f"{case['name']} W={world_size}: {name} differs from the reference: {e}"
        assert e["rel_update"] < 1e-3, f"{case['name']} W={world_size}: {name} update differs: {e}"
    far = [n for n, e in results[0]["adamw"].items() if e["rel_update"] > 1e-2]
    assert far, f"{case['name']}: ZeRO-3 Adam-mini is indistinguishable from AdamW (worst {worst})"
    if world_size > 1:
        groups = results[0]["layout"]["present"]
        split = [(i, b) for i in groups for b in range(results[0]["layout"]["n_blocks"][i])
                 if sum(b in r["layout"]["present"][i] for r in results) > 1]
        assert split, f"{case['name']} W={world_size}: no Adam-mini block spans two ranks"
        if world_size == 3:  # every size of the model is even, so W=3 pads (W=2 does not)
            assert any(r["layout"]["padding"] for r in results), f"{case['name']} W={world_size}: no padding"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zero3_adam_mini_matches_reference(world_size: int, tmp_path) -> None:
    cases = [dict(case, root=str(tmp_path)) for case in CASES[world_size]]
    per_rank = run_distributed(adam_mini_worker, world_size, cases)
    for k, case in enumerate(cases):
        if case.get("resume"):
            for r in per_rank:
                assert r[k]["n_block_states"] > 0 and not r[k]["differ"], f"resume differs: {r[k]}"
            continue
        _check(world_size, case, [r[k] for r in per_rank])
        if case.get("monitor"):  # Adam-mini's own time and lr; no Muon events (no Muon in an AdamMini run)
            csvs = per_rank[0][k]["csv"]
            assert set(csvs) == {"Train_ds_muon_adam_mini_seconds.csv", "Train_ds_muon_adam_mini_lr.csv",
                                 "Train_ds_muon_adam_lr.csv"}, csvs
            assert all(len(rows) == STEPS for rows in csvs.values()), csvs
            assert all(float(x) > 0 for x in csvs["Train_ds_muon_adam_mini_seconds.csv"]), csvs
            for name in ("Train_ds_muon_adam_mini_lr.csv", "Train_ds_muon_adam_lr.csv"):
                assert [float(x) for x in csvs[name]] == [PARAMS["lr"]] * STEPS, csvs
        norms = {tuple(round(x, 6) for x in r[k]["norms"]) for r in per_rank}
        assert len(norms) == 1, f"{case['name']}: ranks disagree on the gradient norm: {norms}"
