"""Selection on model families whose parameters are not plain Linear weights (issue 26; docs/selection.md):
GPT-OSS experts (2-D expert biases, gate/up interleaved), Qwen3-Next gated and linear attention, PyTorch's
``nn.MultiheadAttention`` (``nn.TransformerEncoderLayer``), a ViT patch embedding (input layer), and the weight-decay
exemption of norm weights and biases (Llama, Qwen3), each on the real class built from a tiny config.

Each split is checked against the model's own forward: the blocks must be exactly the pieces its forward reads
(GPT-OSS ``_apply_gate``, Qwen3-Next ``fix_query_key_value_ordering`` and its ``q_proj`` chunk, PyTorch's packed
in-projection), not only against a shape.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_muon.core.matrix import orthogonalize_blocks_
from ds_muon.model import selection
from ds_muon.model.adam_mini_blocks import PER_ELEMENT, adam_mini_param_groups, adam_mini_plan
from ds_muon.model.selection import SelectionRules, select_muon_params
from ds_muon.model.structure import decay_exempt_names
from tests.support.families import encoder_lm, gpt_oss, qwen3_next, vit

transformers = pytest.importorskip("transformers")
stacked_experts = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                     reason="stacked expert containers need transformers >= 5")


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0))


def qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0))


def block_ids(shape, split) -> torch.Tensor:
    """Each element of a parameter of ``shape`` labelled with the index of the view block that holds it."""
    from ds_muon.core.matrix import matrix_view
    view = matrix_view(shape, split)
    ids = torch.full((1, int(torch.tensor(shape).prod())), -1.0)
    counter = iter(range(10 ** 6))

    def label(blocks):  # (1, *batch, rows, cols): one id per block
        out = torch.empty(blocks.shape)  # contiguous, so the reshape below is a view
        flat = out.reshape(-1, *blocks.shape[-2:])
        for b in range(flat.shape[0]):
            flat[b] = next(counter)
        return out

    orthogonalize_blocks_(ids, view, label)
    assert (ids >= 0).all(), "the blocks must tile the parameter"
    return ids.view(shape)


def assert_blocks_are_pieces(ids: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Every block is exactly one of ``pieces`` (index tensors into ``ids``' flat elements) and vice versa."""
    flat = ids.reshape(-1)
    blocks = {int(b): set(torch.nonzero(flat == b).flatten().tolist()) for b in flat.unique()}
    wanted = [set(p.flatten().tolist()) for p in pieces]
    assert sorted(map(sorted, blocks.values())) == sorted(map(sorted, wanted))


# ------------------------------------------------------------------------------------------------
# 1. GPT-OSS experts
# ------------------------------------------------------------------------------------------------
@stacked_experts
def test_gpt_oss_experts_muon_biases_adamw_gate_up_interleaved_as_its_forward_reads():
    model = gpt_oss()
    sel = select_muon_params(model)
    for layer in range(2):
        pre = f"model.layers.{layer}.mlp."
        assert sel.use_muon[pre + "experts.gate_up_proj"] and sel.reasons[pre + "experts.gate_up_proj"] == selection.EXPERTS
        assert sel.use_muon[pre + "experts.down_proj"] and sel.reasons[pre + "experts.down_proj"] == selection.EXPERTS
        for bias in ("experts.gate_up_proj_bias", "experts.down_proj_bias"):
            assert not sel.use_muon[pre + bias] and sel.reasons[pre + bias] == selection.BIAS
        assert not sel.use_muon[pre + "router.weight"] and sel.reasons[pre + "router.weight"] == selection.ROUTER
    name = "model.layers.0.mlp.experts.gate_up_proj"
    experts = model.model.layers[0].mlp.experts
    split = sel.splits[name]
    assert split.interleave == 2 and split.label == "gate/up interleaved"
    assert "model.layers.0.mlp.experts.down_proj" not in sel.splits  # one matrix per expert
    # the blocks are what GptOssExperts._apply_gate reads: gate = x[..., ::2], up = x[..., 1::2], per expert
    E, H, two_i = experts.gate_up_proj.shape
    ids = block_ids((E, H, two_i), split)
    idx = torch.arange(E * H * two_i).view(E, H, two_i)
    assert_blocks_are_pieces(ids, [idx[e][:, j::2] for e in range(E) for j in range(2)])
    # and through the forward: gate_up @ W, the gate half of the expert output uses only the gate block
    x = torch.randn(5, H)
    gate_cols = (ids[0] == ids[0, 0, 0])
    w = experts.gate_up_proj.detach()[0]
    out = x @ (w * gate_cols)
    torch.testing.assert_close(out[:, ::2], (x @ w)[:, ::2])
    assert out[:, 1::2].abs().max() == 0
    summary = sel.summary()
    assert "stacked, gate/up interleaved (cols 2 interleaved, block b = [..., b::2]): 2 params -> 16 blocks" in summary
    assert "expert biases (E, n): AdamW" in summary


# ------------------------------------------------------------------------------------------------
# 6. Qwen3-Next: gated q_proj, GatedDeltaNet in_proj_qkvz / in_proj_ba
# ------------------------------------------------------------------------------------------------
@stacked_experts
def test_qwen3_next_gated_and_linear_attention_split_per_head_as_its_forward_reads():
    model = qwen3_next()
    sel = select_muon_params(model, SelectionRules.of(per_head_muon=True))
    lin = model.model.layers[0].linear_attn
    qkvz, ba = "model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight"
    for n in (qkvz, ba, "model.layers.1.self_attn.q_proj.weight"):
        assert sel.use_muon[n] and sel.splits[n].label == "per head", n
    # in_proj_qkvz / in_proj_ba: run the model's own reordering on row indices
    rows_qkvz, rows_ba = lin.in_proj_qkvz.out_features, lin.in_proj_ba.out_features
    q, k, v, z, b, a = lin.fix_query_key_value_ordering(torch.arange(rows_qkvz).view(1, 1, -1),
                                                        torch.arange(rows_ba).view(1, 1, -1))
    for name, heads in ((qkvz, [q[0, 0, h] for h in range(q.shape[2])] + [k[0, 0, h] for h in range(k.shape[2])]
                         + [v[0, 0, h] for h in range(v.shape[2])] + [z[0, 0, h] for h in range(z.shape[2])]),
                        (ba, None)):
        shape = sel.shapes[name]
        ids = block_ids(shape, sel.splits[name])
        idx = torch.arange(shape[0] * shape[1]).view(shape)
        if heads is None:  # b and a: per key head, the value heads' scalars (r = 2 rows each)
            r = lin.num_v_heads // lin.num_k_heads
            heads = [b[0, 0, g * r:(g + 1) * r] for g in range(lin.num_k_heads)] + \
                    [a[0, 0, g * r:(g + 1) * r] for g in range(lin.num_k_heads)]
        assert_blocks_are_pieces(ids, [idx[rows] for rows in heads])
    # gated q_proj: view(-1, 2 * head_dim).chunk(2) per head -> query head h and gate head h
    attn = model.model.layers[1].self_attn
    name = "model.layers.1.self_attn.q_proj.weight"
    shape = sel.shapes[name]
    query, gate = torch.chunk(torch.arange(shape[0]).view(-1, attn.head_dim * 2), 2, dim=-1)
    idx = torch.arange(shape[0] * shape[1]).view(shape)
    assert_blocks_are_pieces(block_ids(shape, sel.splits[name]), [idx[r] for r in list(query) + list(gate)])
    # without per_head_muon they stay whole, and the summary says why
    plain = select_muon_params(model)
    assert qkvz not in plain.splits and ba not in plain.splits
    assert "q/k/v/z interleaved per key head: whole without per_head_muon" in plain.summary()


# ------------------------------------------------------------------------------------------------
# 7. nn.MultiheadAttention / nn.TransformerEncoderLayer
# ------------------------------------------------------------------------------------------------
def test_multihead_attention_in_proj_q_k_v_apart_per_head_and_biases():
    model = encoder_lm()
    w = "encoder.layers.0.self_attn.in_proj_weight"
    for per_head, label, blocks in ((False, "q/k/v", 3), (True, "per head", 12)):
        sel = select_muon_params(model, SelectionRules.of(per_head_muon=per_head))
        assert sel.use_muon[w] and sel.reasons[w] == selection.MHA_IN_PROJ
        assert sel.splits[w].label == label and sel.view(w).num_blocks == blocks
        assert not sel.use_muon["encoder.layers.0.self_attn.in_proj_bias"]
        assert sel.use_muon["encoder.layers.0.self_attn.out_proj.weight"]
        # the blocks are what PyTorch's packed in-projection reads: w.chunk(3) (then heads of head_dim rows)
        ids = block_ids(sel.shapes[w], sel.splits[w])
        idx = torch.arange(96 * 32).view(96, 32)
        pieces = list(idx.chunk(3)) if not per_head else [p for c in idx.chunk(3) for p in c.chunk(4)]
        assert_blocks_are_pieces(ids, pieces)
    # Adam-mini: per-head blocks of Q, K (and V) in in_proj_weight; in_proj_bias a bias (per element, no decay)
    plan = adam_mini_plan(model)
    assert plan[w].block == 8 * 32 and plan[w].reason.startswith("per head")
    bias = plan["encoder.layers.0.self_attn.in_proj_bias"]
    assert bias.block == PER_ELEMENT and not bias.decay and bias.reason == "bias"
    groups = adam_mini_param_groups(model, dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    in_bias = model.encoder.layers[0].self_attn.in_proj_bias
    assert [g["weight_decay"] for g in groups if any(p is in_bias for p in g["params"])] == [0.0]


def test_multihead_attention_bias_k_bias_v_are_biases():
    """``add_bias_kv``: ``bias_k``/``bias_v`` (1, 1, E) are biases: AdamW, no weight decay (as Trainer: named *bias*)."""
    mha = nn.MultiheadAttention(32, 4, add_bias_kv=True)
    sel = select_muon_params(mha)
    for n in ("bias_k", "bias_v"):
        assert not sel.use_muon[n] and sel.reasons[n] == selection.BIAS, n
    assert {"bias_k", "bias_v", "in_proj_bias", "out_proj.bias"} <= decay_exempt_names(mha)


def test_multihead_attention_with_kdim_vdim_per_head():
    mha = nn.MultiheadAttention(32, 4, kdim=16, vdim=24)
    sel = select_muon_params(mha, SelectionRules.of(per_head_muon=True))
    for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        assert sel.use_muon[n] and sel.reasons[n] == selection.MHA_IN_PROJ and sel.view(n).num_blocks == 4
    assert adam_mini_plan(mha)["k_proj_weight"].block == 8 * 16


# ------------------------------------------------------------------------------------------------
# 11. input layers: ViT patch embedding
# ------------------------------------------------------------------------------------------------
def test_vit_patch_embedding_is_the_input_layer_on_adamw():
    model = vit()
    sel = select_muon_params(model)
    name = "vit.embeddings.patch_embeddings.projection.weight"
    assert not sel.use_muon[name] and sel.reasons[name] == selection.INPUT_LAYER
    assert sel.use_muon["vit.layers.0.attention.q_proj.weight"]
    assert not sel.use_muon["classifier.weight"]
    assert f'rule "{selection.INPUT_LAYER}": 1 params' in sel.summary()


def test_input_layer_by_config_width_without_a_declaration():
    """A plain conv stem reading the config's ``num_channels`` (no get_input_embeddings) is the input layer too."""

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = transformers.PretrainedConfig(num_channels=3)
            self.stem = nn.Conv2d(3, 16, 3)
            self.body = nn.Conv2d(16, 16, 3)

    sel = select_muon_params(Stem())
    assert sel.reasons["stem.weight"] == selection.INPUT_LAYER and sel.use_muon["body.weight"]


# ------------------------------------------------------------------------------------------------
# 8. weight decay: Hugging Face Trainer's convention for norms and biases
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [llama, qwen3, gpt_oss, encoder_lm], ids=["llama", "qwen3", "gpt-oss", "encoder"])
def test_no_decay_set_is_hf_trainers(build):
    model = build()
    trainer_decays = set(transformers.Trainer.get_decay_parameter_names(None, model))
    names = {n for n, _ in model.named_parameters()}
    assert decay_exempt_names(model) == names - trainer_decays


@pytest.mark.parametrize("build", [llama, qwen3], ids=["llama", "qwen3"])
def test_muon_adamw_and_adam_mini_groups_exempt_norms_and_biases_unless_configured(build):
    import ds_muon
    model = build()
    exempt = decay_exempt_names(model)
    assert any("norm" in n for n in exempt)
    named = {id(p): n for n, p in model.named_parameters()}
    for decay_all in (False, True):
        opt = ds_muon.MuonAdamW(model, lr=0.02, weight_decay=0.1, decay_norms_and_biases=decay_all)
        wd = {named[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
        assert {n for n, v in wd.items() if v == 0.0} == (set() if decay_all else exempt)
        assert all(v == 0.1 for n, v in wd.items() if n not in exempt)
        mini = ds_muon.AdamMini(model, lr=1e-3, weight_decay=0.1, decay_norms_and_biases=decay_all)
        wd = {named[id(p)]: g["weight_decay"] for g in mini.param_groups for p in g["params"]}
        assert {n for n, v in wd.items() if v == 0.0} == (set() if decay_all else exempt)


def test_decay_norms_and_biases_is_a_validated_key():
    from ds_muon.config import ConfigError, parse_muon_params
    from ds_muon.config.adam_mini import parse_adam_mini_params
    assert parse_muon_params({}).decay_norms_and_biases is False
    assert parse_adam_mini_params({"decay_norms_and_biases": True}).decay_norms_and_biases is True
    with pytest.raises(ConfigError, match="decay_norms_and_biases"):
        parse_muon_params({"decay_norms_and_biases": "yes"})


# ------------------------------------------------------------------------------------------------
# 9. a framework's own Muon object
# ------------------------------------------------------------------------------------------------
def test_client_muon_objects_are_recognised():
    from ds_muon.integration.validation import client_muon_problem
    params = [nn.Parameter(torch.randn(4, 4))]

    class Muon(torch.optim.Optimizer):  # Keller Jordan's / Moonlight's class name
        def __init__(self, ps):
            super().__init__(ps, dict(lr=0.02, momentum=0.95, weight_decay=0.0))

    class AuxAdam(torch.optim.Optimizer):  # MuonWithAuxAdam-style groups under another name
        def __init__(self, ps):
            super().__init__([dict(params=ps, use_muon=True)], dict(lr=0.02))

    class Orthogonal(torch.optim.Muon):  # torch's Muon under another name: by isinstance
        pass

    class MuonLogger(torch.optim.Optimizer):  # "Muon" in the name, no Muon hyperparameter in its groups
        def __init__(self, ps):
            super().__init__(ps, dict(lr=0.02, betas=(0.9, 0.95)))

    msg = client_muon_problem(torch.optim.Muon(params, lr=0.01), 3)
    assert "torch.optim.Muon" in msg and '"type": "Muon"' in msg and '"lr": 0.01' in msg and "2D matrix" in msg
    assert "ZeRO stage 2" in client_muon_problem(Muon(params), 2)
    assert client_muon_problem(AuxAdam(params), 1) is not None
    assert "Orthogonal" in client_muon_problem(Orthogonal(params), 3)
    import ds_muon
    assert "MuonAdamW" in client_muon_problem(ds_muon.MuonAdamW(params), 3)  # the oracle: use_muon groups
    assert client_muon_problem(MuonLogger(params), 3) is None
    assert client_muon_problem(torch.optim.AdamW(params), 3) is None
    from deepspeed.runtime.zero.muon.original_muon import MuonWithAuxAdam
    assert client_muon_problem(MuonWithAuxAdam([dict(params=params, use_muon=True)]), 3) is None
    from ds_muon.config import parse_muon_params
    from ds_muon.integration.inner import ZeroMuonInner
    inner = ZeroMuonInner([dict(params=params, use_muon=True)], None, parse_muon_params({}))
    assert client_muon_problem(inner, 3) is None  # ds_muon's own inner optimizer
