"""DeepSpeed's own Muon test configurations under ds_muon, as behaviour checks against the oracle.

DeepSpeed's ``tests/unit/ops/muon/test_muon.py`` (``TestMuonConfigs``) trains a stack of ``nlayers``
``Linear(hidden, hidden)`` layers (bias on) whose output is the logits of ``hidden`` classes (cross-entropy) with
``{"optimizer": {"type": "Muon", "params": {"lr": lr}}, "gradient_clipping": 1.0, "train_batch_size": 8}``, ZeRO stage
1, 2 or 3 with ``reduce_scatter: false``, CPU optimizer offload on or off, and at stage 3
``save_muon_momentum_buffer_in_memory`` on or off, for 5 steps; it asserts that ``"muon"`` is in the inner optimizer's
class name and that every parameter changed. The same 8 configurations run here in one W=2 process group (CPU, gloo;
bf16, as DeepSpeed's fp16 needs an accelerator with fp16), on the same kind of model (hidden 32, 5 layers, lr 0.01),
and each is checked for:

* DeepSpeed's two assertions: the inner optimizer is ``ZeroMuonInner`` ("muon" in its name, at every stage: the
  built-in ZeRO-1/2 Muon path is kept off by ``BuiltinMuonSwitch``, not by a class name) inside ds_muon's ZeRO
  optimizer, and every parameter changed;
* parity with the oracle (``ds_muon.MuonAdamW``, fp32, trained on every rank's micro-batches, the raw-norm clip at 1.0:
  on this data the norms stay below it, as in DeepSpeed's test) and the same global gradient norms: a Muon weight
  within 2e-2 of the oracle's and 0.3 of its update, an AdamW parameter within 5e-2 and 0.2, the norms within 1e-2
  (bf16 forward and backward against the fp32 oracle); each Muon weight at least 3x further from a run with every
  parameter on AdamW than from the oracle;
* the configurations agree: each within 1e-3 of stage 3 without offload (the ZeRO stage, the offload and the momentum
  flag change nothing but reduction order).

Measured on 2026-12-04 (torch 2.13 CPU, deepspeed 0.19.8, ``-s``): in every configuration the worst Muon weight is
6.4e-3 from the oracle's (1.5e-1 of its update), the worst AdamW one 1.8e-2 (6.2e-2), the all-AdamW run at >= 0.90
of the update, and all 8 configurations end on the same weights bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.harness import compare, fp32_master_params, gathered_params, reference_model, train_reference
from tests.support.spawn import run_distributed

HIDDEN, LAYERS, LR, STEPS, CLIP, TRAIN_BATCH = 32, 5, 0.01, 5, 1.0, 8
MUON_RTOL, MUON_RTOL_UPDATE, ADAMW_RTOL, ADAMW_RTOL_UPDATE, NORM_RTOL = 2e-2, 0.3, 5e-2, 0.2, 1e-2
FAR, CONFIG_RTOL = 3.0, 1e-3
#: (name, stage, offload_optimizer to the CPU, save_muon_momentum_buffer_in_memory): DeepSpeed's matrix
CONFIGS = [(f"stage{stage}{'-offload' if offload else ''}{'-momentum-in-memory' if in_memory else ''}", stage, offload,
            in_memory)
           for stage in (1, 2, 3) for offload in (True, False) for in_memory in ((True, False) if stage == 3 else (False,))]


class LinearStack(nn.Module):
    """``layers`` ``Linear(hidden, hidden)`` in a row; the last one's output is the logits of ``hidden`` classes."""

    def __init__(self, hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        for linear in self.linears:
            x = linear(x)
        return nn.functional.cross_entropy(x, y)


def _data(step: int, rank: int, micro: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 101 * rank + micro)
    return torch.randn(micro_batch, HIDDEN, generator=g), torch.randint(0, HIDDEN, (micro_batch,), generator=g)


def _config(stage: int, offload: bool, in_memory: bool) -> dict:
    zero = {"stage": stage, "reduce_scatter": False, "save_muon_momentum_buffer_in_memory": in_memory}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_batch_size": TRAIN_BATCH, "optimizer": {"type": "Muon", "params": {"lr": LR}},
            "gradient_clipping": CLIP, "bf16": {"enabled": True}, "zero_optimization": zero,
            "steps_per_print": 10_000}


def _run(rank: int, world_size: int, stage: int, offload: bool, in_memory: bool) -> dict:
    import ds_muon
    torch.manual_seed(0)
    model = LinearStack()
    engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(),
                                         config=_config(stage, offload, in_memory))
    out = {"zero": type(engine.optimizer).__name__, "inner": type(engine.optimizer.optimizer).__name__,
           "cpu_offload": bool(getattr(engine.optimizer, "cpu_offload", False)
                               or getattr(engine.optimizer, "offload_optimizer", False))}
    init = gathered_params(model)
    tags = {n: bool(p.use_muon) for n, p in model.named_parameters()}
    micro = engine.train_micro_batch_size_per_gpu()
    norms = []
    for step in range(STEPS):
        x, y = _data(step, rank, 0, micro)
        engine.backward(engine(x.to(engine.device, torch.bfloat16), y.to(engine.device)))
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    out["norms"] = norms
    got = fp32_master_params(model)
    out["unchanged"] = sorted(n for n in got if torch.equal(got[n], init[n]))
    engine.destroy()
    if rank == 0:
        ref = reference_model(init, tags, model_fn=LinearStack)
        out["ref_norms"] = train_reference(ref, ds_muon.MuonAdamW(ref.parameters(), lr=LR), STEPS, world_size, 1,
                                           CLIP, micro_batch=micro, data=_data)
        out["errors"] = compare(got, {n: p.detach().clone() for n, p in ref.named_parameters()}, init)
        adamw = reference_model(init, {n: False for n in tags}, model_fn=LinearStack)  # everything on AdamW
        train_reference(adamw, ds_muon.MuonAdamW(adamw.parameters(), lr=LR), STEPS, world_size, 1, CLIP,
                        micro_batch=micro, data=_data)
        out["adamw_errors"] = compare(got, {n: p.detach().clone() for n, p in adamw.named_parameters()}, init)
        out["tags"], out["weights"] = tags, got
    return out


def worker(rank: int, world_size: int) -> dict:
    return {name: _run(rank, world_size, stage, offload, in_memory) for name, stage, offload, in_memory in CONFIGS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(worker, 2)


@pytest.mark.parametrize("name,stage,offload,in_memory", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_deepspeeds_muon_config_trains_as_the_oracle(results, name, stage, offload, in_memory):
    res = results[0][name]
    assert "muon" in res["inner"].lower() and res["inner"] == "ZeroMuonInner", res["inner"]  # DeepSpeed's assertion
    assert res["zero"] == ("MuonZeroOptimizer" if stage == 3 else "MuonZero12Optimizer"), res["zero"]
    assert res["cpu_offload"] is offload, res
    assert all(r[name]["unchanged"] == [] for r in results), f"{name}: not updated: {res['unchanged']}"  # DeepSpeed's
    assert all(r[name]["norms"] == res["norms"] for r in results), f"{name}: ranks report different global norms"
    torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(res["ref_norms"]), rtol=NORM_RTOL, atol=0)
    tags = res["tags"]
    # ds_muon's selection: Muon for the hidden layers; the last layer, whose output is the logits, is the output head
    # (AdamW), and so are the biases (DeepSpeed's built-in would put every >= 2-D weight on Muon)
    assert [tags[f"linears.{i}.weight"] for i in range(LAYERS)] == [True] * (LAYERS - 1) + [False], tags
    assert not any(tags[f"linears.{i}.bias"] for i in range(LAYERS)), tags
    worst = {}
    for pname, err in res["errors"].items():
        rtol, rtol_update = (MUON_RTOL, MUON_RTOL_UPDATE) if tags[pname] else (ADAMW_RTOL, ADAMW_RTOL_UPDATE)
        assert err["rel"] <= rtol, f"{name}: {pname} rel error {err['rel']:.2e} > {rtol}"
        assert err["rel_update"] <= rtol_update, f"{name}: {pname} update rel error {err['rel_update']:.2e} > {rtol_update}"
        kind = "muon" if tags[pname] else "adamw"
        worst[kind] = max(worst.get(kind, 0.0), err["rel_update"])
        worst[kind + " rel"] = max(worst.get(kind + " rel", 0.0), err["rel"])
        if tags[pname]:  # clearly Muon: far from the run with every parameter on AdamW
            far = res["adamw_errors"][pname]["rel_update"]
            worst["far"] = min(worst.get("far", far), far)
            assert far >= FAR * err["rel_update"], f"{name}: {pname} is not clearly Muon ({far:.2e})"
    # the ZeRO stage and the offload change nothing beyond reduction order: every configuration lands where stage 3
    # without offload does
    base = results[0]["stage3"]["weights"]
    spread = max(((res["weights"][n] - w).norm() / w.norm()).item() for n, w in base.items())
    assert spread <= CONFIG_RTOL, f"{name}: {spread:.2e} from stage3's weights"
    print(f"{name}: worst update error Muon {worst['muon']:.1e} (of the parameter {worst['muon rel']:.1e}), AdamW "
          f"{worst['adamw']:.1e} ({worst['adamw rel']:.1e}); all-AdamW run at >= {worst['far']:.1e} of the update; "
          f"{spread:.1e} from stage3")  # -s shows it

