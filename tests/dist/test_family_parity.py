"""ds_muon ZeRO-3 vs. the oracle on the model families of issue 26 (docs/selection.md, "Model families"), each the real
class built from a tiny config (tests/support/families.py): GPT-OSS (experts with biases, gate/up interleaved, eager
attention with sinks), Qwen3-Next (gated q_proj and GatedDeltaNet in_proj_qkvz/in_proj_ba per head),
``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``'s packed in_proj: Q/K/V apart, per head; and under
Adam-mini), a ViT (the patch embedding is the input layer: AdamW) and Qwen3-MoE (with ``decay_norms_and_biases``).

CPU, gloo, fp32, W=2, GAS 2, gradient clipping on (active: the norm exceeds it), ZeRO-3; one process group runs
every case. Tolerance as tests/dist/test_zero3_parity.py: 1e-5 relative to each parameter, 1e-3 relative to its
update. The oracle shares the selection with the engine, so parity alone cannot show a rule: each case also states
the rule's split independently (Muon or AdamW and why, the views' labels and block counts, the engine's ZeRO-3 plan
holding those blocks), trains the oracle with the views removed (or, for GPT-OSS, gate/up as contiguous halves)
and requires the engine far from it, and checks each parameter's weight decay in the engine's groups against
Hugging Face Trainer's no-decay set (``Trainer.get_decay_parameter_names``), or none exempt under
``decay_norms_and_biases: true``. Last, a framework's own Muon object (``torch.optim.Muon``, a Keller-style ``Muon``
class) passed as ``optimizer=`` is refused at initialize (a ``ConfigError`` naming the class and the config to
write), not at step 1, through ``ds_muon.initialize`` and the zero-code hook on ``deepspeed.initialize``, with and
without ``zero_allow_untested_optimizer`` (DeepSpeed's own assertion on that key must not come first).
"""
from __future__ import annotations

import pytest
import torch

from tests.support import families
from tests.support.harness import (PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                                   group_decay, reference_model, train_reference)
from tests.support.spawn import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                reason="stacked expert containers (GPT-OSS, Qwen3-Next, Qwen3-MoE) need transformers >= 5")

STEPS, GAS, CLIP, W = 3, 2, 0.5, 2
WEIGHT_DECAY = 0.05  # harness MUON_PARAMS
MINI_PARAMS = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def gpt_oss():
    return families.causal_lm(transformers.GptOssForCausalLM)(families.gpt_oss_config())


def qwen3_next():
    return families.causal_lm(transformers.Qwen3NextForCausalLM)(families.qwen3_next_config())


def vit():
    return families.image_classifier(transformers.ViTForImageClassification)(families.vit_config())


def qwen3_moe():
    from tests.dist.test_moe_parity import qwen3_moe as build
    return build()


MODELS = {"gpt_oss": gpt_oss, "qwen3_next": qwen3_next, "encoder": families.encoder_lm, "vit": vit,
          "qwen3_moe": qwen3_moe}


def _data(case: dict):
    return families.images if case["model"] == "vit" else families.tokens


def _train(engine, rank: int, data) -> list[float]:
    norms = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = (t.to(engine.device) for t in data(step, rank, micro))
            engine.backward(engine(x, y))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return norms


def _without_key_bias(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` without the attention key biases (ViT's ``k_proj.bias``; the key third of
    ``nn.MultiheadAttention``'s ``in_proj_bias``; an empty tensor in their place): softmax is invariant to a key bias
    (it adds the same q.b_k to every logit of a query's row), so that gradient is rounding noise (~1e-9 here) and
    AdamW turns noise into lr-sized steps whose sign depends on the reduction order. Everything else, the query and
    value thirds of ``in_proj_bias`` included, is compared."""
    out = dict(params)
    for n, t in params.items():
        if n.endswith("self_attn.in_proj_bias"):
            q, _, v = t.chunk(3)
            out[n] = torch.cat([q, v])
        elif n.endswith("attention.k_proj.bias"):
            out[n] = t[:0]
    return out


def _oracle(case: dict, init: dict, tags: dict, params: dict, views=None):
    """The oracle trained on every rank's data; ``views``: ``{name: Split or None}`` replacing the selection's."""
    import ds_muon
    from ds_muon.names import SPLIT_ATTR
    model_fn = MODELS[case["model"]]
    if case.get("mini"):
        torch.manual_seed(0)
        ref = model_fn()
        for name, p in ref.named_parameters():
            p.data.copy_(init[name])
        opt = ds_muon.AdamMini(ref, **params)
    else:
        ref = reference_model(init, tags, model_fn)
        opt = ds_muon.MuonAdamW(ref, **params)
        for name, p in ref.named_parameters():
            if views is not None and name in views:
                setattr(p, SPLIT_ATTR, views[name])
    norms = train_reference(ref, opt, STEPS, W, GAS, CLIP, data=_data(case))
    return {n: p.detach().clone() for n, p in ref.named_parameters()}, norms


def _run_case(rank: int, world_size: int, case: dict) -> dict | None:
    from ds_muon.core.matrix import Split, matrix_view
    from ds_muon.model.selection import SelectionRules, select_muon_params
    from ds_muon.names import SPLIT_ATTR
    if case.get("mini"):
        cfg = ds_config(gas=GAS, clip=CLIP, optimizer={"type": "AdamMini", "params": dict(MINI_PARAMS)})
    else:
        cfg = ds_config(gas=GAS, clip=CLIP)
    params = cfg["optimizer"]["params"]
    params.update(case.get("params", {}))
    model_fn = MODELS[case["model"]]
    engine, model = build_engine(cfg, model_fn=model_fn)
    init = gathered_params(model)
    tags = clone_tags(model)
    splits = {n: getattr(p, SPLIT_ATTR, None) for n, p in model.named_parameters()}
    norms = _train(engine, rank, _data(case))
    got = gathered_params(model)
    opt = engine.optimizer
    blocks = sum(s.view.num_blocks for plan in getattr(opt, "muon_plans", {}).values() for s in plan.slots)
    decay = group_decay(opt)
    kind = type(opt).__name__
    engine.destroy()
    if rank != 0:
        return {"norms": norms}
    plain = model_fn()  # unpartitioned twin: the selection as the user sees it, and Trainer's decay set
    rules = SelectionRules.of(per_head_muon=bool(params.get("per_head_muon", False)))
    selection = select_muon_params(plain, rules)
    want, ref_norms = _oracle(case, init, tags, params)
    result = {"norms": norms, "ref_norms": ref_norms, "tags": tags, "splits": splits, "blocks": blocks, "type": kind,
              "decay": decay, "reasons": dict(selection.reasons), "summary": selection.summary(),
              "trainer_decays": sorted(transformers.Trainer.get_decay_parameter_names(None, plain)),
              "view_blocks": {n: matrix_view(init[n].shape, splits[n]).num_blocks for n in init if tags[n]},
              "errors": compare(*map(_without_key_bias, (got, want, init)))}
    result["expected_blocks"] = sum(result["view_blocks"].values())
    if not case.get("mini"):
        other = {n: None for n, s in splits.items() if s is not None}  # every view removed
        if case.get("halves"):  # GPT-OSS gate/up as contiguous halves (the layout GPT-OSS does not have)
            other = {n: Split(cols=(init[n].shape[-1] // 2,) * 2) for n in splits if n.endswith("experts.gate_up_proj")}
        if other:
            result["wrong"] = compare(*map(_without_key_bias, (got, _oracle(case, init, tags, params, other)[0], init)))
            result["wrong_names"] = sorted(other)
    return result


class Muon(torch.optim.Optimizer):
    """Keller Jordan's / Moonlight's Muon as far as ds_muon sees it: the class name and a ``momentum`` in its groups
    (its step is never reached)."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))


#: The client Muon objects passed to deepspeed.initialize(optimizer=...): name -> (class, the name its message gives)
CLIENT_MUONS = {"torch.optim.Muon": (torch.optim.Muon, "torch.optim.Muon"),
                "Keller-style Muon": (Muon, f"{__name__}.Muon")}


def _client_muon(rank: int) -> dict[str, str]:
    """A framework's own Muon object at ZeRO-3, through ``ds_muon.initialize`` and through the zero-code hook on
    ``deepspeed.initialize`` (``hooks.auto_enable()``, what the start-up hook does), with and without
    ``zero_allow_untested_optimizer`` (HF Trainer and Accelerate set it for a client optimizer; without it DeepSpeed's
    own "untested ZeRO Optimizer" assertion would come first): refused at initialize by ds_muon (before DeepSpeed
    partitions anything, so no collective is left half-done). Returns ``{case: "<error type>: <message>"}``."""
    import deepspeed

    import ds_muon
    from ds_muon.integration import hooks
    out = {}
    for path in ("ds_muon.initialize", "zero-code deepspeed.initialize"):
        for allow in (False, True):
            for name, (cls, _) in CLIENT_MUONS.items():
                cfg = ds_config(gas=GAS, clip=CLIP)
                del cfg["optimizer"]
                if allow:
                    cfg["zero_allow_untested_optimizer"] = True
                torch.manual_seed(0)
                model = families.encoder_lm()
                muon = cls([p for p in model.parameters() if p.ndim == 2], lr=0.01)
                if path.startswith("zero-code"):
                    hooks.auto_enable()
                init = deepspeed.initialize if path.startswith("zero-code") else ds_muon.initialize
                try:
                    init(model=model, optimizer=muon, config=cfg)
                    got = "accepted"
                except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
                    got = f"{type(exc).__name__}: {exc}"
                finally:
                    if path.startswith("zero-code"):
                        hooks.disable()
                        hooks._auto = False
                out[f"{path}, {name}, zero_allow_untested_optimizer {allow}"] = got
    return out


def family_worker(rank: int, world_size: int, cases: list[dict]) -> tuple[list[dict | None], dict[str, str]]:
    return [_run_case(rank, world_size, case) for case in cases], _client_muon(rank)


def _gpt_oss_rule(res: dict) -> None:
    """Per layer: gate_up (E, H, 2I) Muon as 2 interleaved matrices per expert, down (E, I, H) one per expert; the
    expert biases (E, 2I) / (E, H) and the router AdamW."""
    for layer in range(2):
        pre = f"model.layers.{layer}.mlp."
        gate_up, down = res["splits"][pre + "experts.gate_up_proj"], res["splits"][pre + "experts.down_proj"]
        assert res["tags"][pre + "experts.gate_up_proj"] and res["tags"][pre + "experts.down_proj"]
        assert gate_up is not None and gate_up.interleave == 2 and gate_up.label == "gate/up interleaved", gate_up
        assert gate_up.rows is None and gate_up.cols is None, gate_up
        assert down is None  # one matrix per expert
        for bias in ("experts.gate_up_proj_bias", "experts.down_proj_bias", "router.weight", "router.bias"):
            assert not res["tags"][pre + bias], bias
        assert res["reasons"][pre + "experts.gate_up_proj_bias"].startswith(">=2-D bias")
    # 4 experts x 2 layers: gate_up 2 blocks per expert, down 1: 24; attention q/k/v/o: 8
    assert res["expected_blocks"] == 2 * (4 * 2 + 4) + 8, res["expected_blocks"]


def _qwen3_next_rule(res: dict) -> None:
    """per_head_muon: GatedDeltaNet in_proj_qkvz as q/k (2 key heads each), v/z (4 value heads each) per head,
    in_proj_ba as b and a per key head; the gated q_proj as query and gate per head (2 x 4)."""
    want = {"model.layers.0.linear_attn.in_proj_qkvz.weight": 12, "model.layers.0.linear_attn.in_proj_ba.weight": 4,
            "model.layers.1.self_attn.q_proj.weight": 8, "model.layers.1.self_attn.k_proj.weight": 2,
            "model.layers.1.self_attn.v_proj.weight": 2}
    for name, n_blocks in want.items():
        split = res["splits"][name]
        assert res["tags"][name] and split is not None and split.label == "per head", (name, split)
        assert res["view_blocks"][name] == n_blocks, (name, res["view_blocks"][name])
    assert not res["tags"]["model.layers.0.linear_attn.conv1d.weight"]  # depthwise: no matrix


def _encoder_rule(per_head: bool):
    def check(res: dict) -> None:
        for layer in range(2):
            pre = f"encoder.layers.{layer}.self_attn."
            split = res["splits"][pre + "in_proj_weight"]
            assert res["tags"][pre + "in_proj_weight"], pre
            assert split.label == ("per head" if per_head else "q/k/v"), split
            assert split.rows == ((8,) * 12 if per_head else (32,) * 3), split.rows
            assert not res["tags"][pre + "in_proj_bias"] and res["tags"][pre + "out_proj.weight"]
    return check


def _encoder_mini_rule(res: dict) -> None:
    from ds_muon.model.adam_mini_blocks import adam_mini_plan
    plan = adam_mini_plan(families.encoder_lm())
    for layer in range(2):
        pre = f"encoder.layers.{layer}.self_attn."
        assert plan[pre + "in_proj_weight"].block == 8 * 32, plan[pre + "in_proj_weight"]  # per head of Q, K, V
        assert not plan[pre + "in_proj_bias"].decay


def _vit_rule(res: dict) -> None:
    from ds_muon.model import selection
    patch = "vit.embeddings.patch_embeddings.projection.weight"
    assert not res["tags"][patch] and res["reasons"][patch] == selection.INPUT_LAYER
    assert f'rule "{selection.INPUT_LAYER}": 1 params' in res["summary"]
    assert res["tags"]["vit.layers.0.attention.q_proj.weight"] and not res["tags"]["classifier.weight"]


def _qwen3_moe_rule(res: dict) -> None:
    for layer in range(2):
        split = res["splits"][f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        assert split.label == "gate/up" and split.rows == (16, 16) and split.interleave == 1, split
        assert not res["tags"][f"model.layers.{layer}.mlp.gate.weight"]


CASES = [
    dict(name="gpt-oss", model="gpt_oss", halves=True, rule=_gpt_oss_rule),
    dict(name="qwen3-next-per-head", model="qwen3_next", params={"per_head_muon": True}, rule=_qwen3_next_rule),
    dict(name="transformer-encoder", model="encoder", rule=_encoder_rule(False)),
    dict(name="transformer-encoder-per-head", model="encoder", params={"per_head_muon": True},
         rule=_encoder_rule(True)),
    dict(name="transformer-encoder-adam-mini", model="encoder", mini=True, rule=_encoder_mini_rule),
    dict(name="vit", model="vit", rule=_vit_rule),
    dict(name="qwen3-moe-decay-all", model="qwen3_moe", params={"decay_norms_and_biases": True},
         rule=_qwen3_moe_rule),
]


def test_model_families_match_oracle_and_follow_their_rules() -> None:
    cases = [{k: v for k, v in c.items() if k != "rule"} for c in CASES]
    results, refusals = zip(*run_distributed(family_worker, W, cases))
    for per_case in refusals:  # a framework's own Muon object (docs/migration.md, "Your own Muon object")
        assert len(per_case) == 8, sorted(per_case)
        for case, msg in per_case.items():
            shown = CLIENT_MUONS[case.split(", ")[1]][1]
            assert msg.startswith("ConfigError: deepspeed.initialize got a Muon optimizer object of its own "
                                  f"({shown}) under ZeRO stage 3."), (case, msg)
            assert '"optimizer": {"type": "Muon", "params": {"lr": 0.01' in msg and "Param gradient must be a 2D" in msg
    for k, case in enumerate(CASES):
        res, name = results[0][k], case["name"]
        print(f"--- {name}\n{res['summary']}")
        assert res["type"] == "MuonZeroOptimizer", name
        assert results[1][k]["norms"] == res["norms"], name
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(res["ref_norms"]), rtol=1e-5, atol=0)
        assert max(res["ref_norms"]) > CLIP, f"{name}: clipping was never active"
        for n, err in res["errors"].items():
            assert err["rel"] <= PARITY_RTOL, f"{name}: {n} rel error {err['rel']:.2e}"
            if err["moved"] > 0:
                assert err["rel_update"] <= 1e-3, f"{name}: {n} update rel error {err['rel_update']:.2e}"
        case["rule"](res)
        if not case.get("mini"):
            assert res["blocks"] == res["expected_blocks"], name  # the ZeRO-3 plan holds the selection's views
        if "wrong" in res:  # the views change the training: the engine is far from the oracle without them
            worst = max(res["wrong"][n]["rel_update"] for n in res["wrong_names"])
            assert worst > 1e-2, f"{name}: indistinguishable from the oracle with other views ({worst:.2e})"
        # weight decay as the engine steps it: Trainer's no-decay set gets none, unless decay_norms_and_biases
        configured = (MINI_PARAMS if case.get("mini") else {"weight_decay": WEIGHT_DECAY})["weight_decay"]
        decays = set(res["trainer_decays"])
        decay_all = case.get("params", {}).get("decay_norms_and_biases", False)
        want = {n: configured if decay_all or n in decays else 0.0 for n in res["decay"]}
        assert res["decay"] == want, f"{name}: weight decay per parameter {res['decay']}, want {want}"
        assert set(res["decay"]) == set(res["errors"]), name  # every trainable parameter, once
        assert decay_all or 0.0 in want.values(), name
