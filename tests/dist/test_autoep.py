"""DeepSpeed AutoEP (expert parallelism) under ds_muon, against the single-device oracle: W=4 = EP 2 x EDP 2.

One process group of 4 CPU/gloo ranks, a tiny transformers ``Qwen3MoeForCausalLM`` built from a config (2 layers, 6
experts of width 16, top 2, ``ds_muon_sdpa`` attention; ``tests/support/autoep.py``) with ``"expert_parallel":
{"enabled": true, "autoep_size": 2, "use_grouped_mm": false}``. DeepSpeed swaps each MoE block for an
``AutoEPMoELayer``: ``router.gate`` on every rank, and each expert-parallel rank's 3 local experts as
``experts.w1`` (gate), ``w3`` (up), ``w2`` (down), each ``[3, out, in]``, partitioned over its expert-data-parallel
group ({0, 2} and {1, 3}; expert-parallel groups {0, 1}, {2, 3}). 3 local experts over 2 partitions: a ZeRO-3 chunk
is not a whole expert, so an exchange over the wrong ranks cannot come out right by accident. In order:

1. Without the test-only transformers shim (CI's transformers 5.25.0, the test extra's pin): DeepSpeed alone, with its AdamW, fails inside
   ``deepspeed.initialize`` with its ``TypeError`` (the ``_CanRecordRegistry.get`` incompatibility), and
   ``ds_muon.initialize`` refuses first with a ``ConfigError`` naming it and the transformers releases that work.
   (With a transformers whose registry is a plain dict, both build instead; asserted too. Passes with 5.22.2.)
2. With :func:`tests.support.autoep.registry_shim`: DeepSpeed's AdamW at ZeRO-3, one step: its reported gradient
   norm.
3. ds_muon at ZeRO-3: 2 steps, ``save_checkpoint``, a third step. Then a second engine: ``load_checkpoint`` (fp32
   weights, Muon momentum, Adam moments and step counts equal to the saved ones bit for bit on every rank) and the
   third step again (equal to the first engine's bit for bit). AdamW betas (0.5, 0.75), exact in fp32 (see
   tests/dist/test_checkpoint.py). ``python -m ds_muon.checkpoint to-universal`` refuses the checkpoint.
4. The same at ZeRO-2 and ZeRO-1 (DeepSpeed's ``moe`` param groups, partitioned over the expert-data-parallel group).

GAS 2, gradient clipping 0.5 (active: asserted), QK-clip (threshold 2.5: 3, 1, 0 heads clipped in the 3 steps),
fp32, Newton–Schulz and exchange in fp32. The oracle (``ds_muon.MuonAdamW`` on the un-parallelised model, one
process, its own parameter selection) trains on all 4 ranks' micro-batches; each expert-parallel rank's
``w1``/``w3``/``w2`` are put back into transformers' ``gate_up_proj`` / ``down_proj``
(:func:`tests.support.autoep.to_hf`). DeepSpeed divides the expert gradients, summed over the expert-data-parallel
group, by the whole data-parallel size (``_gradient_averaging_world_size``), like the dense ones: the oracle's mean
gradient, unscaled. Asserted per stage: the router on AdamW and every expert matrix on Muon (one Newton–Schulz
block per local expert, gate and up apart), the same split as the oracle's own; the expert sub-group's owner
exchange over its expert-data-parallel group (2 ranks), the dense ones' over all 4; the gradient norms equal on
every rank, to DeepSpeed's AdamW engine's at step 1 (1e-6) and to the oracle's (1e-5); QK-clip's per-head max
logits (1e-5) and clipped heads as the oracle's; every parameter within 1e-5 of the oracle's (relative to the
parameter) and 1e-3 (relative to its update), as tests/dist/test_zero3_parity.py (measured 5.7e-7 and 4.4e-6).

Broken by hand, it fails (docs/parallelism.md, "AutoEP"): the router rule not looking inside AutoEP's router module
(``router.gate`` tagged Muon); the expert sub-groups' exchange over the expert-parallel group (the group check;
without it the norms, 4.5e-5 off); the expert gradients averaged over the expert-data-parallel group instead of the
data-parallel world (EP times too large; norms 1.3e-4 off); QK-clip's maxima all-reduced over the
expert-data-parallel group (norms 2.2e-3 off).
"""
from __future__ import annotations

import pytest
import torch

from tests.support.autoep import AUTOEP, EP, EXPERTS, hf_name, qwen3_moe, registry_shim, to_hf
from tests.support.families import tokens
from tests.support.harness import (MUON_PARAMS, PARITY_RTOL, assert_same_state, compare, state_snapshot,
                                   train_reference)
from tests.support.spawn import run_distributed

transformers = pytest.importorskip("transformers")

WORLD, STEPS, GAS, CLIP, HALF, TAG = 4, 3, 2, 0.5, 2, "half"
#: AdamW half: betas whose powers are exact in fp32 (bit-exact resume); QK-clip at a threshold between the heads' max
#: logits (step 1: 2.36-2.60), so it clips some heads and not others
PARAMS = dict(MUON_PARAMS, betas=[0.5, 0.75], qk_clip={"enabled": True, "threshold": 2.5, "alpha": 0.5})
TYPE_ERROR = "_CanRecordRegistry.get() takes 2 positional arguments but 3 were given"


def _config(stage: int, optimizer: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": optimizer or {"type": "Muon", "params": dict(PARAMS)},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "expert_parallel": dict(AUTOEP), "steps_per_print": 10_000, "wall_clock_breakdown": False}


def _engine(stage: int, optimizer: dict | None = None):
    import deepspeed
    import ds_muon
    model = qwen3_moe()
    init = deepspeed.initialize if optimizer else ds_muon.initialize
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=_config(stage, optimizer))
    return engine


def _train(engine, rank: int, start: int, stop: int, stats: list | None = None) -> list[float]:
    """Steps ``start..stop-1``; returns the gradient norms, appends each step's QK-clip figures to ``stats``."""
    norms = []
    for step in range(start, stop):
        for micro in range(GAS):
            x, y = tokens(step, rank, micro)
            engine.backward(engine(x, y))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        if stats is not None:
            stats.append(engine.optimizer.qk_clip_stats)
    return norms


def _params(engine) -> dict[str, torch.Tensor]:
    """This rank's full parameters: the dense ones gathered over all ranks, the experts over their expert-data-parallel
    group (this expert-parallel rank's local experts). Collective."""
    import deepspeed
    params = dict(engine.module.named_parameters())
    experts = [n for n in params if ".experts." in n]
    out = {}
    for names in ([n for n in params if n not in experts], experts):  # one partition group per gather
        with deepspeed.zero.GatheredParameters([params[n] for n in names], modifier_rank=None):
            out.update({n: params[n].detach().float().cpu().clone() for n in names})
    return out


def _exchange_groups(engine) -> dict[str, list]:
    """Per Muon sub-group (ZeRO-3) or param group (ZeRO-1/2): its parameter names and the global ranks of the group its
    owner exchange runs over, with the owner plan's world size."""
    import torch.distributed as dist
    opt = engine.optimizer
    out = {}
    for i, step in opt.muon_steps.items():
        group = step.exchange.group
        ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        names = sorted(s.name for s in step.plan.slots)
        out[",".join(names)] = [ranks, step.plan.world_size, [s.view.num_blocks for s in step.plan.slots]]
    return out


def _refusals(rank: int) -> dict:
    """Without the shim: DeepSpeed alone (AdamW) and ds_muon (Muon), each at ZeRO-3."""
    from ds_muon.config import ConfigError
    out = {}
    try:
        _engine(3, {"type": "AdamW", "params": {"lr": 3e-3}}).destroy()
        out["deepspeed"] = "built"
    except TypeError as exc:
        out["deepspeed"] = str(exc)
    try:
        _engine(3).destroy()
        out["ds_muon"] = "built"
    except ConfigError as exc:
        out["ds_muon"] = str(exc)
    return out


def _run(rank: int, stage: int, ckpt: str) -> dict:
    """ds_muon at ``stage``: 2 steps, ``save_checkpoint``, a third step; then a second engine loads the checkpoint
    (state equal to the saved one bit for bit) and trains the third step again (equal to the first engine's)."""
    out = {}
    engine = _engine(stage)
    out["type"] = type(engine.optimizer).__name__
    out["init"], out["groups"] = _params(engine), _exchange_groups(engine)
    out["tags"] = {n: bool(p.use_muon) for n, p in engine.module.named_parameters()}
    out["qk_clip"] = []
    out["norms"] = _train(engine, rank, 0, HALF, out["qk_clip"])
    engine.save_checkpoint(ckpt, tag=TAG)
    saved = state_snapshot(engine)
    out["norms"] += _train(engine, rank, HALF, STEPS, out["qk_clip"])
    out["final"], continuous = _params(engine), state_snapshot(engine)
    engine.destroy()
    engine = _engine(stage)
    engine.load_checkpoint(ckpt, tag=TAG)
    assert_same_state(state_snapshot(engine), saved, f"ZeRO-{stage} rank {rank}, right after loading:")
    _train(engine, rank, HALF, STEPS)
    assert_same_state(state_snapshot(engine), continuous, f"ZeRO-{stage} rank {rank}, resumed vs. continuous:")
    out["resumed"] = True
    engine.destroy()
    return out


def autoep_worker(rank: int, world_size: int, ckpt: str) -> dict:
    from deepspeed.utils import groups
    out = {"refusals": _refusals(rank)}
    with registry_shim() as shimmed:
        out["shimmed"] = shimmed
        out["ep_rank"] = groups._get_expert_parallel_rank(f"ep_size_{EP}")
        adamw = _engine(3, {"type": "AdamW", "params": {"lr": 3e-3}})
        out["adamw_norm"] = _train(adamw, rank, 0, 1)[0]
        adamw.destroy()
        for stage in (3, 2, 1):
            out[stage] = dict(_run(rank, stage, f"{ckpt}-zero{stage}"), ep_rank=out["ep_rank"])
    return out


def _oracle(init: dict[str, torch.Tensor]):
    """``MuonAdamW`` on the whole model from ``init`` (transformers' names), its own selection; 3 steps on every
    rank's micro-batches. Returns (model, norms, QK-clip figures per step)."""
    import ds_muon
    model = qwen3_moe()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    opt = ds_muon.MuonAdamW(model, **PARAMS)
    stats = []
    norms = train_reference(model, opt, STEPS, WORLD, GAS, CLIP, data=tokens,
                            after_step=lambda: stats.append(opt.qk_clip_stats))
    return model, norms, stats


def _by_ep_rank(results: list[dict], key: str) -> list[dict]:
    """One rank's ``key`` parameters per expert-parallel rank (each rank of an expert-data-parallel group holds the
    same)."""
    return [next(r[key] for r in results if r["ep_rank"] == e) for e in range(EP)]


def test_autoep_matches_oracle_at_zero_1_2_3_and_resumes_exactly(tmp_path) -> None:
    from ds_muon.checkpoint import convert_to_universal
    from ds_muon.errors import CheckpointError
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(autoep_worker, WORLD, ckpt)
    first = results[0]

    # 1. the refusal without the shim, and DeepSpeed's own failure it stands for
    refusals = first["refusals"]
    if first["shimmed"]:  # transformers >= 5.23 (CI: 5.25.0)
        assert TYPE_ERROR in refusals["deepspeed"], refusals
        msg = refusals["ds_muon"]
        assert "expert_parallel" in msg and TYPE_ERROR in msg and "transformers>=5.2,<5.23" in msg, msg
        assert "'qwen3_moe' preset" in msg and "_CAN_RECORD_REGISTRY.get(key, default)" in msg, msg
    else:
        assert refusals == {"deepspeed": "built", "ds_muon": "built"}, refusals
    assert sorted(r["ep_rank"] for r in results) == [0, 0, 1, 1]

    init = to_hf(_by_ep_rank([r[3] for r in results], "init"))  # transformers' layout
    model, ref_norms, ref_qk = _oracle(init)
    oracle_tags = {n: bool(p.use_muon) for n, p in model.named_parameters()}
    assert max(ref_norms) > CLIP, f"clipping was never active: {ref_norms}"
    clipped = [s["heads_clipped"] for s in ref_qk]
    assert 0 < clipped[0] < 8 and sum(clipped) > clipped[0], clipped  # some heads, not all; more than one step
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for stage, kind in ((3, "MuonZeroOptimizer"), (2, "MuonZero12Optimizer"), (1, "MuonZero12Optimizer")):
        runs = [r[stage] for r in results]
        run = runs[0]
        assert run["type"] == kind

        # 2. selection: the router on AdamW, every expert matrix on Muon, as the oracle selects on the whole model
        tags = run["tags"]
        routers = [n for n in tags if n.endswith("mlp.router.gate.weight")]
        experts = [n for n in tags if ".mlp.experts.w" in n]
        assert len(routers) == 2 and len(experts) == 6, sorted(tags)
        assert not any(tags[n] for n in routers) and all(tags[n] for n in experts), tags
        assert {hf_name(n): u for n, u in tags.items()} == oracle_tags

        # 3. the exchange groups: experts inside their expert-data-parallel group, one block per local expert
        for r, res in enumerate(runs):
            expert_groups = {k: v for k, v in res["groups"].items() if ".experts." in k}
            dense_groups = {k: v for k, v in res["groups"].items() if ".experts." not in k}
            assert expert_groups and dense_groups, res["groups"]
            edp = sorted(q for q in range(WORLD) if results[q]["ep_rank"] == results[r]["ep_rank"])
            for name, (ranks, world, blocks) in expert_groups.items():
                assert ranks == edp and world == WORLD // EP, (stage, r, name, ranks, world)
                assert blocks == [EXPERTS // EP] * len(blocks), (stage, name, blocks)
            for name, (ranks, world, _) in dense_groups.items():
                assert ranks == list(range(WORLD)) and world == WORLD, (stage, r, name, ranks)
            assert "router" not in "".join(res["groups"]), res["groups"]

        # 4. the gradient norms (DeepSpeed's, clipped by) and the weights against the oracle
        assert all(res["norms"] == run["norms"] for res in runs), stage
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert abs(run["norms"][0] - first["adamw_norm"]) <= 1e-6 * first["adamw_norm"], (run["norms"], first)
        assert all(torch.equal(x, init[n]) for n, x in to_hf(_by_ep_rank(runs, "init")).items())
        final = _by_ep_rank(runs, "final")
        for res in runs:  # each rank gathered the same as the others of its expert-data-parallel group
            assert all(torch.equal(x, final[res["ep_rank"]][n]) for n, x in res["final"].items()), stage
        errors = compare(to_hf(final), want, init)
        assert errors.keys() == want.keys()
        for name, err in errors.items():
            assert err["rel"] <= PARITY_RTOL, f"ZeRO-{stage}: {name} rel error {err['rel']:.2e}"
            if err["moved"] > 0:
                assert err["rel_update"] <= 1e-3, f"ZeRO-{stage}: {name} update rel error {err['rel_update']:.2e}"

        # 5. QK-clip: the per-head max logits all-reduced over all ranks (attention is data-parallel), as the oracle's
        assert all(res["qk_clip"] == run["qk_clip"] for res in runs), stage
        assert [s["heads_clipped"] for s in run["qk_clip"]] == [s["heads_clipped"] for s in ref_qk], stage
        for got, ref in zip(run["qk_clip"], ref_qk):
            for layer, heads in ref["max_logit_per_head"].items():
                torch.testing.assert_close(torch.tensor(got["max_logit_per_head"][layer]), torch.tensor(heads),
                                           rtol=1e-5, atol=0)

        # 6. the resume (asserted bit for bit inside the group, on every rank); no universal conversion
        assert all(res["resumed"] for res in runs)
        with pytest.raises(CheckpointError, match="AutoEP"):
            convert_to_universal(f"{ckpt}-zero{stage}", str(tmp_path / f"universal{stage}"), TAG)
