"""Adam-mini on one process: the block rules, the single-device reference (ds_muon.AdamMini), config errors.

The block rules on a tiny GQA Llama, per-element blocks equal torch.optim.AdamW, and a block step equals the
formula written out by hand. ZeRO-3 parity is tests/dist/test_adam_mini.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist.test_moe_parity import llama as tiny_gqa_llama

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------
def test_block_rules_on_gqa_tiny_gqa_llama() -> None:
    from ds_muon.model.adam_mini_blocks import PER_ELEMENT, adam_mini_blocks, adam_mini_plan
    model = tiny_gqa_llama()
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


def _biased_llama():
    """The tiny GQA Llama with biases on every attention and MLP projection."""
    from tests.dist.test_moe_parity import _config, _lm
    return _lm(transformers.LlamaForCausalLM)(_config(transformers.LlamaConfig, attention_bias=True, mlp_bias=True))


def _exempt(name: str) -> bool:
    """Norm weights and biases: no weight decay (the rule of ds_muon.model.adam_mini_blocks, by the test's names)."""
    return name.endswith(".bias") or name.rpartition(".")[0].endswith("norm")


def test_norm_weights_and_biases_are_not_decayed() -> None:
    """The param groups Adam-mini builds (the reference and the ZeRO paths share them) give every norm weight and
    bias ``weight_decay`` 0.0 and every other parameter the configured one; trained one step from the same weights
    on the same batch with weight decay 0.5 and 0, the reference ``ds_muon.AdamMini`` leaves exactly those
    parameters identical and moves every other by the decay alone (``lr * wd * p0``)."""
    import ds_muon
    from ds_muon.model.adam_mini_blocks import adam_mini_param_groups
    from tests.support.models import batch
    torch.manual_seed(0)
    model = _biased_llama()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = adam_mini_param_groups(model, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5))
    decay = {names[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}
    assert set(decay) == set(names.values())
    exempt = {n for n in decay if _exempt(n)}
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.bias",
            "model.layers.0.mlp.down_proj.bias"} <= exempt, sorted(exempt)
    assert {n: decay[n] for n in exempt} == dict.fromkeys(exempt, 0.0)
    assert {n: d for n, d in decay.items() if n not in exempt} == {n: 0.5 for n in decay if n not in exempt}

    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = {}
    for wd in (0.5, 0.0):
        for n, p in model.named_parameters():
            p.data.copy_(init[n])
        opt = ds_muon.AdamMini(model, lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=wd)
        model.zero_grad(set_to_none=True)
        model(*batch(0, 0, 0)).backward()
        opt.step()
        after[wd] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p0 in init.items():
        if n in exempt:
            assert torch.equal(after[0.5][n], after[0.0][n]), f"{n} was decayed"
        else:
            torch.testing.assert_close(after[0.0][n] - after[0.5][n], 1e-2 * 0.5 * p0, rtol=1e-3, atol=1e-7,
                                       msg=lambda m, n=n: f"{n}: {m}")


def test_reference_per_element_is_adamw_and_block_matches_formula() -> None:
    import ds_muon
    from ds_muon.names import BLOCK_ATTR
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


def test_block_map_of_adam_mini_slots_takes_any_shape() -> None:
    """build_block_map with Adam-mini's block sizes: 1-D (a norm, one block) and 2-D parameters, never
    a Muon view (a 1-D shape has none), blocks split by the shard boundary; fails if the Muon view is
    computed for an Adam-mini slot."""
    from ds_muon.sharded.blocks import build_block_map
    from ds_muon.integration.zero3 import AdamMiniSlot
    from ds_muon.partitions import chunked_pieces
    # W = 2: a (6,) norm as one block (chunk 3) then an (4, 5) weight in blocks of 5 (chunk 10)
    slots = [AdamMiniSlot("norm", (6,), 6, chunked_pieces(6, 2, 0), 6),
             AdamMiniSlot("w", (4, 5), 20, chunked_pieces(20, 2, 3), 5)]
    for rank, want in ((0, [("norm[0]", 3), ("w[0]", 5), ("w[1]", 5)]), (1, [("norm[0]", 3), ("w[2]", 5), ("w[3]", 5)])):
        bm = build_block_map(slots, rank, 13, block_numel=lambda s: s.block)
        assert [(bm.block_names[b], n) for b, n in zip(bm.block_of_segment, bm.lengths)] == want


def test_config_errors_name_the_key() -> None:
    from ds_muon.config import ConfigError, parse_adam_mini_params
    from ds_muon.integration.validation import validate as validate_adam_mini_config
    with pytest.raises(ConfigError, match=r"optimizer.params.betaz: unknown key.*did you mean 'betas'"):
        parse_adam_mini_params({"betaz": [0.9, 0.9]})
    with pytest.raises(ConfigError, match=r"optimizer.params.block_rule: 'rows' is invalid.*'default', 'neuron'"):
        parse_adam_mini_params({"block_rule": "rows"})
    for bad, match in (({"lr": -1e-3}, r"optimizer.params.lr: -0.001 is invalid"),
                       ({"lr": "3e-4"}, r"optimizer.params.lr: '3e-4' is invalid"),
                       ({"betas": [0.9, 1.5]}, r"optimizer.params.betas\[1\]: 1.5 is invalid.*allowed: a pair"),
                       ({"betas": [0.9]}, r"optimizer.params.betas.*Field required.*allowed: a pair"),
                       ({"eps": -1.0}, r"optimizer.params.eps: -1.0 is invalid"),
                       ({"weight_decay": -0.1}, r"optimizer.params.weight_decay: -0.1 is invalid.*allowed: a number >= 0")):
        with pytest.raises(ConfigError, match=match):
            parse_adam_mini_params(bad)
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: 0 is invalid.*stages 1, 2 and 3"):
        validate_adam_mini_config({"optimizer": {"type": "AdamMini"}, "zero_optimization": {"stage": 0}})
    assert validate_adam_mini_config({"optimizer": {"type": "AdamW"}}) is None
    base = {"optimizer": {"type": "AdamMini"}, "zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match=r"zero_optimization.zenflow: is not supported"):
        validate_adam_mini_config(dict(base, zero_optimization={"stage": 3, "zenflow": {"topk_ratio": 0.1}}))
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size: 2 is not served by ds_muon's AdamMini.*set autotp_size to 1"):
        validate_adam_mini_config(dict(base, tensor_parallel={"autotp_size": 2}))
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.device: 'nvme' \(parameter offload "
                                          r"to NVMe\) is not supported by ds_muon yet"):
        validate_adam_mini_config(dict(base, zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}))


def test_zero_d_parameter_is_refused_before_the_engine() -> None:
    """The AdamMini path checks parameters as the Muon path does: a 0-D trainable parameter is named."""
    import types

    from ds_muon.integration import hooks as integration
    model = torch.nn.Module()
    model.temperature = torch.nn.Parameter(torch.tensor(1.0))
    cfg = types.SimpleNamespace(_param_dict={"optimizer": {"type": "AdamMini", "params": {"lr": 1e-3}},
                                             "zero_optimization": {"stage": 3}})
    with pytest.raises(Exception, match=r"temperature.*0-D"):
        integration._set_optimizer_flags(cfg, model)
