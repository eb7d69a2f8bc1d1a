"""Matrix views (docs/design.md, "Matrix views"): the blocks Newton–Schulz orthogonalizes separately, their selection
for MoE experts, fused gate/up, fused QKV, per-head and declared splits, single-device checks.

The view-based update is checked against an explicit loop over hand-sliced blocks; the selection
against tiny transformers models built from a config (no download).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_muon import MuonAdamW
from ds_muon.model import selection
from ds_muon.config import ConfigError, parse_muon_params
from ds_muon.sharded.exchange import OwnerExchange
from ds_muon.names import SPLIT_ATTR
from ds_muon.core.matrix import Split, as_split, matrix_view, orthogonalize_blocks_, update_scale
from ds_muon.core.ns_cost import ns_flops
from ds_muon.core.newton_schulz import orthogonalize
from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan, build_plan
from ds_muon.model.selection import SelectionRules, select_muon_params, tag_model

transformers = pytest.importorskip("transformers")
# transformers 5 stores MoE experts stacked ((E, 2I, H) gate_up_proj); 4.x kept one Linear per expert.
stacked_experts = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                     reason="stacked expert containers need transformers >= 5")


def scaled_ns(blocks: torch.Tensor) -> torch.Tensor:
    return orthogonalize(blocks, "standard", 5, torch.float32) * update_scale(blocks.shape[-2], blocks.shape[-1])


def _cuts(sizes):
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def loop_update(u: torch.Tensor, split: Split | None) -> torch.Tensor:
    """The reference: slice every block by hand (matrix by matrix, row range by column range), one
    Newton–Schulz call per block."""
    shape = u.shape
    mats = u.reshape(shape[0], shape[1], -1) if u.dim() == 3 else u.reshape(1, shape[0], -1)
    out = torch.empty_like(mats)
    R, C = mats.shape[-2:]
    rows = split.rows if split is not None and split.rows else (R,)
    cols = split.cols if split is not None and split.cols else (C,)
    k = split.interleave if split is not None else 1
    for e in range(mats.shape[0]):
        for r0, r1 in _cuts(rows):
            if k > 1:  # interleaved columns: block j = columns j, j+k, ...
                for j in range(k):
                    out[e, r0:r1, j::k] = scaled_ns(mats[e, r0:r1, j::k])
                continue
            for c0, c1 in _cuts(cols):
                out[e, r0:r1, c0:c1] = scaled_ns(mats[e, r0:r1, c0:c1])
    return out.reshape(shape)


CASES = [
    ((24, 40), None),
    ((16, 4, 3, 3), None),                                  # conv: (16, 36)
    ((3, 24, 16), None),                                    # stacked experts
    ((4, 32, 12), Split(rows=(16, 16), label="gate/up")),   # per-expert gate_up (E, 2I, H)
    ((96, 32), Split(rows=(48, 48), label="gate/up")),      # dense gate_up (Phi-3)
    ((64, 32), Split(rows=(32, 16, 16), label="q/k/v")),    # GQA qkv: 4 heads, 2 kv heads, hd 8
    ((64, 32), Split(rows=(8,) * 8, label="per head")),
    ((32, 96), Split(cols=(32, 32, 32), label="q/k/v")),    # GPT-2 Conv1D c_attn (H, 3H)
    ((32, 96), Split(cols=(8,) * 12, label="per head")),
    ((2, 14, 9), Split(rows=(4, 4, 2, 4), cols=(3, 6))),    # uneven declared grid on a stack
    ((4, 16, 20), Split(interleave=2, label="gate/up interleaved")),  # GPT-OSS experts (E, H, 2I)
    ((2, 12, 12), Split(rows=(6, 6), interleave=3)),        # interleaved columns under row blocks
]


@pytest.mark.parametrize("shape,split", CASES, ids=[f"{s}-{sp.label if sp else 'whole'}" for s, sp in CASES])
def test_view_update_equals_loop_over_hand_sliced_blocks(shape, split):
    u = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    view = matrix_view(shape, split)
    got = u.reshape(1, -1).clone()
    orthogonalize_blocks_(got, view, scaled_ns)
    want = loop_update(u, split)
    torch.testing.assert_close(got.view(shape), want, rtol=1e-5, atol=1e-6)
    if split is not None:  # the split matters: the whole-matrix update is far from it
        whole = loop_update(u, None)
        assert (whole - want).norm() > 0.05 * want.norm()
    # the blocks tile the parameter: each element in exactly one block
    hits = torch.zeros(1, math.prod(shape))
    orthogonalize_blocks_(hits, view, lambda b: b + 1)
    assert torch.equal(hits, torch.ones_like(hits))
    assert view.num_blocks == sum(g.count for g in view.groups)
    rows = split.rows if split and split.rows else (view.ns_shape[1],)
    k = split.interleave if split else 1
    cols = split.cols if split and split.cols else (view.ns_shape[2] // k,) * k
    assert view.num_blocks == view.ns_shape[0] * len(rows) * len(cols)
    assert view.cost(5, "standard") == sum(ns_flops(r, c, 5) * view.ns_shape[0] for r in rows for c in cols)


def test_equal_blocks_are_one_batched_call():
    """Per head and per expert gate/up are one Newton–Schulz call each (no Python loop per block)."""
    assert len(matrix_view((64, 32), Split(rows=(8,) * 8)).groups) == 1
    assert len(matrix_view((8, 32, 12), Split(rows=(16, 16))).groups) == 1
    assert len(matrix_view((64, 32), Split(rows=(32, 16, 16))).groups) == 2  # Q; K and V together


def test_bad_splits_are_clear_errors():
    with pytest.raises(ValueError, match=r"rows \[4, 4\] sum to 8.*\(9, 5\)"):
        matrix_view((9, 5), Split(rows=(4, 4)))
    with pytest.raises(ValueError, match="muon_split"):
        as_split("rows")
    with pytest.raises(ValueError, match="ints >= 1"):
        as_split([3, 0])
    assert as_split({"cols": [2, 2]}) == Split(None, (2, 2), "declared")


def test_owner_exchange_single_process_uses_views():
    """OwnerExchange (W=1, batched by equal view) == the per-block loop, for mixed views in buckets."""
    specs = [((4, 32, 12), Split(rows=(16, 16))), ((4, 32, 12), Split(rows=(16, 16))), ((4, 32, 12), None),
             ((64, 32), Split(rows=(8,) * 8)), ((64, 32), Split(rows=(32, 16, 16))), ((64, 32), None),
             ((32, 96), Split(cols=(32,) * 3))]
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(s, generator=gen) for s, _ in specs]
    infos = [ParamInfo(f"p{i}", s, math.prod(s), sp) for i, (s, sp) in enumerate(specs)]
    u = torch.cat([t.reshape(-1) for t in tensors])
    want = torch.cat([loop_update(t, sp).reshape(-1) for t, (_, sp) in zip(tensors, specs)])
    for plan in (build_plan(infos, 1), build_bucketed_plan(infos, 1, bucket_elements=3000)):
        got = u.clone()
        OwnerExchange(None, torch.float32, torch.float32).run(plan, got, got, scaled_ns)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plan = build_plan(infos, 1)
    assert sorted(b.count for b in plan.batches[0]) == [1, 1, 1, 1, 1, 2]  # the two equal views share a batch
    assert sum(plan.load()) == sum(matrix_view(s, sp).cost(5, "standard") for s, sp in specs)


def test_oracle_orthogonalizes_each_declared_block():
    torch.manual_seed(0)
    lin = nn.Linear(12, 20, bias=False)
    lin.weight.use_muon = True
    setattr(lin.weight, SPLIT_ATTR, Split(rows=(8, 12)))
    w0 = lin.weight.detach().clone()
    lin.weight.grad = torch.randn(20, 12)
    opt = MuonAdamW([lin.weight], lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0)
    opt.step()
    want = w0 - 0.1 * loop_update(lin.weight.grad, Split(rows=(8, 12)))
    torch.testing.assert_close(lin.weight.detach(), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# selection on transformers models built from a config
# ------------------------------------------------------------------------------------------------
def tiny_config(cfg_cls, **kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return cfg_cls(**base)


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(tiny_config(transformers.Qwen3MoeConfig, num_experts=4,
                                                        num_experts_per_tok=2, moe_intermediate_size=16))


def mixtral():
    return transformers.MixtralForCausalLM(tiny_config(transformers.MixtralConfig, num_local_experts=4,
                                                       num_experts_per_tok=2, intermediate_size=24))


@stacked_experts
@pytest.mark.parametrize("build,inter", [(qwen3_moe, 16), (mixtral, 24)])
def test_hf_moe_experts_on_muon_per_expert_gate_up_apart(build, inter):
    model = build()
    sel = select_muon_params(model)
    for layer in range(2):
        exp = f"model.layers.{layer}.mlp.experts"
        assert sel.use_muon[f"{exp}.gate_up_proj"] and sel.use_muon[f"{exp}.down_proj"]
        assert sel.reasons[f"{exp}.gate_up_proj"] == selection.EXPERTS
        assert sel.splits[f"{exp}.gate_up_proj"] == Split(rows=(inter, inter), label="gate/up")
        assert f"{exp}.down_proj" not in sel.splits
        assert sel.view(f"{exp}.gate_up_proj").num_blocks == 8 and sel.view(f"{exp}.down_proj").num_blocks == 4
        assert not sel.use_muon[f"model.layers.{layer}.mlp.gate.weight"]
        assert sel.reasons[f"model.layers.{layer}.mlp.gate.weight"] == selection.ROUTER
    text = sel.summary()
    assert "MoE rule:" in text and "stacked, gate/up" in text and "8 blocks of" in text


@stacked_experts
def test_qwen2_moe_shared_expert_muon_and_its_gate_adamw():
    model = transformers.Qwen2MoeForCausalLM(tiny_config(
        transformers.Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24))
    sel = select_muon_params(model)
    mlp = "model.layers.0.mlp"
    assert sel.reasons[f"{mlp}.shared_expert_gate.weight"] == selection.ROUTER
    assert sel.use_muon[f"{mlp}.shared_expert.gate_proj.weight"] and sel.use_muon[f"{mlp}.experts.down_proj"]


def test_expert_rule_is_structural_not_by_name():
    """A plain module holding (E, ., .) weights with num_experts is an expert container; the same
    weights without an expert count stay unrecognised (AdamW, noted)."""

    class Bank(nn.Module):
        def __init__(self, count: bool) -> None:
            super().__init__()
            if count:
                self.num_experts = 3
            self.w_in = nn.Parameter(torch.randn(3, 10, 6))
            self.w_out = nn.Parameter(torch.randn(3, 6, 10))

    class Block(nn.Module):
        def __init__(self, count: bool) -> None:
            super().__init__()
            self.route = nn.Linear(6, 3, bias=False)
            self.bank = Bank(count)
            self.proj = nn.Linear(6, 6)

    sel = select_muon_params(Block(True))
    assert sel.reasons["bank.w_in"] == selection.EXPERTS and sel.reasons["route.weight"] == selection.ROUTER
    assert sel.use_muon["proj.weight"] or sel.reasons["proj.weight"] == selection.OUTPUT_HEAD
    sel = select_muon_params(Block(False))
    assert sel.reasons["bank.w_in"] == selection.UNRECOGNISED and not sel.use_muon["bank.w_in"]


def test_router_module_gate_next_to_local_experts_is_a_router():
    """DeepSpeed AutoEP's layout (``AutoEPMoELayer``): a router module holding one ``gate`` Linear(H, E) beside a
    ``GroupedExperts`` of this rank's E/EP experts (``num_experts`` = E/EP). The gate scores all E experts (the
    config's count), so it is the router (AdamW); a sibling module with several matrices (a shared-expert MLP) is
    not; the stacked local experts are Muon, one matrix per expert. The real layer under DeepSpeed:
    tests/dist/test_autoep.py."""

    class Router(nn.Module):  # DeepSpeed's TokenChoiceTopKRouter: no parameter of its own
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(32, 4, bias=False)

    class LocalExperts(nn.Module):  # DeepSpeed's GroupedExperts with E / EP = 2 of the config's 4 experts
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 2
            self.w1, self.w3 = (nn.Parameter(torch.randn(2, 16, 32)) for _ in range(2))
            self.w2 = nn.Parameter(torch.randn(2, 32, 16))

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 4), nn.Linear(4, 32)  # 4 rows, as many as experts: still no router

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.experts, self.shared = Router(), LocalExperts(), Shared()
            self.config = SimpleNamespace(num_experts=4)

    sel = select_muon_params(Layer())
    assert sel.reasons["router.gate.weight"] == selection.ROUTER and not sel.use_muon["router.gate.weight"]
    assert all(sel.reasons[f"experts.{w}"] == selection.EXPERTS and sel.use_muon[f"experts.{w}"]
               for w in ("w1", "w2", "w3"))
    assert sel.view("experts.w1").num_blocks == 2
    assert sel.reasons["shared.up.weight"] == selection.HIDDEN_MATRIX and sel.use_muon["shared.up.weight"]


def test_transposed_expert_gate_up_is_whole_and_noted():
    """GPT-OSS-style (E, H, 2I) gate_up: interleaved or halves is unknown from the shape -> one
    matrix per expert, with a note naming the fix."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 2 * 10))
            self.down_proj = nn.Parameter(torch.randn(4, 10, 16))

    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()

    sel = select_muon_params(Moe())
    assert sel.use_muon["experts.gate_up_proj"] and "experts.gate_up_proj" not in sel.splits
    assert any("experts.gate_up_proj" in n and "cols split" in n for n in sel.notes)


def phi3():
    return transformers.Phi3ForCausalLM(tiny_config(transformers.Phi3Config))


def llama():
    return transformers.LlamaForCausalLM(tiny_config(transformers.LlamaConfig, rms_norm_eps=1e-5))  # Phi-3's eps


def test_phi3_fused_gate_up_and_qkv_split():
    sel = select_muon_params(phi3())
    assert sel.splits["model.layers.0.mlp.gate_up_proj.weight"] == Split(rows=(48, 48), label="gate/up")
    assert sel.splits["model.layers.0.self_attn.qkv_proj.weight"] == Split(rows=(32, 16, 16), label="q/k/v")
    assert "model.layers.0.self_attn.o_proj.weight" not in sel.splits
    sel = select_muon_params(phi3(), SelectionRules.of(per_head_muon=True))
    assert sel.splits["model.layers.1.self_attn.qkv_proj.weight"] == Split(rows=(8,) * 8, label="per head")


def test_per_head_gqa_llama_and_gpt2_conv1d():
    sel = select_muon_params(llama(), SelectionRules.of(per_head_muon=True))
    attn = "model.layers.0.self_attn"
    assert sel.splits[f"{attn}.q_proj.weight"].rows == (8,) * 4
    assert sel.splits[f"{attn}.k_proj.weight"].rows == (8,) * 2 and sel.splits[f"{attn}.v_proj.weight"].rows == (8,) * 2
    assert f"{attn}.o_proj.weight" not in sel.splits and "model.layers.0.mlp.up_proj.weight" not in sel.splits
    assert not select_muon_params(llama()).splits  # per head is opt-in
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                bos_token_id=1, eos_token_id=2))
    assert select_muon_params(gpt2).splits["transformer.h.0.attn.c_attn.weight"] == Split(cols=(32,) * 3, label="q/k/v")
    assert select_muon_params(gpt2, SelectionRules.of(per_head_muon=True)).splits["transformer.h.0.attn.c_attn.weight"].cols == (8,) * 12


def test_per_head_multimodal_vision_tower_uses_its_own_heads():
    """Llava (CLIP vision tower: 8 heads of 4; Llama text model: 4 heads of 8, 2 KV heads): each attention is
    split by its own module's geometry, not by the text config that model.config.get_text_config() returns
    (which cut the vision q_proj into 4 blocks of 8 and left its k/v whole)."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=8, image_size=16, patch_size=8, projection_dim=16)
    text = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=63))
    splits = select_muon_params(model, SelectionRules.of(per_head_muon=True)).splits
    v, t = "model.vision_tower.encoder.layers.0.self_attn", "model.language_model.layers.0.self_attn"
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert splits[f"{v}.{proj}.weight"] == Split(rows=(4,) * 8, label="per head"), (proj, splits)
    assert splits[f"{t}.q_proj.weight"] == Split(rows=(8,) * 4, label="per head")
    assert splits[f"{t}.k_proj.weight"] == splits[f"{t}.v_proj.weight"] == Split(rows=(8,) * 2, label="per head")
    assert f"{v}.out_proj.weight" not in splits and f"{t}.o_proj.weight" not in splits


def test_per_head_with_nothing_matched_fails_clearly():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="per_head_muon is enabled but no attention projection"):
        select_muon_params(model, SelectionRules.of(per_head_muon=True))


def test_declared_splits_attribute_and_pattern():
    model = llama()
    attr = model.model.layers[0].mlp.down_proj.weight  # (32, 48)
    attr.muon_split = {"cols": [24, 24]}
    sel = tag_model(model, SelectionRules.of(muon_splits={"*.layers.1.self_attn.q_proj.weight": [16, 16]}), log=False)
    assert sel.splits["model.layers.0.mlp.down_proj.weight"] == Split(None, (24, 24), "declared")
    assert sel.splits["model.layers.1.self_attn.q_proj.weight"] == Split((16, 16), None, "declared")
    assert getattr(attr, SPLIT_ATTR) == Split(None, (24, 24), "declared")
    assert getattr(model.model.layers[0].mlp.up_proj.weight, SPLIT_ATTR) is None
    assert "declared: 2 params" in sel.summary()
    with pytest.raises(ValueError, match=r"down_proj.weight.*sum to 40"):
        attr.muon_split = [20, 20]
        select_muon_params(model)
    del attr.muon_split
    with pytest.raises(ValueError, match="match no Muon parameter"):
        select_muon_params(model, SelectionRules.of(muon_splits={"*.nothing": [1]}))
    attr = model.model.norm.weight
    attr.muon_split = [16, 16]
    with pytest.raises(ValueError, match="goes to AdamW"):
        select_muon_params(model)


def test_config_accepts_per_head_and_validates_splits():
    cfg = parse_muon_params({"per_head_muon": True, "muon_splits": {"*.wqkv.weight": [4, 2, 2],
                                                                    "*.c_fc.weight": {"cols": [8, 8]}}})
    assert cfg.per_head_muon is True
    assert cfg.declared_splits() == {"*.wqkv.weight": {"rows": [4, 2, 2], "cols": None},
                                     "*.c_fc.weight": {"rows": None, "cols": [8, 8]}}
    with pytest.raises(ConfigError, match=r"muon_splits\.a\.rows\[0\]: 0 is invalid"):
        parse_muon_params({"muon_splits": {"a": [0]}})
    with pytest.raises(ConfigError, match=r"muon_splits\.a: \{\} is invalid: a split needs"):
        parse_muon_params({"muon_splits": {"a": {}}})
    with pytest.raises(ConfigError, match="per_head_muon"):
        parse_muon_params({"per_head_muon": "yes"})
    # the committed JSON Schema accepts and refuses the same forms
    import json
    import os

    import jsonschema
    path = os.path.join(os.path.dirname(__file__), "..", "..", "ds_config_schemas", "muon_optimizer_params.schema.json")
    with open(path) as f:
        schema = json.load(f)
    jsonschema.validate({"per_head_muon": True, "muon_splits": {"a": [4, 2], "b": {"cols": [3, 3]}}}, schema)
    for bad in ({"a": [0]}, {"a": {}}, {"a": {"row": [1]}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"muon_splits": bad}, schema)


def _copy_unfused(phi: nn.Module, lla: nn.Module) -> None:
    """Llama twin <- Phi-3 weights (qkv_proj rows -> q/k/v, gate_up_proj rows -> gate/up)."""
    sd = phi.state_dict()
    out = {}
    for k, v in sd.items():
        if "qkv_proj" in k:
            q, kk, vv = v.split([32, 16, 16])
            for n, t in (("q_proj", q), ("k_proj", kk), ("v_proj", vv)):
                out[k.replace("qkv_proj", n)] = t
        elif "gate_up_proj" in k:
            g, u = v.chunk(2)
            out[k.replace("gate_up_proj", "gate_proj")], out[k.replace("gate_up_proj", "up_proj")] = g, u
        else:
            out[k] = v
    lla.load_state_dict(out)


def fused_to_unfused(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in params.items():
        if "qkv_proj" in k:
            for n, t in zip(("q_proj", "k_proj", "v_proj"), v.split([32, 16, 16])):
                out[k.replace("qkv_proj", n)] = t
        elif "gate_up_proj" in k:
            for n, t in zip(("gate_proj", "up_proj"), v.chunk(2)):
                out[k.replace("gate_up_proj", n)] = t
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("per_head", [False, True])
def test_fused_and_unfused_twins_train_identically(per_head):
    """Phi-3 (fused qkv_proj, gate_up_proj) and a Llama with the same weights, 4 Muon steps: equal
    parameters (with the split switched off, the fused model's trajectory differs)."""
    torch.manual_seed(0)
    results = {}
    for label in ("fused", "unfused", "fused-unsplit"):
        torch.manual_seed(0)
        phi = phi3()
        model = phi
        if label == "unfused":
            model = llama()
            _copy_unfused(phi, model)
        opt = MuonAdamW(model, lr=0.02, adam_lr=3e-3, weight_decay=0.05, momentum=0.9, per_head_muon=per_head)
        if label == "fused-unsplit":
            for p in model.parameters():
                setattr(p, SPLIT_ATTR, None)
        gen = torch.Generator().manual_seed(5)
        for _ in range(4):
            ids = torch.randint(0, 64, (2, 9), generator=gen)
            opt.zero_grad()
            model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        results[label] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fused = fused_to_unfused(results["fused"])
    assert fused.keys() == results["unfused"].keys()
    for k, want in results["unfused"].items():
        torch.testing.assert_close(fused[k], want, rtol=1e-5, atol=1e-6, msg=k)
    unsplit = fused_to_unfused(results["fused-unsplit"])
    worst = max((unsplit[k] - v).norm() / v.norm() for k, v in results["unfused"].items() if "qkv" in k or "proj" in k)
    assert worst > 1e-3


# ------------------------------------------------------------------------------------------------
# convolution weights: one matrix (out, in/groups * kernel), also at 3-D; per group; depthwise AdamW
# ------------------------------------------------------------------------------------------------
def _whisper():
    cfg = transformers.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     num_mel_bins=8, vocab_size=100, max_source_positions=16,
                                     max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1)
    return transformers.WhisperForConditionalGeneration(cfg)


def test_conv1d_weight_is_one_matrix_not_a_stack():
    """Whisper's encoder conv2 (nn.Conv1d, weight (32, 32, 3)) is one matrix (out, in*k), as a 4-D conv weight
    is, not 32 stacked (in, k) matrices; the oracle's step on it equals Newton–Schulz of the flattened matrix with
    that matrix's update scale. conv1 reads the log-mel features: the input layer, AdamW."""
    from ds_muon.model.selection import INPUT_LAYER
    torch.manual_seed(0)
    model = _whisper()
    sel = tag_model(model, log=False)
    params = dict(model.named_parameters())
    assert not sel.use_muon["model.encoder.conv1.weight"] and sel.reasons["model.encoder.conv1.weight"] == INPUT_LAYER
    for name, (out, cols) in {"model.encoder.conv2.weight": (32, 96)}.items():
        assert sel.use_muon[name] and sel.splits[name].conv
        assert sel.view(name).ns_shape == (1, out, cols) and sel.view(name).describe() == f"1 block of {out}x{cols}"
    w = params["model.encoder.conv2.weight"]
    opt = MuonAdamW([w], lr=0.1, momentum=0.5, nesterov=False, weight_decay=0.0, ns_dtype="float32")
    m = torch.zeros(w.shape)
    for step in range(2):
        w0 = w.detach().clone()
        w.grad = torch.randn(w.shape)
        if step == 1:
            w.grad[0] = 0  # one output channel without gradient: the matrix still has one, so it all steps
        m = 0.5 * m + w.grad
        opt.step()
        want = w0 - 0.1 * scaled_ns(m.reshape(32, 96)).reshape(w.shape)
        torch.testing.assert_close(w.detach(), want, rtol=1e-5, atol=1e-6)
    assert "conv: 1 params -> 1 blocks" in sel.summary()


def test_grouped_conv_per_group_and_depthwise_conv_adamw():
    """A grouped conv is one matrix per group (rows out/groups); a depthwise conv (Mamba's conv1d,
    one filter row per channel) goes to AdamW with its reason; a declared split keeps the conv view."""
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
                                   conv_kernel=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    mamba = transformers.MambaForCausalLM(cfg)
    sel = select_muon_params(mamba)
    name = "backbone.layers.0.mixer.conv1d.weight"
    assert sel.shapes[name] == (32, 1, 4) and not sel.use_muon[name]
    assert sel.reasons[name] == selection.DEPTHWISE
    assert sel.use_muon["backbone.layers.0.mixer.in_proj.weight"]

    net = nn.Sequential(nn.Conv1d(8, 12, 3, groups=2), nn.Conv1d(12, 12, 3))
    net[1].weight.muon_split = [6, 6]
    for conv in net:
        conv.weight.use_muon = True  # no config: the last matrix would be guessed as an output head
    sel = select_muon_params(net)
    assert sel.splits["0.weight"] == Split(rows=(6, 6), conv=True, label="conv per group")
    assert sel.view("0.weight").describe() == "2 blocks of 6x12"
    assert sel.splits["1.weight"].conv and sel.view("1.weight").describe() == "2 blocks of 6x36"
    # a declared split on a grouped conv is also cut at the group boundaries: rows of two groups never mix
    grouped = nn.Conv1d(9, 12, 3, groups=3)
    grouped.weight.use_muon, grouped.weight.muon_split = True, {"rows": [6, 6]}
    assert select_muon_params(grouped).splits["weight"].rows == (4, 2, 2, 4)
    grouped.weight.muon_split = {"cols": [3, 6]}
    assert select_muon_params(grouped).view("weight").describe() == "3 blocks of 4x3 + 3 blocks of 4x6"
    w = net[0].weight
    setattr(w, SPLIT_ATTR, sel.splits["0.weight"])
    w0 = w.detach().clone()
    w.grad = torch.randn(w.shape)
    MuonAdamW([w], lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype="float32").step()
    g = w.grad.reshape(12, 12)
    want = torch.cat([scaled_ns(g[:6]), scaled_ns(g[6:])]).reshape(w.shape)
    torch.testing.assert_close(w.detach(), w0 - 0.1 * want, rtol=1e-5, atol=1e-6)
