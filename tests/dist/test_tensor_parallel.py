"""ds_muon under DeepSpeed's AutoTP (``tensor_parallel.autotp_size: 2``) at ZeRO stages 1/2 vs. the single-device oracle.

CPU, gloo, W=4 = TP 2 x DP 2 (global rank = 2 * dp + tp, DeepSpeed's mesh). A transformers ``LlamaForCausalLM``
built from a tiny config (hidden 32, 4 heads of 8, 2 KV heads, MLP 48, 2 layers, vocab 64; AutoTP splits q/k/v,
gate/up along their rows, o/down along their columns, and lm_head), 2 optimizer steps of GAS 2, gradient clipping
at 0.5 (active: the raw norm is above it), weight decay on. The tensor-parallel ranks of one data-parallel rank see
the same micro-batches (AutoTP checks it); the oracle ``ds_muon.MuonAdamW`` trains the whole unsplit model on every
data-parallel rank's micro-batches. After training each parameter's fp32 master is gathered over the data-parallel
group (``safe_get_full_fp32_param``) and its tensor-parallel shards over the tensor-parallel group, and the full
model is compared with the oracle parameter by parameter.

* ``tp_mode: "full"`` (the default), stages 1 and 2: ``harness.PARITY_RTOL`` (1e-5) of each parameter and 1e-3 of
  its update (fp32 everywhere), the global norm to 1e-5;
* ``tp_mode: "shard"``: the same tolerances against the shard-wise reference, the oracle with each split matrix
  declared as its tensor-parallel blocks (``muon_splits``: rows 16+16 of q, 8+8 of k/v, 24+24 of gate/up; columns of
  o/down), which orthogonalizes and shape-scales each block on its own as a shard-wise step does; and its distance
  from the full-matrix oracle, measured (``rel_update`` of the split Muon matrices) and required to be above 0.1.

Bytes per step of the owner exchange are recorded for both modes (``exchange_bytes``); the full mode moves more.
"""
from __future__ import annotations

import torch

from tests.support.autotp import MICRO, SPLIT, full_params, tiny_llama, tokens
from tests.support.harness import PARITY_RTOL, compare
from tests.support.spawn import run_distributed

TP, STEPS, GAS, CLIP = 2, 2, 2, 0.5
PARAMS = {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.05, "ns_dtype": "float32",
          "exchange_dtype": "float32"}
# The shard-wise reference: each matrix AutoTP splits, declared as its tensor-parallel blocks (TP=2).
SHARD_SPLITS = {"*q_proj.weight": [16, 16], "*k_proj.weight": [8, 8], "*v_proj.weight": [8, 8],
                "*gate_proj.weight": [24, 24], "*up_proj.weight": [24, 24],
                "*o_proj.weight": {"cols": [16, 16]}, "*down_proj.weight": {"cols": [24, 24]}}


def _engine_run(rank: int, case: dict) -> dict:
    import ds_muon
    params = {**PARAMS, **case.get("params", {})}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
           "optimizer": {"type": "Muon", "params": params}, "zero_optimization": {"stage": case["stage"]},
           "tensor_parallel": {"autotp_size": TP, **case.get("tp", {})}, "steps_per_print": 10_000}
    model = tiny_llama()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt = engine.optimizer
    dp = rank // TP
    norms = []
    for step in range(STEPS):
        for micro in range(GAS):
            ids = tokens(step, dp, micro)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    # the Muon matrices AutoTP left whole: this rank's copy (every tensor-parallel rank must hold the same one)
    from deepspeed.utils import safe_get_full_fp32_param
    whole = {n: safe_get_full_fp32_param(p).detach().float().cpu().clone() for n, p in model.named_parameters()
             if _muon(n) and not getattr(p, "tensor_model_parallel", False)}
    out = {"type": type(opt).__name__, "whole": whole, "norms": norms, "steps": opt.step_count,
           "exchange_bytes": opt.exchange_bytes(), "exchange_world": next(iter(opt.muon_plans.values())).world_size, "got": full_params(model, TP),
           "init": init}
    engine.destroy()
    return out


def _oracle(params: dict) -> tuple[dict, list[float]]:
    import ds_muon
    model = tiny_llama()
    opt = ds_muon.MuonAdamW(model, **params)
    trainable = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for dp in range(4 // TP):
            for micro in range(GAS):
                ids = tokens(step, dp, micro)
                (model(input_ids=ids, labels=ids).loss / (GAS * 4 // TP)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def worker(rank: int, world_size: int, cases: list[dict]) -> list[dict | None]:
    results = []
    for case in cases:
        out = _engine_run(rank, case)
        if rank == 0:
            full, out["ref_norms"] = _oracle(PARAMS)
            out["errors"] = compare(out["got"], full, out["init"])
            shard_ref, out["shard_ref_norms"] = _oracle({**PARAMS, "muon_splits": SHARD_SPLITS})
            out["shard_errors"] = compare(out["got"], shard_ref, out["init"])
            out["shard_ref_vs_full"] = compare(shard_ref, full, out["init"])
        out.pop("got"), out.pop("init")
        results.append(out if rank == 0 else {k: out[k] for k in ("type", "norms", "steps", "exchange_bytes", "whole")})
    return results


# AutoTP told to split the attention only (partition_config, no default specs): the MLP's gate/up/down matrices
# stay whole, replicated on both tensor-parallel ranks (one exchange slot per tensor-parallel rank each).
ATTENTION_ONLY = {"partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"}]}}
MLP = ("gate_proj", "up_proj", "down_proj")
CASES = [dict(name="stage2-full", stage=2), dict(name="stage1-full", stage=1),
         dict(name="stage2-shard", stage=2, params={"tp_mode": "shard"}),
         dict(name="stage2-full-mlp-whole", stage=2, tp=ATTENTION_ONLY)]


def _muon(name: str) -> bool:
    return name.endswith(".weight") and any(k in name for k in SPLIT)


def test_autotp_parity_with_oracle() -> None:
    results = run_distributed(worker, 4, CASES)
    bytes_of = {}
    for k, case in enumerate(CASES):
        res, name = results[0][k], case["name"]
        shard = case.get("params", {}).get("tp_mode") == "shard"
        assert res["type"] == "MuonZero12Optimizer", (name, res["type"])
        assert all(r[k]["steps"] == STEPS and r[k]["norms"] == res["norms"] for r in results), name
        errors = res["shard_errors"] if shard else res["errors"]
        worst = sorted(errors.items(), key=lambda kv: -kv[1]["rel_update"])[:4]
        print(name, "norms", res["norms"], res["ref_norms"], "worst:",
              [(n, f"{e['rel']:.1e}", f"{e['rel_update']:.1e}") for n, e in worst])
        ref_norms = res["shard_ref_norms"] if shard else res["ref_norms"]
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert max(res["ref_norms"]) > CLIP, f"{name}: clipping was never active"
        assert res["exchange_world"] == (2 if shard else 4), (name, res["exchange_world"])
        assert sum(_muon(n) for n in errors) == 14, sorted(errors)
        # which Muon matrices AutoTP left whole; each tensor-parallel rank's copy of them is the oracle's
        expect_whole = {n for n in errors if _muon(n) and any(m in n for m in MLP)} if "tp" in case else set()
        assert set(res["whole"]) == expect_whole and all(set(r[k]["whole"]) == expect_whole for r in results), (
            name, sorted(res["whole"]))
        differ = [(g, n) for g, r in enumerate(results) for n in expect_whole
                  if not torch.equal(r[k]["whole"][n], res["whole"][n])]
        assert not differ, f"{name}: tensor-parallel copies of a whole Muon matrix differ from rank 0's: {differ}"
        for pname, err in errors.items():
            assert err["rel"] <= PARITY_RTOL, f"{name}: {pname} rel error {err['rel']:.2e}"
            assert err["rel_update"] <= 1e-3, f"{name}: {pname} update rel error {err['rel_update']:.2e}"
        if shard:  # shard-wise is a different update: measured against the full-matrix oracle
            far = {n: e["rel_update"] for n, e in res["errors"].items() if _muon(n)}
            print(f"{name}: rel. update distance from the full-matrix oracle, min {min(far.values()):.3f} "
                  f"max {max(far.values()):.3f}")
            assert min(far.values()) > 0.1, far
        bytes_of[name] = [r[k]["exchange_bytes"] for r in results]
    print("exchange bytes per rank per step:", bytes_of)
    assert min(bytes_of["stage2-full"]) > max(bytes_of["stage2-shard"]), bytes_of
