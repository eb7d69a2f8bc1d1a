"""Tests for ds_muon.model.selection: which parameters Muon trains (docs/design.md, "Selection")."""
from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from ds_muon.model import selection
from ds_muon.model.structure import param_numel, param_shape
from ds_muon.model.selection import SelectionRules, select_muon_params, tag_model


def split(sel) -> tuple[set[str], set[str]]:
    muon = {n for n, u in sel.use_muon.items() if u}
    return muon, set(sel.use_muon) - muon


# ------------------------------------------------------------------------------------------------
# GPT-2 style, with a hand-written HF-style Conv1D (weight (in, out))
# ------------------------------------------------------------------------------------------------
class Conv1D(nn.Module):
    """Same layout as transformers.pytorch_utils.Conv1D: y = x @ W + b with W of shape (nx, nf)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class GPT2Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)


class GPT2MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * d, d)
        self.c_proj = Conv1D(d, 4 * d)


class GPT2Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = GPT2Attention(d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GPT2MLP(d)


class GPT2Model(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.h = nn.ModuleList(GPT2Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, vocab: int = 50, ctx: int = 16, d: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.transformer = GPT2Model(vocab, ctx, d, layers)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in HF

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def test_gpt2_conv1d_to_muon_rest_to_adamw():
    model = GPT2LMHeadModel(layers=2)
    sel = select_muon_params(model)
    muon, adamw = split(sel)
    expected_muon = {f"transformer.h.{i}.{m}.weight" for i in range(2)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert muon == expected_muon
    # tied lm_head appears once, under the embedding's name
    assert "lm_head.weight" not in sel.use_muon
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
            "transformer.ln_f.bias", "transformer.h.0.attn.c_attn.bias", "transformer.h.1.mlp.c_proj.bias",
            "transformer.h.1.ln_2.weight"} <= adamw
    assert len(sel.use_muon) == len(list(model.named_parameters()))
    assert sel.reasons["transformer.wte.weight"] == selection.EMBEDDING
    assert sel.reasons["transformer.wpe.weight"] == selection.EMBEDDING
    assert sel.reasons["transformer.h.0.attn.c_attn.weight"] == selection.HIDDEN_MATRIX
    assert sel.reasons["transformer.h.0.ln_1.weight"] == selection.LOW_DIM
    assert sel.reasons["transformer.h.0.mlp.c_fc.bias"] == selection.LOW_DIM
    # Conv1D weights are (in, out): shape is irrelevant to the rule
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (8, 32)


# ------------------------------------------------------------------------------------------------
# Llama style, untied head found through get_output_embeddings()
# ------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class LlamaAttention(nn.Module):
    def __init__(self, d: int, kv: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)


class LlamaMLP(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)


class LlamaLayer(nn.Module):
    def __init__(self, d: int, kv: int, f: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(d, kv)
        self.mlp = LlamaMLP(d, f)
        self.input_layernorm = RMSNorm(d)
        self.post_attention_layernorm = RMSNorm(d)


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, d: int, kv: int, f: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d, kv, f) for _ in range(layers))
        self.norm = RMSNorm(d)


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, kv: int = 8, f: int = 24, layers: int = 2) -> None:
        super().__init__()
        self.model = LlamaModel(vocab, d, kv, f, layers)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_llama_projections_muon_head_and_norms_adamw():
    model = LlamaForCausalLM(layers=3)
    sel = select_muon_params(model)
    muon, adamw = split(sel)
    assert muon == {f"model.layers.{i}.{m}.weight" for i in range(3) for m in PROJ}
    assert adamw == ({"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
                     | {f"model.layers.{i}.{n}.weight" for i in range(3)
                        for n in ("input_layernorm", "post_attention_layernorm")})
    assert sel.reasons["lm_head.weight"] == selection.OUTPUT_HEAD
    assert sel.reasons["model.embed_tokens.weight"] == selection.EMBEDDING
    assert sel.reasons["model.norm.weight"] == selection.LOW_DIM


def test_output_head_from_get_output_embeddings_is_adamw_even_if_not_last():
    """The head get_output_embeddings() returns is AdamW wherever it is registered."""

    class HeadFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(8, 30, bias=False)
            self.body = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 8), nn.Linear(8, 8))

        def get_output_embeddings(self) -> nn.Module:
            return self.out

    sel = select_muon_params(HeadFirst())
    assert sel.use_muon["out.weight"] is False
    assert sel.reasons["out.weight"] == selection.OUTPUT_HEAD
    assert sel.use_muon["body.1.weight"] is True


def test_get_output_embeddings_raising_is_tolerated():
    class NoHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.fc = nn.Linear(8, 3)

        def get_output_embeddings(self):
            raise NotImplementedError

    sel = select_muon_params(NoHead())
    assert split(sel)[0] == {"a.weight", "b.weight"}


# ------------------------------------------------------------------------------------------------
# classification heads, conv nets
# ------------------------------------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(20, d)
        self.layer = nn.ModuleList(nn.ModuleDict({"dense": nn.Linear(d, d), "norm": nn.LayerNorm(d)})
                                   for _ in range(2))
        self.pooler = nn.Linear(d, d)


class ForSequenceClassification(nn.Module):
    def __init__(self, head_name: str, d: int = 12, labels: int = 3, bias: bool = True) -> None:
        super().__init__()
        self.encoder = Encoder(d)
        setattr(self, head_name, nn.Linear(d, labels, bias=bias))


@pytest.mark.parametrize("head", ["classifier", "score"])
def test_classification_head_is_adamw(head):
    model = ForSequenceClassification(head, bias=(head == "classifier"))
    sel = select_muon_params(model)
    muon, adamw = split(sel)
    assert muon == {"encoder.layer.0.dense.weight", "encoder.layer.1.dense.weight", "encoder.pooler.weight"}
    assert f"{head}.weight" in adamw
    assert sel.reasons[f"{head}.weight"] == selection.OUTPUT_HEAD
    if head == "classifier":
        assert sel.use_muon["classifier.bias"] is False


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, bias=False)
        self.conv3 = nn.Conv1d(16, 16, 3)
        self.fc = nn.Linear(16, 10)


def test_conv_net_convs_muon_fc_adamw():
    sel = select_muon_params(ConvNet())
    muon, adamw = split(sel)
    assert muon == {"conv1.weight", "conv2.weight", "conv3.weight"}
    assert adamw == {"conv1.bias", "bn1.weight", "bn1.bias", "conv3.bias", "fc.weight", "fc.bias"}
    assert sel.reasons["fc.weight"] == selection.OUTPUT_HEAD


def test_unrecognised_2d_param_is_adamw_and_noted():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Parameter(torch.randn(6, 6))
            self.a = nn.Linear(6, 6)
            self.head = nn.Linear(6, 2)

    sel = select_muon_params(Odd())
    assert sel.use_muon["mix"] is False and sel.reasons["mix"] == selection.UNRECOGNISED
    assert "mix" in sel.summary() and "use_muon=True" in sel.summary()


# ------------------------------------------------------------------------------------------------
# ZeRO-3 shapes
# ------------------------------------------------------------------------------------------------
def test_param_shape_reads_ds_shape():
    t = nn.Parameter(torch.empty(0))
    assert param_shape(t) == (0,) and param_numel(t) == 0
    t.ds_shape = torch.Size([4, 5])
    t.ds_numel = 20
    assert param_shape(t) == (4, 5)
    assert param_numel(t) == 20
    plain = torch.empty(3, 7)
    assert param_shape(plain) == (3, 7) and param_numel(plain) == 21


def test_selection_uses_ds_shape_of_flat_placeholders():
    # what deepspeed.zero.Init leaves behind: 1-D (empty) tensors with ds_shape / ds_numel
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 10))
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            flat = nn.Parameter(torch.empty(0))
            flat.ds_shape, flat.ds_numel = p.shape, p.numel()
            setattr(module, name, flat)
    sel = select_muon_params(model)
    assert all(p.ndim == 1 for p in model.parameters())
    assert split(sel)[0] == {"1.weight", "3.weight"}
    assert sel.numels["1.weight"] == 36 and sel.numels["4.weight"] == 60
    assert sel.reasons["4.weight"] == selection.OUTPUT_HEAD
    assert sel.reasons["0.weight"] == selection.EMBEDDING


# ------------------------------------------------------------------------------------------------
# precedence
# ------------------------------------------------------------------------------------------------
def test_explicit_false_on_hidden_weight_wins():
    model = LlamaForCausalLM(layers=1)
    model.model.layers[0].self_attn.q_proj.weight.use_muon = False
    sel = select_muon_params(model)
    assert sel.use_muon["model.layers.0.self_attn.q_proj.weight"] is False
    assert sel.reasons["model.layers.0.self_attn.q_proj.weight"] == selection.EXPLICIT
    # explicit beats patterns too
    sel = select_muon_params(model, SelectionRules.of(muon_patterns=["*q_proj.weight"]))
    assert sel.use_muon["model.layers.0.self_attn.q_proj.weight"] is False


def test_explicit_true_on_3d_raw_parameter():
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_in = nn.Parameter(torch.randn(4, 8, 16))
            self.w_out = nn.Parameter(torch.randn(4, 16, 8))
            self.gate = nn.Linear(8, 4)
            self.head = nn.Linear(8, 3)

    model = Experts()
    assert select_muon_params(model).use_muon["w_in"] is False  # unrecognised module -> AdamW
    model.w_in.use_muon = True
    sel = select_muon_params(model)
    assert sel.use_muon["w_in"] is True and sel.reasons["w_in"] == selection.EXPLICIT
    assert sel.use_muon["w_out"] is False
    assert sel.numels["w_in"] == 4 * 8 * 16


def test_config_patterns_and_adamw_wins():
    model = LlamaForCausalLM(layers=2)
    sel = select_muon_params(model, SelectionRules.of(muon_patterns=["lm_head.weight", "*.mlp.*"], adamw_patterns=["*.mlp.down_proj.weight", "*.layers.1.*"]))
    assert sel.use_muon["lm_head.weight"] is True and sel.reasons["lm_head.weight"] == selection.PATTERN
    assert sel.use_muon["model.layers.0.mlp.gate_proj.weight"] is True
    # matched by both: AdamW
    assert sel.use_muon["model.layers.0.mlp.down_proj.weight"] is False
    assert sel.reasons["model.layers.0.mlp.down_proj.weight"] == selection.PATTERN
    assert sel.use_muon["model.layers.1.mlp.up_proj.weight"] is False
    assert sel.use_muon["model.layers.1.self_attn.q_proj.weight"] is False
    # untouched by patterns: the rule
    assert sel.use_muon["model.layers.0.self_attn.q_proj.weight"] is True
    assert sel.reasons["model.layers.0.self_attn.q_proj.weight"] == selection.HIDDEN_MATRIX
    # patterns are case-sensitive globs
    assert select_muon_params(model, SelectionRules.of(adamw_patterns=["*Q_PROJ*"])).use_muon[
        "model.layers.0.self_attn.q_proj.weight"] is True


def test_pattern_selecting_1d_param_raises_naming_it():
    model = LlamaForCausalLM(layers=1)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        select_muon_params(model, SelectionRules.of(muon_patterns=["model.norm.weight"]))
    model2 = LlamaForCausalLM(layers=1)
    model2.model.norm.weight.use_muon = True
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*use_muon=False"):
        select_muon_params(model2)


def test_tag_model_writes_and_redecides_auto_params():
    model = ForSequenceClassification("classifier")
    model.encoder.pooler.weight.use_muon = False  # explicit user tag
    sel = tag_model(model, log=False)
    enc = model.encoder
    assert enc.layer[0].dense.weight.use_muon is True and enc.layer[0].dense.weight._ds_muon_auto is True
    assert model.classifier.weight.use_muon is False and model.classifier.weight._ds_muon_auto is False
    assert enc.layer[0].norm.bias.use_muon is False
    assert enc.pooler.weight.use_muon is False and not getattr(enc.pooler.weight, "_ds_muon_auto", False)
    assert sel.reasons["encoder.pooler.weight"] == selection.EXPLICIT
    assert all(hasattr(p, "use_muon") for p in model.parameters())

    sel2 = tag_model(model, SelectionRules.of(muon_patterns=["classifier.weight"], adamw_patterns=["encoder.layer.0.*"]), log=False)
    assert model.classifier.weight.use_muon is True and sel2.reasons["classifier.weight"] == selection.PATTERN
    assert enc.layer[0].dense.weight.use_muon is False
    assert enc.layer[1].dense.weight.use_muon is True
    assert enc.pooler.weight.use_muon is False and sel2.reasons["encoder.pooler.weight"] == selection.EXPLICIT

    # a third call with no patterns goes back to the rule
    tag_model(model, log=False)
    assert model.classifier.weight.use_muon is False and enc.layer[0].dense.weight.use_muon is True


def test_summary_counts_and_elements():
    model = LlamaForCausalLM(vocab=40, d=16, kv=8, f=24, layers=2)
    sel = select_muon_params(model)
    text = sel.summary()
    per_layer_muon = 16 * 16 * 2 + 8 * 16 * 2 + 24 * 16 * 3
    muon_elems = 2 * per_layer_muon
    adamw_elems = 40 * 16 * 2 + 16 + 2 * 2 * 16
    m = re.search(r"Muon\s+(\d+) params\s+([\d,]+) elements", text)
    a = re.search(r"AdamW\s+(\d+) params\s+([\d,]+) elements", text)
    assert m and a, text
    assert int(m.group(1)) == 14 and int(m.group(2).replace(",", "")) == muon_elems
    assert int(a.group(1)) == 3 + 4 and int(a.group(2).replace(",", "")) == adamw_elems
    assert f"{muon_elems:,d}" in text and f"{adamw_elems:,d}" in text
    assert selection.OUTPUT_HEAD in text and selection.EMBEDDING in text and selection.HIDDEN_MATRIX in text
    assert muon_elems + adamw_elems == sum(p.numel() for p in model.parameters())
    assert len(text.splitlines()) < 25


def test_tag_model_logs_summary_and_pure_adamw_warning(caplog):
    with caplog.at_level(logging.INFO, logger="ds_muon"):
        tag_model(LlamaForCausalLM(layers=1))
    assert any("ds_muon parameter split" in r.getMessage() for r in caplog.records)
    assert not any(r.levelno == logging.WARNING for r in caplog.records)

    caplog.clear()
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))
    with caplog.at_level(logging.INFO, logger="ds_muon"):
        tag_model(model)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "ds_muon"]
    assert len(warnings) == 1 and "pure AdamW" in warnings[0].getMessage()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_muon"):
        tag_model(model, log=False)
    assert not caplog.records


def test_user_change_after_tag_model_counts_as_explicit():
    model = ForSequenceClassification("classifier")
    tag_model(model, log=False)
    dense = model.encoder.layer[0].dense.weight
    assert dense.use_muon is True
    dense.use_muon = False  # the user overrides the rule's decision after tagging
    sel = tag_model(model, log=False)
    assert dense.use_muon is False and sel.reasons["encoder.layer.0.dense.weight"] == selection.EXPLICIT


# ------------------------------------------------------------------------------------------------
# output heads of real Hugging Face models and of wrappers around them (transformers from a config)
# ------------------------------------------------------------------------------------------------
def _llama_config(**kw):
    transformers = pytest.importorskip("transformers")
    # intermediate_size == vocab_size: gate/up map to a vocabulary-sized width inside the layers, but
    # down_proj consumes it, so they stay hidden matrices
    args = dict(vocab_size=96, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    args.update(kw)
    return transformers.LlamaConfig(**args)


def _llama_hidden(prefix: str, layers: int = 2) -> set[str]:
    return {f"{prefix}layers.{i}.{m}.weight" for i in range(layers) for m in PROJ}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama_causal_lm_head_is_adamw(tied):
    from transformers import LlamaForCausalLM as HFLlama
    model = HFLlama(_llama_config(tie_word_embeddings=tied))
    sel = select_muon_params(model)
    muon, adamw = split(sel)
    assert muon == _llama_hidden("model.")
    if tied:
        assert "lm_head.weight" not in sel.use_muon and sel.reasons["model.embed_tokens.weight"] == selection.EMBEDDING
    else:
        assert sel.reasons["lm_head.weight"] == selection.OUTPUT_HEAD
    assert not sel.notes, sel.notes


def test_hf_sequence_classification_score_is_adamw():
    from transformers import LlamaForSequenceClassification
    model = LlamaForSequenceClassification(_llama_config(num_labels=5))
    assert model.get_output_embeddings() is None  # nothing declared: found from num_labels
    sel = select_muon_params(model)
    assert split(sel)[0] == _llama_hidden("model.")
    assert sel.use_muon["score.weight"] is False and sel.reasons["score.weight"] == selection.OUTPUT_HEAD
    assert not sel.notes, sel.notes


class ValueHead(nn.Module):
    """TRL's AutoModelForCausalLMWithValueHead's head: dropout, then Linear(hidden, 1)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.summary = nn.Linear(d, 1)


def test_ppo_value_head_wrapper_both_heads_adamw():
    """A TRL-style wrapper with no get_output_embeddings of its own: the inner model declares lm_head,
    and the value head maps the hidden size to one value."""
    from transformers import LlamaForCausalLM as HFLlama

    class WithValueHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pretrained_model = HFLlama(_llama_config())
            self.v_head = ValueHead(32)

    sel = select_muon_params(WithValueHead())
    muon, adamw = split(sel)
    assert muon == _llama_hidden("pretrained_model.model.")
    for head in ("pretrained_model.lm_head.weight", "v_head.summary.weight"):
        assert sel.reasons[head] == selection.OUTPUT_HEAD, head
    assert not sel.notes, sel.notes


def test_untied_lm_head_then_value_head_without_declaration_or_config():
    """The case the old 'last linear is the head' rule got wrong: lm_head went to Muon."""

    class PolicyAndValue(nn.Module):
        def __init__(self, vocab: int = 50, d: int = 16) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(LlamaLayer(d, 8, 24) for _ in range(2))
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.value_head = nn.Linear(d, 1)

    sel = select_muon_params(PolicyAndValue())
    assert sel.reasons["lm_head.weight"] == selection.OUTPUT_HEAD
    assert sel.reasons["value_head.weight"] == selection.OUTPUT_HEAD
    assert split(sel)[0] == {f"blocks.{i}.{m}.weight" for i in range(2) for m in PROJ}
    assert not sel.notes, sel.notes


def test_mtp_head_and_parallel_heads_adamw_with_declared_lm_head():
    """A model declaring get_output_embeddings() (lm_head) with a multi-token-prediction module
    (its own projection and decoder layer, hidden, and its own Linear(D, V) head) and Medusa-style
    parallel heads: every vocabulary-sized head is AdamW, the MTP's hidden matrices Muon."""
    from transformers import LlamaModel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = _llama_config()

    class MTP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
            self.block = LlamaDecoderLayer(cfg, layer_idx=cfg.num_hidden_layers)
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    class WithMTP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = cfg
            self.model = LlamaModel(cfg)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.mtp = MTP()
            self.medusa = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(3))

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

    sel = select_muon_params(WithMTP())
    muon, adamw = split(sel)
    assert muon == (_llama_hidden("model.") | {"mtp.proj.weight"}
                    | {f"mtp.block.{m}.weight" for m in PROJ})
    for head in ["lm_head.weight", "mtp.head.weight"] + [f"medusa.{i}.weight" for i in range(3)]:
        assert sel.reasons[head] == selection.OUTPUT_HEAD, head
    assert not sel.notes, sel.notes


def test_summary_says_when_the_head_was_guessed_or_unclear():
    class MLP(nn.Module):  # no config, no embedding: nothing tells the output width
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(20, 32)
            self.fc2 = nn.Linear(32, 10)

    sel = select_muon_params(MLP())
    assert sel.use_muon == {"fc1.weight": True, "fc1.bias": False, "fc2.weight": False, "fc2.bias": False}
    assert "took the last matrix" in sel.summary() and "['fc2']" in sel.summary()

    class TwoOutputs(nn.Module):  # lm_head found; aux maps the hidden size to 10: a head or not?
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.mid = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 50)
            self.aux = nn.Linear(16, 10)

    sel = select_muon_params(TwoOutputs())
    assert sel.reasons["lm_head.weight"] == selection.OUTPUT_HEAD and sel.use_muon["aux.weight"] is True
    assert "could not tell" in sel.summary() and "'aux'" in sel.summary()


def test_narrow_matrix_read_by_a_sibling_is_not_a_head():
    """A bottleneck outside the repeated layers, ``down = Linear(D, 2)`` then ``up = Linear(2, D)``: ``down`` maps
    the hidden size to a head's width (2 <= num_labels), but its sibling ``up`` reads that output, so it is a
    hidden matrix: Muon, and the summary says it could not tell (the rule's "no sibling consumes its output")."""

    class Bottleneck(nn.Module):
        def __init__(self, vocab: int = 50, d: int = 16) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(LlamaLayer(d, 8, 24) for _ in range(2))
            self.down = nn.Linear(d, 2)
            self.up = nn.Linear(2, d)
            self.lm_head = nn.Linear(d, vocab, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

    sel = select_muon_params(Bottleneck())
    muon, _ = split(sel)
    assert muon == {f"blocks.{i}.{m}.weight" for i in range(2) for m in PROJ} | {"down.weight", "up.weight"}, muon
    assert sel.reasons["down.weight"] == sel.reasons["blocks.0.mlp.up_proj.weight"] != selection.OUTPUT_HEAD
    assert sel.reasons["lm_head.weight"] == selection.OUTPUT_HEAD
    summary = sel.summary()
    assert "could not tell whether ['down']" in summary, summary
    assert "'up'" not in summary, summary  # its input is no hidden size: not a head candidate at all


def test_hf_gpt2_fused_qkv_with_vocabulary_width_is_hidden():
    """Inside the repeated layers nothing is a head: a tiny GPT-2 whose c_attn (D -> 3D) happens to
    be vocabulary-wide (vocab_size = 3D) still trains c_attn with Muon."""
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96,
                                                                 bos_token_id=0, eos_token_id=0))
    sel = select_muon_params(model)
    assert split(sel)[0] == {f"transformer.h.{i}.{m}.weight" for i in range(2)
                             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert "lm_head.weight" not in sel.use_muon  # tied to wte
    assert not sel.notes, sel.notes


def _tiny_hf(kind: str, layers: int):
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        return transformers.LlamaForCausalLM(_llama_config(num_hidden_layers=layers))
    if kind == "qwen3-moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    # hybrid stack: a Mamba layer then an attention layer (two layer classes in one ModuleList)
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100,
        expert_layer_offset=99, num_experts=1, mamba_d_state=4, mamba_expand=2))


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_hf_one_layer_model_classified_as_with_two_layers(kind):
    """A 1-layer model's list of one decoder layer is the repeated layers too (its length is the
    config's num_hidden_layers): k_proj/v_proj (hidden -> kv width) are hidden matrices, not possible
    heads, and every parameter gets the reason its layer-0 twin gets in the 2-layer model, with no note."""
    one, two = select_muon_params(_tiny_hf(kind, 1)), select_muon_params(_tiny_hf(kind, 2))
    assert not one.notes, one.notes
    assert not two.notes, two.notes
    assert one.reasons == {n: r for n, r in two.reasons.items() if ".layers.1." not in n}
    assert one.use_muon == {n: u for n, u in two.use_muon.items() if ".layers.1." not in n}
    assert one.reasons["model.layers.0.self_attn.k_proj.weight"] == selection.HIDDEN_MATRIX
    assert one.reasons["lm_head.weight"] == selection.OUTPUT_HEAD
    if kind == "qwen3-moe":
        assert one.reasons["model.layers.0.mlp.experts.gate_up_proj"] == selection.EXPERTS
        assert one.reasons["model.layers.0.mlp.gate.weight"] == selection.ROUTER


def test_hf_hybrid_layer_classes_are_repeated_layers():
    """Jamba's layers are of two classes (Mamba, attention), one of each: neither is taken for a
    head's surroundings; the Mamba in_proj and attention k/v projections are hidden matrices."""
    sel = select_muon_params(_tiny_hf("jamba", 2))
    assert not sel.notes, sel.notes
    for name in ("model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.out_proj.weight",
                 "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
        assert sel.reasons[name] == selection.HIDDEN_MATRIX, name
    assert sel.reasons["lm_head.weight"] == selection.OUTPUT_HEAD
