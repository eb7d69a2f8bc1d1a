"""attn_implementation="ds_muon_sdpa" on real transformers models (tiny configs, no download).

Per model: the same weights under "sdpa" and "ds_muon_sdpa" give identical logits, loss and
gradients on a left-padded batch and on an unpadded one, and the recorded per-head max logits
equal a brute-force computation from the query and key the attention function received (after
q/k norm and RoPE), captured on their way into transformers' own SDPA function, at the model's own
softmax scale (Granite's ``attention_multiplier`` is not ``head_dim ** -0.5``). A direct call with
``scaling=0.3`` records ``q.k * 0.3`` and returns SDPA's output at that scale.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ds_muon  # noqa: E402
from ds_muon.model import hf_attention as attention  # noqa: E402
from ds_muon.model.max_logits import RECORDER  # noqa: E402
from tests.unit.test_max_logits import brute_force, causal  # noqa: E402
from tests.support.tools import REPO  # noqa: E402

def tiny(cfg_cls, **kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return cfg_cls(**{**base, **kw})


CONFIGS = {
    "llama-gqa": lambda: tiny(transformers.LlamaConfig),
    "qwen2": lambda: tiny(transformers.Qwen2Config, num_key_value_heads=4),
    "qwen3-qk-norm": lambda: tiny(transformers.Qwen3Config),
    "qwen3-moe": lambda: tiny(transformers.Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, num_attention_heads=8, num_key_value_heads=2, head_dim=4),
    # the softmax scale is attention_multiplier, not head_dim ** -0.5 (0.354 here)
    "granite-attention-multiplier": lambda: tiny(transformers.GraniteConfig, attention_multiplier=0.3),
}
#: the softmax scale each model's attention must record its logits at (``module.scaling``)
SCALING = {"granite-attention-multiplier": 0.3}


@pytest.fixture
def captured(monkeypatch):
    """Every call into transformers' sdpa_attention_forward made by ds_muon_sdpa: (module, query, key, mask)."""
    calls = []
    real = attention.sdpa_attention_forward

    def spy(module, query, key, value, attention_mask, **kw):
        calls.append((module, query.detach().clone(), key.detach().clone(), attention_mask))
        return real(module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    return calls


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_as_sdpa_and_records_exact_max_logits(name, captured):
    ds_muon.register_attention()
    cfg = CONFIGS[name]()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    mine = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="ds_muon_sdpa")
    mine.load_state_dict(ref.state_dict())  # (one config object each: from_config sets its attn implementation)
    assert ref.config._attn_implementation == "sdpa" and mine.config._attn_implementation == "ds_muon_sdpa"
    ref.train(), mine.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (3, 12), generator=g)
    padded = torch.ones(3, 12, dtype=torch.long)
    padded[1, :4] = 0                                   # left padding, as for generation-style batches
    padded[2, :9] = 0
    attentions = [layer.self_attn for layer in mine.model.layers]
    scaling = SCALING.get(name, cfg.head_dim ** -0.5)
    assert all(a.scaling == scaling for a in attentions), (name, [a.scaling for a in attentions])
    for mask in (padded, None):
        RECORDER.clear()
        captured.clear()
        labels = ids.masked_fill(padded == 0, -100) if mask is not None else ids
        out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
        out = mine(input_ids=ids, attention_mask=mask, labels=labels)
        assert torch.equal(out.logits, out_ref.logits) and torch.equal(out.loss, out_ref.loss)
        out_ref.loss.backward()
        out.loss.backward()
        for (n, p), p_ref in zip(mine.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, p_ref.grad), n
        mine.zero_grad(), ref.zero_grad()
        assert [id(c[0]) for c in captured] == [id(a) for a in attentions]  # only ds_muon_sdpa's calls
        for module, q, k, m in captured:
            if mask is None:
                assert m is None                        # transformers skips the mask: SDPA's is_causal
                want = brute_force(q, k, scaling, causal(12, 12))
            else:
                assert m is not None and m.dtype == torch.bool and not m[2, 0, :9].any()  # padded rows: none
                want = brute_force(q, k, scaling, m)
                assert not torch.equal(want, brute_force(q, k, scaling, causal(12, 12)))
            got = RECORDER.take(module)
            assert got is not None and got.shape == (cfg.num_attention_heads,)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # matmul summation order only
    # evaluation and no-grad forwards record nothing
    with torch.no_grad():
        mine(input_ids=ids, attention_mask=padded)
    mine.eval()
    mine(input_ids=ids, attention_mask=padded)
    assert all(RECORDER.take(a) is None for a in attentions)


def test_direct_call_records_at_the_given_scaling():
    """``ds_muon_sdpa(module, q, k, v, mask, scaling=0.3)`` (GQA 6/2): the output is SDPA's at scale 0.3 and the
    recorded max logits are ``q.k * 0.3`` brute force, causal (no mask) and with a left-padding mask; they are
    not the ``head_dim ** -0.5`` ones. ``scaling=None`` records at ``head_dim ** -0.5``, as SDPA scales."""
    from tests.unit.test_max_logits import left_padding, qk
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    module.train()
    q, k = qk(B=3, H=6, Hkv=2, Sq=10, Sk=10, D=8)
    v = torch.randn(3, 2, 10, 8, generator=torch.Generator().manual_seed(2))
    default = 8 ** -0.5
    for mask, allowed in ((None, causal(10, 10)), (left_padding(3, 10, [0, 3, 7]),) * 2):
        for scaling in (0.3, None):
            RECORDER.clear()
            out, _ = attention.ds_muon_sdpa(module, q, k, v, mask, scaling=scaling)
            want_out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, is_causal=mask is None,
                scale=scaling).transpose(1, 2)
            torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6, equal_nan=True)  # padded rows
            got = RECORDER.take(module)
            want = brute_force(q, k, default if scaling is None else scaling, allowed)
            assert torch.equal(got, want), (scaling, mask is None, got, want)
        assert not torch.equal(brute_force(q, k, 0.3, allowed), brute_force(q, k, default, allowed))


def test_enable_registers_when_transformers_is_imported():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionInterface._global_mapping.pop("ds_muon_sdpa", None)
    AttentionMaskInterface._global_mapping.pop("ds_muon_sdpa", None)
    ds_muon.enable()
    ds_muon.disable()
    assert transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["ds_muon_sdpa"] is attention.ds_muon_sdpa
    assert "ds_muon_sdpa" in ALL_MASK_ATTENTION_FUNCTIONS


@pytest.mark.parametrize("first_import", ["from transformers import LlamaConfig, LlamaForCausalLM",
                                          "import transformers.masking_utils", "from transformers import Trainer"])
def test_enable_before_transformers_registers_at_its_import(first_import):
    """``ds_muon.enable()`` before transformers is imported (the start-up hook's case: ``import deepspeed`` runs
    it) imports no transformers, and ``ds_muon_sdpa`` is registered once transformers' modeling code loads,
    whichever transformers module the script imports first; a model then builds with it (fresh interpreter)."""
    import os
    import subprocess
    import sys
    code = (
        "import sys, ds_muon; ds_muon.enable(); assert 'transformers' not in sys.modules, 'enable imported it'\n"
        f"{first_import}\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as M\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as A\n"
        "from ds_muon.model.hf_attention import ds_muon_sdpa\n"
        "assert A['ds_muon_sdpa'] is ds_muon_sdpa and 'ds_muon_sdpa' in M, 'not registered'\n"
        "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,\n"
        "                  num_attention_heads=4, num_key_value_heads=2)\n"
        "m = LlamaForCausalLM._from_config(cfg, attn_implementation='ds_muon_sdpa')\n"
        "assert m.config._attn_implementation == 'ds_muon_sdpa'; print('OK')\n")
    repo = REPO
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(repo)))
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
