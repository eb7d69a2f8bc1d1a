"""Adam-mini: the ZeRO-3 Adam-mini step against the single-device reference (ds_muon.AdamMini).

The block rules and the reference alone are tests/unit/test_adam_mini_rules.py.

ZeRO-3 parity (CPU, gloo, fp32): a tiny transformers Llama with GQA (4 query heads, 2 KV heads),
3 optimizer steps of GAS 2 with gradient clipping, against the reference trained on the same data;
W = 1, 2, 3 and 4 (both block rules at W=4; at W=3 the step cut into windows of 97 elements),
each world size one process group running all its cases. W=2 also runs CPU and NVMe optimizer offload
(NVMe on a wider Llama whose Adam-mini sub-group is swapped: swap calls counted), save/load/continue
against an uninterrupted run (also under NVMe), loads refused for another block rule or other head
blocks, and saves the checkpoint that W=1 and W=3 load after `to-universal`. Tolerance as
tests/dist/test_zero3_parity.py: 1e-5 relative to each parameter, 1e-3 relative to its update. Each run
also asserts that some Adam-mini block is split across ranks and (W=3) that some sub-group has padding
(so the cross-rank reduction and the padding are exercised), that the ZeRO-3 result is far from
AdamW's (so a path that ignores the blocks cannot pass), and that the engine steps norm weights with weight
decay 0.0 and every other parameter with the configured one (the reference shares the group builder, so parity
alone would not show decayed norms; tests/unit/test_adam_mini_rules.py trains the case where it shows).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.spawn import run_distributed
from tests.support.harness import (PARITY_RTOL, build_engine, compare, ds_config, gathered_params, group_decay, swap_dir_for,
                           train_engine, train_reference)

transformers = pytest.importorskip("transformers")

STEPS, GAS, CLIP = 3, 2, 0.5
PARAMS = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def llama():
    from tests.dist.test_moe_parity import llama as build
    return build()


def wide_llama():
    """The GQA Llama at hidden 256 (4 heads of 64, 2 KV heads, MLP 512): its decayed Adam-mini sub-group
    holds ~1.2M elements, so at W=2 each rank's shard (~590k fp32) exceeds DeepSpeed's 1 MiB NVMe swap
    minimum and is swapped; the embeddings/head (per element) and norms stay below it, in memory."""
    from tests.dist.test_moe_parity import _config, _lm
    return _lm(transformers.LlamaForCausalLM)(_config(transformers.LlamaConfig, hidden_size=256, intermediate_size=512,
                                                      head_dim=64))


def mini_config(gas: int = GAS, clip: float = CLIP, params: dict | None = None, **zero) -> dict:
    return ds_config(gas=gas, clip=clip, optimizer={"type": "AdamMini", "params": dict(PARAMS, **(params or {}))},
                     **zero)


# ------------------------------------------------------------------------------------------------
# ZeRO-3 parity
# ------------------------------------------------------------------------------------------------
def _oracle(init: dict, world_size: int, params: dict, adamw: bool = False, model_fn=llama):
    import ds_muon
    torch.manual_seed(0)
    ref = model_fn()
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
    from ds_muon.sharded.blocks import PADDING
    present, padding = {}, False
    for i, bm in opt.adam_mini_maps.items():
        present[i] = sorted({b for b, n in zip(bm.block_of_segment, bm.lengths) if b != PADDING and n})
        padding |= any(b == PADDING and n for b, n in zip(bm.block_of_segment, bm.lengths))
    return {"present": present, "padding": padding, "n_blocks": {i: bm.n_blocks for i, bm in opt.adam_mini_maps.items()}}


def _zero(case: dict, mode: str = "") -> dict:
    """The case's zero_optimization keys; an NVMe offload gets a fresh swap directory (per mode)."""
    import copy
    zero = copy.deepcopy(case.get("zero", {}))
    offload = zero.get("offload_optimizer", {})
    if offload.get("device") == "nvme":
        offload["nvme_path"] = swap_dir_for(os.path.join(case["root"], f"swap-{case['name']}{mode}"))
        os.makedirs(offload["nvme_path"], exist_ok=True)
    return zero


def _swap_probe(engine) -> dict:
    """Per sub-group of an NVMe run: swapped?, Adam-mini?, the swap calls counted by tests.dist.test_offload's
    probe, the state tensors the swapper latched, and whether the block moments are marked in memory."""
    from ds_muon.names import BLOCK_STATE_KEY
    from tests.dist.test_offload import probe_finish
    opt = engine.optimizer
    out = probe_finish(engine)["sub_groups"]
    out[0]["buffers_needed"] = opt.swap_buffers_needed()
    for i, (g, fp32) in enumerate(zip(out, opt.fp32_partitioned_groups_flat)):
        g["adam_mini"] = i in opt.adam_mini_maps
        v = opt.optimizer.state.get(fp32, {}).get(BLOCK_STATE_KEY)
        g["blocks_in_memory"] = v is not None and v.numel() > 0 and not getattr(v, "swappable", True)
    return out


def _resume_case(rank: int, world_size: int, case: dict) -> dict:
    """4 steps uninterrupted vs. 2 steps, save, a new engine loads and runs 2 more: bit-exact."""
    from tests.dist.test_checkpoint import _train_range
    ckpt = os.path.join(case["root"], f"ckpt-{case['name']}")
    model_fn = wide_llama if case.get("wide") else llama
    snaps = {}
    for mode in ("continuous", "save", "load"):
        engine, _ = build_engine(mini_config(**_zero(case, mode)), model_fn=model_fn)
        if mode == "continuous":
            _train_range(engine, rank, 0, 4, GAS)
        elif mode == "save":
            _train_range(engine, rank, 0, 2, GAS)
            engine.save_checkpoint(ckpt, tag="t")
        else:
            engine.load_checkpoint(ckpt, tag="t")
            _train_range(engine, rank, 2, 4, GAS)
        snaps[mode] = _full_state(engine)
        if mode == "load":
            swapped = [bool(engine.optimizer._swappable_optimizer_subgroup(i))
                       for i in range(len(engine.optimizer.fp16_groups))]
        engine.destroy()
    want, got = snaps["continuous"], snaps["load"]
    assert want.keys() == got.keys()
    same = {k: torch.equal(want[k], got[k]) if torch.is_tensor(want[k]) else want[k] == got[k] for k in want}
    return {"differ": [str(k) for k, ok in same.items() if not ok], "swapped": swapped,
            "n_block_states": sum(1 for k in want if k[1] == "block_exp_avg_sq")}


# ---- universal checkpoints and load checks ------------------------------------------------------
UNIVERSAL_TAG = "half"


def _cross_config(world_size: int, universal: bool = False, **params) -> dict:
    """GAS 1 on tests.models.shared_batch: the same 6-row global batch at W = 1, 2, 3 (as test_checkpoint)."""
    from tests.support.models import GLOBAL_BATCH
    cfg = ds_config(gas=1, clip=CLIP, micro_batch=GLOBAL_BATCH // world_size,
                    optimizer={"type": "AdamMini", "params": dict(PARAMS, **params)})
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _full_state(engine) -> dict:
    """Rank-independent full state: per parameter its fp32 weights, exp_avg and (Adam-mini blocks) its
    slice of block_exp_avg_sq; per optimizer param group the step. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from ds_muon.names import BLOCK_ATTR, BLOCK_STATE_KEY
    opt = engine.optimizer
    out = {}
    for name, p in engine.module.named_parameters():
        out[(name, "fp32")] = safe_get_full_fp32_param(p).clone()
        out[(name, "exp_avg")] = safe_get_full_optimizer_state(p, "exp_avg").clone()
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        state = opt.optimizer.state.get(fp32, {})
        out[(opt.sub_group_to_group_id[i], "step")] = int(state["step"])
        if BLOCK_STATE_KEY in state:
            sizes = [p.ds_numel // getattr(p, BLOCK_ATTR) for p in opt.fp16_groups[i]]
            for p, v in zip(opt.fp16_groups[i], state[BLOCK_STATE_KEY].split(sizes)):
                out[(opt.param_names[p], BLOCK_STATE_KEY)] = v.clone()
    return out


def _universal_save_case(rank: int, world_size: int, case: dict) -> dict | None:
    """2 steps at this W on the shared data, save; rank 0 returns the initial weights and the full state."""
    from tests.support.models import GLOBAL_BATCH, shared_batch
    from tests.dist.test_checkpoint import _train_range
    engine, model = build_engine(_cross_config(world_size), model_fn=llama)
    init = gathered_params(model)
    _train_range(engine, rank, 0, 2, 1, shared_batch, GLOBAL_BATCH // world_size)
    engine.save_checkpoint(os.path.join(case["root"], "universal-src"), tag=UNIVERSAL_TAG)
    state = _full_state(engine)
    engine.destroy()
    return {"init": init, "saved": state} if rank == 0 else None


def _universal_load_case(rank: int, world_size: int, case: dict) -> dict | None:
    """Load the converted checkpoint at this W, 2 more steps; then a load with the other block rule
    must fail naming optimizer.params.block_rule."""
    from ds_muon.checkpoint import CheckpointError
    from tests.support.models import GLOBAL_BATCH, shared_batch
    from tests.dist.test_checkpoint import _train_range
    engine, model = build_engine(_cross_config(world_size, universal=True), model_fn=llama)
    engine.load_checkpoint(case["src"])
    loaded = _full_state(engine)
    _train_range(engine, rank, 2, 4, 1, shared_batch, GLOBAL_BATCH // world_size)
    final = gathered_params(model)
    engine.destroy()
    engine, _ = build_engine(_cross_config(world_size, universal=True, block_rule="neuron"), model_fn=llama)
    try:
        engine.load_checkpoint(case["src"])
        error = None
    except CheckpointError as err:
        error = str(err)
    engine.destroy()
    return {"loaded": loaded, "final": final, "error": error} if rank == 0 else {"error": error}


def _regrouped_heads():
    """The tiny Llama with 2 heads of 16 (1 KV head) instead of 4 of 8 (2 KV heads): every parameter keeps
    its shape, but the query/key blocks are 16 rows instead of 8."""
    from tests.dist.test_moe_parity import _config, _lm
    return _lm(transformers.LlamaForCausalLM)(_config(transformers.LlamaConfig, num_attention_heads=2,
                                                      num_key_value_heads=1, head_dim=16))


def _load_errors_case(rank: int, world_size: int, case: dict) -> list:
    """Load the "resume" case's checkpoint (block_rule default) with block_rule neuron, and into a model
    whose heads regroup the same shapes: each must raise CheckpointError on every rank; the latter's
    weights-only load (load_optimizer_states=False) must not."""
    from ds_muon.checkpoint import CheckpointError
    out = []
    for params, model_fn, states in (({"block_rule": "neuron"}, llama, True), ({}, _regrouped_heads, True),
                                     ({}, _regrouped_heads, False)):
        engine, _ = build_engine(mini_config(params=params), model_fn=model_fn)
        try:  # the third is a weights-only load: no second moments, so other blocks are fine
            engine.load_checkpoint(os.path.join(case["root"], "ckpt-resume"), tag="t", load_optimizer_states=states)
            out.append(None)
        except CheckpointError as err:
            out.append(str(err))
        engine.destroy()
    return out


def _run_case(rank: int, world_size: int, case: dict) -> dict:
    if case.get("resume"):
        return _resume_case(rank, world_size, case)
    special = {"universal-save": _universal_save_case, "universal-load": _universal_load_case,
               "load-errors": _load_errors_case}
    if case["name"] in special:
        return special[case["name"]](rank, world_size, case)
    import ds_muon.core.adam_update as am
    from tests.dist.test_offload import probe_start
    if case.get("chunk"):  # windows of a few elements: they cut segments, blocks and padding
        am.CHUNK_ELEMENTS, default_chunk = case["chunk"], am.CHUNK_ELEMENTS
    cfg = mini_config(params=case.get("params"), **_zero(case))
    if case.get("monitor"):
        cfg["csv_monitor"] = {"enabled": True, "output_path": case["root"], "job_name": "mini"}
    model_fn = wide_llama if case.get("wide") else llama
    engine, model = build_engine(cfg, model_fn=model_fn)
    nvme = case.get("zero", {}).get("offload_optimizer", {}).get("device") == "nvme"
    if nvme:
        probe_start(engine)
    init = gathered_params(model)
    norms = train_engine(engine, STEPS, rank, GAS)
    got = gathered_params(model)
    layout = _layout(engine.optimizer, rank)
    out = {"norms": norms, "layout": layout, "probe": _swap_probe(engine) if nvme else None,
           "windows": sum(len(step._index[0]) for step in engine.optimizer.adam_mini_steps.values() if step._index),
           "decay": group_decay(engine.optimizer)}
    engine.destroy()
    if case.get("chunk"):
        am.CHUNK_ELEMENTS = default_chunk
    if case.get("monitor") and rank == 0:
        import csv
        import glob
        out["csv"] = {}
        for path in glob.glob(os.path.join(case["root"], "mini", "Train_ds_muon_*.csv")):
            with open(path) as f:
                out["csv"][os.path.basename(path)] = [row[1] for row in list(csv.reader(f))[1:]]
    if rank == 0:
        params = cfg["optimizer"]["params"]
        out["errors"] = compare(got, _oracle(init, world_size, params, model_fn=model_fn), init)
        out["adamw"] = compare(got, _oracle(init, world_size, params, adamw=True, model_fn=model_fn), init)
    return out


def adam_mini_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [_run_case(rank, world_size, case) for case in cases]


CASES = {
    1: [dict(name="plain"), dict(name="universal-load")],
    2: [dict(name="plain", monitor=True), dict(name="cpu-offload", zero={"offload_optimizer": {"device": "cpu"}}),
        dict(name="resume", resume=True),
        # NVMe (partitioned swapper, the decayed Adam-mini sub-group swapped): parity, swap counts, resume
        # buffer_count 3: exactly the need (fp32, gradient, exp_avg of the one swapped sub-group)
        dict(name="nvme", wide=True, zero={"offload_optimizer": {"device": "nvme", "buffer_count": 3}}),
        dict(name="nvme-resume", wide=True, resume=True, zero={"offload_optimizer": {"device": "nvme"}}),
        dict(name="load-errors"),  # loads "resume"'s checkpoint
        dict(name="universal-save"),
        # ZeRO stages 1/2 (MuonZero12Optimizer): blocks cut by the flat partitions' boundaries
        dict(name="stage2", zero={"stage": 2}),
        dict(name="stage1-cpu-offload", zero={"stage": 1, "offload_optimizer": {"device": "cpu"}})],
    # the chunked step with windows of 97 elements (default: CHUNK_ELEMENTS, one window per shard here)
    3: [dict(name="plain-97-element-windows", chunk=97), dict(name="universal-load"),
        dict(name="stage2-97-element-windows", chunk=97, zero={"stage": 2})],
    4: [dict(name="plain"), dict(name="neuron-rule", params={"block_rule": "neuron"})],
}


def _check(world_size: int, case: dict, results: list[dict]) -> None:
    errors = results[0]["errors"]
    worst = max(errors.values(), key=lambda e: e["rel"])
    for name, e in errors.items():
        assert e["moved"] > 0, f"{case['name']}: {name} did not move"
        assert e["rel"] < PARITY_RTOL, f"{case['name']} W={world_size}: {name} differs from the reference: {e}"
        assert e["rel_update"] < 1e-3, f"{case['name']} W={world_size}: {name} update differs: {e}"
    # weight decay as the engine steps it: none on norm weights (and biases), the configured one elsewhere
    decay = results[0]["decay"]
    assert set(decay) == set(errors), (case["name"], sorted(decay))
    want = {n: 0.0 if "norm" in n or n.endswith(".bias") else PARAMS["weight_decay"] for n in decay}
    assert decay == want, f"{case['name']} W={world_size}: weight decay per parameter {decay}, want {want}"
    assert 0.0 in want.values() and PARAMS["weight_decay"] in want.values()
    # gradient clipping acted: the raw global norm (what clipping compares with CLIP) exceeded it in some step
    assert any(n > CLIP for n in results[0]["norms"]), (case["name"], results[0]["norms"], CLIP)
    far = [n for n, e in results[0]["adamw"].items() if e["rel_update"] > 1e-2]
    assert far, f"{case['name']}: ZeRO-3 Adam-mini is indistinguishable from AdamW (worst {worst})"
    if world_size > 1:
        groups = results[0]["layout"]["present"]
        split = [(i, b) for i in groups for b in range(results[0]["layout"]["n_blocks"][i])
                 if sum(b in r["layout"]["present"][i] for r in results) > 1]
        assert split, f"{case['name']} W={world_size}: no Adam-mini block spans two ranks"
        if world_size == 3:  # every size of the model is even, so W=3 pads (W=2 does not)
            assert any(r["layout"]["padding"] for r in results), f"{case['name']} W={world_size}: no padding"


def _check_swaps(case: dict, probes: list[list[dict]]) -> None:
    """NVMe: an Adam-mini sub-group is swapped; every swapped sub-group is read and written once per
    step; an Adam-mini one swaps ``exp_avg`` only (its block second moments stay in memory)."""
    for rank, groups in enumerate(probes):
        assert any(g["swapped"] and g["adam_mini"] for g in groups), f"rank {rank}: no Adam-mini sub-group swapped"
        assert sum(g["swapped"] for g in groups) == 1 and groups[0]["buffers_needed"] == 3, (rank, groups)
        for g in groups:
            if not g["swapped"]:
                continue
            assert g["calls"] == {"in": STEPS, "out": STEPS, "read": STEPS, "write": STEPS}, (case["name"], rank, g)
            if g["adam_mini"]:
                assert g["swap_tensors"] == ["exp_avg"] and g["blocks_in_memory"], (case["name"], rank, g)


@pytest.fixture(scope="module")
def w2_run(tmp_path_factory) -> dict:
    """The W=2 process group (all CASES[2]); then the universal-save checkpoint converted with
    ``python -m ds_muon.checkpoint to-universal``'s function."""
    from ds_muon.checkpoint import convert_to_universal
    root = str(tmp_path_factory.mktemp("adam_mini_w2"))
    cases = [dict(case, root=root) for case in CASES[2]]
    per_rank = run_distributed(adam_mini_worker, 2, cases)
    universal = os.path.join(root, "universal")
    convert_to_universal(os.path.join(root, "universal-src"), universal, UNIVERSAL_TAG)
    return {"cases": cases, "per_rank": per_rank, "universal": universal,
            "saved": per_rank[0][[c["name"] for c in cases].index("universal-save")]}


def _universal_oracle(init: dict) -> dict:
    """ds_muon.AdamMini, 4 steps on the shared 6-row batch (as the W=2 -> W' runs see it)."""
    import ds_muon
    from tests.support.models import GLOBAL_BATCH, shared_batch
    ref = llama()
    for name, p in ref.named_parameters():
        p.data.copy_(init[name])
    opt = ds_muon.AdamMini(ref, **PARAMS)
    train_reference(ref, opt, 4, 1, 1, CLIP, micro_batch=GLOBAL_BATCH, data=shared_batch)
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _check_universal(world_size: int, saved: dict, results: list[dict]) -> None:
    """Right after loading at W: the full state equals the W=2 save bit for bit (block moments included);
    after 2 more steps: the reference within the parity tolerance; the neuron-rule load was refused."""
    res = results[0]
    assert res["loaded"].keys() == saved["saved"].keys()
    assert any(k[1] == "block_exp_avg_sq" for k in saved["saved"]), "no Adam-mini block moments were saved"
    for key, want in saved["saved"].items():
        got = res["loaded"][key]
        assert (torch.equal(got, want) if torch.is_tensor(want) else got == want), f"W=2 -> {world_size}: {key} differs"
    for name, e in compare(res["final"], _universal_oracle(saved["init"]), saved["init"]).items():
        assert e["moved"] > 0 and e["rel"] < PARITY_RTOL and e["rel_update"] < 1e-3, f"W=2 -> {world_size} {name}: {e}"
    for r in results:
        assert r["error"] and "optimizer.params.block_rule: the checkpoint was saved with 'default'" in r["error"], r


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zero3_adam_mini_matches_reference(world_size: int, tmp_path, request) -> None:
    if world_size == 2:
        run = request.getfixturevalue("w2_run")
        cases, per_rank = run["cases"], run["per_rank"]
    else:
        src = request.getfixturevalue("w2_run")["universal"] if any(
            c["name"] == "universal-load" for c in CASES[world_size]) else None
        cases = [dict(case, root=str(tmp_path), src=src) for case in CASES[world_size]]
        per_rank = run_distributed(adam_mini_worker, world_size, cases)
    for k, case in enumerate(cases):
        if case["name"] == "universal-save":
            continue
        if case["name"] == "universal-load":
            _check_universal(world_size, request.getfixturevalue("w2_run")["saved"], [r[k] for r in per_rank])
            continue
        if case["name"] == "load-errors":
            for r in per_rank:
                rule, heads, weights_only = r[k]
                assert weights_only is None, weights_only
                assert rule and "optimizer.params.block_rule: the checkpoint was saved with 'default', this run has " \
                    "'neuron'" in rule, rule
                assert heads and "parameter 'model.layers.0.self_attn.q_proj.weight': Adam-mini blocks of 256 " \
                    "elements in the checkpoint, Adam-mini blocks of 512 elements in this run" in heads, heads
            continue
        if case.get("resume"):
            for r in per_rank:
                assert r[k]["n_block_states"] > 0 and not r[k]["differ"], f"{case['name']}: resume differs: {r[k]}"
                assert any(r[k]["swapped"]) is bool(case.get("wide")), f"{case['name']}: swapped {r[k]['swapped']}"
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
        n_groups = len(per_rank[0][k]["layout"]["n_blocks"])
        for r in per_rank:  # the shard is cut into windows only when asked: CHUNK_ELEMENTS exceeds every shard
            assert (r[k]["windows"] > 10 * n_groups) if case.get("chunk") else r[k]["windows"] == n_groups, r[k]
        if case.get("zero", {}).get("offload_optimizer", {}).get("device") == "nvme":
            _check_swaps(case, [r[k]["probe"] for r in per_rank])
        norms = {tuple(round(x, 6) for x in r[k]["norms"]) for r in per_rank}
        assert len(norms) == 1, f"{case['name']}: ranks disagree on the gradient norm: {norms}"
