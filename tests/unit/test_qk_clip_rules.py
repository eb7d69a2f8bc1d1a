"""QK-clip (MuonClip, Kimi K2 arXiv 2507.20534 §2.1) on one process: the rule, the weights it finds, the oracle.

The attention of every test model records its exact per-head max logits brute force
(:mod:`tests.support.qk_models`), so the clip acts on real logits. Thresholds are chosen inside the range of
the models' logits (4-11), so some heads clip and some do not (asserted).

* Rule: :func:`ds_muon.core.qk_clip.clip_factors` against a per-head loop written from the paper's
  formulas (GQA: a key head takes the largest logit of its query heads), several alphas.
* Plan: :func:`ds_muon.sharded.qk_clip.local_span` of every head span against a brute-force head map of every
  element, W = 1..4, for a weight, a fused QKV's key block and a bias.
* Oracle (``ds_muon.MuonAdamW`` with a learning rate of 1e-9, so the clip alone moves the weights): each
  head's query rows are scaled by exactly gamma^alpha and its key rows by gamma_kv^(1-alpha), computed
  here from the recorded logits; recomputed on the same batch (one-layer models, so the inputs of the
  attention do not change), every clipped head's max logit is <= tau, and == tau without GQA
  (relative 1e-5), biases included (Qwen2).

ZeRO-3 parity is tests/dist/test_qk_clip.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.models import batch
from tests.support.tools import repo_module

transformers = pytest.importorskip("transformers")

from tests.support.qk_models import DeclaredNet, brute_max_logits, llama_gqa, phi3_fused, qwen2_bias  # noqa: E402

TAU = 6.0


# ------------------------------------------------------------------------------------------------
# rule and plan (no process group)
# ------------------------------------------------------------------------------------------------
def _expected_factors(s: list[float], nkv: int, tau: float, alpha: float):
    """The rule per head, written out: gamma = tau/S if S > tau else 1; a key head uses its query heads' max."""
    group = len(s) // nkv
    q = [(tau / x if x > tau else 1.0) ** alpha for x in s]
    k = []
    for g in range(nkv):
        m = max(s[g * group:(g + 1) * group])
        k.append((tau / m if m > tau else 1.0) ** (1 - alpha))
    return q, k


@pytest.mark.parametrize("nkv", [1, 2, 3, 6])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_rule_matches_the_paper_per_head(nkv, alpha):
    from ds_muon.core.qk_clip import clip_factors
    s = [3.0, 12.0, 7.0, 6.0, 25.0, float("-inf")]
    q, k = clip_factors(torch.tensor(s), nkv, 6.5, alpha)
    want_q, want_k = _expected_factors(s, nkv, 6.5, alpha)
    torch.testing.assert_close(q, torch.tensor(want_q), rtol=1e-6, atol=0)
    torch.testing.assert_close(k, torch.tensor(want_k), rtol=1e-6, atol=0)


def test_rule_leaves_non_finite_and_small_logits_alone():
    from ds_muon.core.qk_clip import clip_factors
    q, k = clip_factors(torch.tensor([float("nan"), float("inf"), 1.0, float("-inf")]), 4, 2.0, 0.5)
    assert q.tolist() == [1.0] * 4 and k.tolist() == [1.0] * 4


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_local_head_ranges_cover_each_head_exactly(world_size):
    """Every element of a head's rows lies in exactly one rank's range of that head, for ZeRO-3's chunks and for
    ZeRO-1/2's flat pieces (:func:`ds_muon.sharded.qk_clip.local_span` over the spans of
    :meth:`ds_muon.model.attention.HeadRows.head_span`)."""
    from ds_muon.model.attention import HeadRows
    from ds_muon.partitions import chunked_pieces, flat_pieces
    from ds_muon.sharded.qk_clip import local_span

    def local_head_ranges(hr, piece):
        return [(part[0], part[1], h) for h in range(hr.num_heads)
                if (part := local_span(*hr.head_span(h), piece)) is not None]
    for rows, cols, start, hd, heads in ((24, 7, 0, 6, 4), (40, 5, 16, 4, 2), (24, 1, 0, 6, 4), (9, 3, 3, 3, 2)):
        hr = HeadRows(None, "p", start, hd, heads, cols)
        numel = rows * cols
        want = torch.full((numel,), -1)
        for h in range(heads):
            want[(start + h * hd) * cols:(start + (h + 1) * hd) * cols] = h
        # ZeRO-3: every chunk at shard offset 5; ZeRO-1/2: the parameter at flat offset 7 of partitions that hold
        # it and 3 more elements of padding
        partition = -(-(7 + numel + 3) // world_size)
        for pieces in (chunked_pieces(numel, world_size, 5), flat_pieces(7, numel, partition, world_size)):
            got = torch.full((numel,), -1)
            for piece in pieces:
                for offset, n, h in local_head_ranges(hr, piece):
                    lo = piece.start + offset - piece.shard_offset  # in the parameter
                    assert piece.shard_offset <= offset and offset + n <= piece.shard_offset + piece.length
                    assert (got[lo:lo + n] == -1).all(), "a range is covered twice"
                    got[lo:lo + n] = h
            assert torch.equal(got, want), (rows, cols, start, world_size, pieces)


def test_find_clip_targets_geometry():
    from ds_muon.model.attention import find_clip_targets
    torch.manual_seed(0)
    llama = find_clip_targets(llama_gqa())
    assert [(t.name, t.num_heads, t.num_kv_heads) for t in llama] == [
        ("model.layers.0.self_attn", 4, 2), ("model.layers.1.self_attn", 4, 2)]
    assert [(h.name.rsplit(".", 2)[-2], h.start, h.head_dim, h.cols) for h in llama[0].query + llama[0].key] == [
        ("q_proj", 0, 8, 32), ("k_proj", 0, 8, 32)]
    qwen = find_clip_targets(qwen2_bias())[0]
    assert [h.name.rsplit(".", 1)[-1] for h in qwen.query + qwen.key] == ["weight", "bias", "weight", "bias"]
    phi = find_clip_targets(phi3_fused())[0]
    assert [(h.name.rsplit(".", 2)[-2], h.start) for h in phi.query + phi.key] == [("qkv_proj", 0), ("qkv_proj", 32)]
    declared = find_clip_targets(DeclaredNet())
    assert [(t.name, len(t.query), len(t.key), t.query[0].head_dim) for t in declared] == [
        ("attn.0", 2, 1, 6), ("attn.1", 2, 1, 6)]


def test_example_model_declares_its_attention():
    example = repo_module("examples/model.py")
    from ds_muon.model.attention import find_clip_targets
    targets = find_clip_targets(example.CausalLM(example.ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                                    ffn_hidden=48, max_seq_len=16)))
    assert len(targets) == 2 and all((t.num_heads, t.num_kv_heads) == (4, 2) for t in targets)
    assert targets[0].query[0].name.endswith("q_proj.weight") and targets[0].key[0].name.endswith("k_proj.weight")


def test_refusals():
    from ds_muon import MuonAdamW
    from ds_muon.config import ConfigError
    clip = {"qk_clip": {"enabled": True, "threshold": TAU}}
    with pytest.raises(ConfigError, match=r"no attention module was found.*muon_qk_clip"):
        MuonAdamW(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), **clip)
    model = llama_gqa()
    with pytest.raises(ConfigError, match="pass model="):
        MuonAdamW(list(model.parameters()), **clip)
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"k_proj.weight.*not trained by this optimizer"):
        MuonAdamW([p for p in model.parameters() if p.requires_grad], model=model, **clip)
    # a transformers attention that never records (plain sdpa): refused at once, naming ds_muon_sdpa
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_implementation="sdpa"))
    with pytest.raises(ConfigError, match=r"runs attn_implementation='sdpa'.*ds_muon_sdpa.*record_max_logits"):
        MuonAdamW(plain, **clip)


def test_config_errors_name_key_and_allowed_values():
    from ds_muon.config import ConfigError, parse_muon_params
    assert parse_muon_params({}).qk_clip.model_dump() == {"enabled": False, "threshold": 100.0, "alpha": 0.5,
                                                          "monitor_per_head": True, "until_step": None}
    for bad, match in (({"threshold": 0}, r"qk_clip\.threshold: 0 is invalid.*allowed: a number > 0"),
                       ({"alpha": 1.5}, r"qk_clip\.alpha: 1\.5 is invalid.*allowed: a number in \[0, 1\]"),
                       ({"enabled": "yes"}, r"qk_clip\.enabled: 'yes' is invalid.*allowed: true or false"),
                       ({"monitor_per_head": 1}, r"qk_clip\.monitor_per_head: 1 is invalid.*allowed: true or false"),
                       ({"treshold": 5}, r"qk_clip\.treshold: unknown key.*did you mean 'threshold'"),
                       (3, r"qk_clip: 3 is invalid.*enabled \(true or false\), threshold")):
        with pytest.raises(ConfigError, match=match):
            parse_muon_params({"qk_clip": bad})


# ------------------------------------------------------------------------------------------------
# the oracle: the clip alone (lr 1e-9), checked against the recorded logits
# ------------------------------------------------------------------------------------------------
EXACT_MODELS = {
    "llama-gqa": lambda: llama_gqa(num_hidden_layers=1),
    "llama-mha": lambda: llama_gqa(num_hidden_layers=1, num_key_value_heads=4),
    "qwen2-mha-bias": lambda: qwen2_bias(num_hidden_layers=1, num_key_value_heads=4),
    "phi3-fused-gqa": lambda: phi3_fused(num_hidden_layers=1),
    "declared-gqa": lambda: DeclaredNet(num_hidden_layers=1),
    "declared-mha": lambda: DeclaredNet(num_hidden_layers=1, num_key_value_heads=4),
}


@pytest.mark.parametrize("name", sorted(EXACT_MODELS))
@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_oracle_clip_scales_heads_and_bounds_logits(name, alpha):
    from ds_muon import MuonAdamW
    from ds_muon.model.max_logits import RECORDER
    from ds_muon.model.attention import find_clip_targets
    torch.manual_seed(0)
    model = EXACT_MODELS[name]()
    tokens, targets = batch(0, 0, 0)
    (module,) = [t.module for t in find_clip_targets(model)]
    RECORDER.clear()
    model(tokens, targets)
    ordered = RECORDER.take(module).sort().values
    tau = float(ordered[1] + ordered[2]) / 2  # between the heads' max logits: some clip, some do not
    opt = MuonAdamW(model, lr=1e-9, adam_lr=1e-9, weight_decay=0.0,
                    qk_clip={"enabled": True, "threshold": tau, "alpha": alpha})
    (target,) = opt.qk_clip_targets
    model(tokens, targets).backward()
    s = RECORDER._max[target.module].clone()  # what the step will take
    before = [hr.param.detach().clone() for hr in target.query + target.key]
    opt.step()
    assert opt.qk_clip_stats["heads_clipped"] == 2, (s, tau, opt.qk_clip_stats)
    want_q, want_k = _expected_factors(s.tolist(), target.num_kv_heads, tau, alpha)
    for hr, old in zip(target.query + target.key, before):
        want = want_q if any(hr is q for q in target.query) else want_k
        new = hr.param.detach().view(-1)
        for h in range(hr.num_heads):
            lo, hi = hr.head_span(h)
            torch.testing.assert_close(new[lo:hi], old.view(-1)[lo:hi] * want[h], rtol=1e-6, atol=1e-7)
    with torch.enable_grad():
        model(tokens, targets)
    s_new = RECORDER.take(target.module)
    # every logit of head h scales by q_h * k_(its key head): so does the max; a clipped head ends <= tau
    group = target.num_heads // target.num_kv_heads
    scale = torch.tensor([want_q[h] * want_k[h // group] for h in range(target.num_heads)])
    torch.testing.assert_close(s_new, s * scale, rtol=1e-5, atol=0)
    clipped = s > tau
    assert (s_new[clipped] <= tau * (1 + 1e-5)).all(), (s, s_new)
    if target.num_kv_heads == target.num_heads:  # no GQA: exactly tau
        torch.testing.assert_close(s_new[clipped], torch.full_like(s_new[clipped], tau), rtol=1e-5, atol=0)


def test_recorded_max_logits_match_a_loop():
    """The max logits ds_muon computes for a causal GQA attention (``max_logits_per_head``), the ones
    ``ds_muon_sdpa`` records for a training module, and the test models' recorder (``brute_max_logits``) all equal
    a loop over batch, query heads and causal positions of ``q_i . k_j * 0.5`` (key head ``h // 2``)."""
    from ds_muon.model.hf_attention import ds_muon_sdpa
    from ds_muon.model.max_logits import RECORDER, max_logits_per_head
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 3), torch.randn(2, 2, 5, 3), torch.randn(2, 2, 5, 3)
    want = torch.full((4,), float("-inf"))
    for b in range(2):
        for h in range(4):
            for i in range(5):
                for j in range(i + 1):
                    want[h] = max(want[h], float(q[b, h, i] @ k[b, h // 2, j]) * 0.5)
    torch.testing.assert_close(max_logits_per_head(q, k, 0.5, is_causal=True), want)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    module.train()
    RECORDER.take(module)
    ds_muon_sdpa(module, q, k, v, None, scaling=0.5)
    torch.testing.assert_close(RECORDER.take(module), want)
    torch.testing.assert_close(brute_max_logits(q, k, 0.5), want)  # what the test models record
