"""QK-clip on the model families with their own rule (issue 26): MLA, q/k-norm gains, GPT-NeoX's interleaved fused
QKV, eager-only attention with sinks; the refusals (Falcon, Bloom, a non-recording attn_implementation); the
``until_step`` window. One process, the oracle ``ds_muon.MuonAdamW``; ZeRO parity is tests/dist/test_qk_clip_families.py.

Every model is a real transformers class from a tiny config (tests/support/qk_models.py). The logits are measured
by the test's own brute force on the query and key the model hands to its attention function (after q/k norm and
RoPE, at the model's softmax scale, under the model's mask), not by ds_muon's recorder.

* The clip alone (lr 1e-9, one layer, tau between the heads' max logits): every scaled block changed by exactly its
  factor (MLA: q_C gamma^alpha, k_C gamma^(1-alpha), q_R gamma; q/k-norm gains shared by the heads: one gamma for
  the layer, Gemma's 1 + w included; OLMo 2: per head), and recomputed on the same batch every head's max logit is
  the old one times the rule's scale, so clipped heads end at <= tau (MLA and per-layer: exactly min(S, tau) and
  S * gamma_layer).
* ds_muon's own recording (``ds_muon_sdpa`` on DeepSeek-V3 with YaRN mscale, ``ds_muon_eager`` on GPT-OSS with
  sinks and a sliding window) equals the brute force at the scale computed here from the config; ``ds_muon_eager``
  returns exactly what ``"eager"`` returns.
* A high learning rate on every family above: the max logit measured through the model's own attention function
  with QK-clip stays far below the run without.
* The ``until_step`` window across the oracle's state dict (saved inside and after the window).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.models import batch

transformers = pytest.importorskip("transformers")

from tests.support.qk_models import (FAMILIES, MEASURED, MODELS, NEEDS_ATTENTION_FUNCTIONS, deepseek_v3,  # noqa: E402
                                     falcon_calls_attention_functions, gpt_oss, mla_softmax_scale)

ALPHA = 0.5


def _served(name: str) -> None:
    """Skip a family the installed transformers computes inline (Falcon before 5.25: refused, as
    :func:`test_refusals_name_the_fix` checks)."""
    if name in NEEDS_ATTENTION_FUNCTIONS and not falcon_calls_attention_functions():
        pytest.skip(f"transformers {transformers.__version__}'s FalconAttention computes its attention inline")


def _one_layer(name: str):
    torch.manual_seed(0)
    return MODELS[name](num_hidden_layers=1, **({"layer_types": ["full_attention"]} if name in ("gemma3", "gpt_oss")
                                               else {}))


def _expected(target, s: torch.Tensor, tau: float, alpha: float):
    """Per block of rows: the factor of each head; and the scale of each query head's logits. Written from the
    rules in docs/qk_clip.md, not from ds_muon's code."""
    def gamma(x):
        return tau / x if x > tau else 1.0
    nh, nkv = target.num_heads, target.num_kv_heads
    vals = s.tolist()
    if target.per_layer:
        g = gamma(max(vals))
        q, k, full = [g ** alpha] * nh, [g ** (1 - alpha)] * nkv, [g] * nh
    else:
        group = nh // nkv
        q = [gamma(x) ** alpha for x in vals]
        k = [gamma(max(vals[i * group:(i + 1) * group])) ** (1 - alpha) for i in range(nkv)]
        full = [gamma(x) for x in vals]
    group = nh // nkv
    if target.query_full:  # MLA: q_C k_C by gamma^alpha gamma^(1-alpha), q_R k_R by gamma: gamma in all
        scale = [gamma(x) for x in vals]
    else:
        scale = [q[h] * k[h // group] for h in range(nh)]
    return q, k, full, scale


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_clip_alone_scales_each_family_by_its_rule(name):
    from ds_muon import MuonAdamW
    from ds_muon.model.attention import find_clip_targets
    from ds_muon.model.max_logits import RECORDER
    _served(name)
    model = _one_layer(name)
    tokens, targets = batch(0, 0, 0)
    (target,) = find_clip_targets(model)
    rule, leaves = FAMILIES[name]
    assert target.rule.startswith(rule), target.rule
    assert {hr.name.split(".")[-2] for hr in target.rows} == leaves, [hr.name for hr in target.rows]
    RECORDER.clear()
    model(tokens, targets)
    ordered = MEASURED[target.module].sort().values
    tau = float(ordered[1] + ordered[2]) / 2  # two heads above tau, two below
    opt = MuonAdamW(model, lr=1e-9, adam_lr=1e-9, weight_decay=0.0,
                    qk_clip={"enabled": True, "threshold": tau, "alpha": ALPHA})
    model(tokens, targets).backward()
    s = MEASURED[target.module].clone()
    before = {id(hr): hr.param.detach().clone() for hr in target.rows}
    opt.step()
    assert opt.qk_clip_stats["heads_clipped"] == 2, (s, tau, opt.qk_clip_stats)
    want_q, want_k, want_full, scale = _expected(target, s, tau, ALPHA)
    for rows, want in ((target.query, want_q), (target.key, want_k), (target.query_full, want_full)):
        for hr in rows:
            old, new = before[id(hr)].view(-1), hr.param.detach().view(-1)
            for h in range(hr.num_heads):
                lo, hi = hr.head_span(h)
                f = want[hr.first_head + h]  # a block's head h is the target's head first_head + h
                expect = (old[lo:hi] + 1) * f - 1 if hr.plus_one else old[lo:hi] * f  # Gemma: the gain is 1 + w
                torch.testing.assert_close(new[lo:hi], expect, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        model(tokens, targets)
    s_new = MEASURED[target.module]
    torch.testing.assert_close(s_new, s * torch.tensor(scale), rtol=1e-4, atol=1e-5)
    assert (s_new <= tau * (1 + 1e-4))[s > tau].all(), (s, s_new)
    if target.query_full or target.num_kv_heads == target.num_heads and not target.per_layer:
        torch.testing.assert_close(s_new, torch.minimum(s, torch.tensor(tau)), rtol=1e-4, atol=1e-5)


def test_ds_muon_sdpa_records_mla_at_the_models_softmax_scale():
    """DeepSeek-V3 with YaRN (mscale_all_dim 1, factor 4): the recorded max logits equal the brute force at
    (nope + rope)^-0.5 * mscale^2, computed here from the config, with and without q_lora_rank."""
    import ds_muon
    from ds_muon.model.max_logits import RECORDER
    ds_muon.register_attention()
    for q_lora in (None, 12):
        torch.manual_seed(0)
        model = deepseek_v3(q_lora_rank=q_lora, attn_implementation="ds_muon_sdpa")
        brute = deepseek_v3(q_lora_rank=q_lora)  # the test's brute force, the same weights
        brute.load_state_dict(model.state_dict())
        scale = mla_softmax_scale(model)
        assert scale != pytest.approx(12 ** -0.5) and model.model.layers[0].self_attn.scaling == pytest.approx(scale)
        RECORDER.clear()
        tokens, targets = batch(0, 0, 0)
        model(tokens, targets)
        brute(tokens, targets)
        for layer, ref in zip(model.model.layers, brute.model.layers):
            torch.testing.assert_close(RECORDER.take(layer.self_attn), MEASURED[ref.self_attn], rtol=1e-5, atol=1e-6)


def test_ds_muon_eager_is_the_models_eager_and_records_sinks_model():
    """GPT-OSS (no SDPA support; sinks; a sliding-window layer): ds_muon_eager returns the same loss and gradients
    as "eager" bit for bit, and records the brute-force max over the positions the model's mask allows."""
    import ds_muon
    from ds_muon.model.max_logits import RECORDER
    ds_muon.register_attention()
    torch.manual_seed(0)
    ref = gpt_oss(attn_implementation="eager")
    mine = gpt_oss(attn_implementation="ds_muon_eager")
    mine.load_state_dict(ref.state_dict())
    tokens, targets = batch(0, 0, 0)
    RECORDER.clear()
    a, b = ref(tokens, targets), mine(tokens, targets)
    a.backward(), b.backward()
    assert torch.equal(a, b)
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(p.grad, q.grad), n
    brute = gpt_oss()  # the test's brute force (under the mask the model built), the same weights
    brute.load_state_dict(ref.state_dict())
    brute(tokens, targets)
    for layer, other in zip(mine.model.layers, brute.model.layers):
        torch.testing.assert_close(RECORDER.take(layer.self_attn), MEASURED[other.self_attn], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="does not support an attention implementation through"):
        gpt_oss(attn_implementation="ds_muon_sdpa")  # transformers refuses it: hence ds_muon_eager


def test_refusals_name_the_fix():
    import ds_muon
    from ds_muon import MuonAdamW
    from ds_muon.config import ConfigError
    ds_muon.enable()
    try:
        clip = {"qk_clip": {"enabled": True, "threshold": 5.0}}
        tiny = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
        falcon = transformers.FalconForCausalLM(transformers.FalconConfig(**tiny))
        if not falcon_calls_attention_functions():  # Falcon before transformers 5.25 computes its attention inline
            with pytest.raises(ConfigError, match=r"FalconAttention.*computes its attention inline.*enabled to false"):
                MuonAdamW(falcon, **clip)
            with pytest.raises(ValueError, match=r"'ds_muon_sdpa' does not work with Falcon.*inline"):
                transformers.FalconForCausalLM(transformers.FalconConfig(**tiny, attn_implementation="ds_muon_sdpa"))
        else:  # from 5.25 it calls transformers' attention functions: served, with the recording the clip needs
            with pytest.raises(ConfigError, match=r"FalconAttention.*runs attn_implementation='sdpa'.*ds_muon_sdpa"):
                MuonAdamW(falcon, **clip)
            served = transformers.FalconForCausalLM(transformers.FalconConfig(**tiny, attn_implementation="ds_muon_sdpa"))
            assert [t.rule for t in MuonAdamW(served, **clip).qk_clip_targets] == ["Falcon's fused query_key_value rows"]
        bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
        with pytest.raises(ConfigError, match=r"BloomAttention.*alibi"):
            MuonAdamW(bloom, **clip)
        plain = gpt_oss(attn_implementation="eager")
        with pytest.raises(ConfigError, match=r"runs attn_implementation='eager'.*ds_muon_eager"):
            MuonAdamW(plain, **clip)
    finally:
        ds_muon.disable()


def test_until_step_window_stops_clip_and_recording():
    """until_step 2: steps 1 and 2 clip; from step 3 on nothing is scaled, no figures, and ds_muon_sdpa computes
    nothing (the recorder is never fed)."""
    import ds_muon
    from ds_muon import MuonAdamW
    from ds_muon.model import hf_attention
    ds_muon.register_attention()
    torch.manual_seed(0)
    model = MODELS["llama_ds_muon_sdpa"](num_hidden_layers=1)
    calls = []
    real = hf_attention.max_logits_per_head
    hf_attention.max_logits_per_head = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        opt = MuonAdamW(model, lr=1e-9, adam_lr=1e-9, weight_decay=0.0,
                        qk_clip={"enabled": True, "threshold": 1.0, "until_step": 2})
        clipped = []
        for step in range(4):
            calls.clear()
            tokens, targets = batch(step, 0, 0)
            model(tokens, targets).backward()
            w = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
            opt.step()
            opt.zero_grad()
            changed = not torch.allclose(w, model.model.layers[0].self_attn.q_proj.weight, rtol=1e-5, atol=1e-6)
            clipped.append((len(calls), changed, opt.qk_clip_stats is not None))
    finally:
        hf_attention.max_logits_per_head = real
    assert clipped == [(1, True, True), (1, True, True), (0, False, False), (0, False, False)], clipped


UNTIL, RESUME_STEPS = 3, 6


def _until_run(model, opt, start: int, calls: list, stop: int = RESUME_STEPS) -> list:
    """Optimizer steps ``start..stop-1`` (one micro-batch each); per step: the ds_muon_sdpa max-logit
    computations of its forward, the heads clipped (None: no figures), and every parameter after it."""
    out = []
    for step in range(start, stop):
        calls.clear()
        tokens, targets = batch(step, 0, 0)
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        stats = opt.qk_clip_stats
        out.append((len(calls), None if stats is None else stats["heads_clipped"],
                    {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def test_until_step_counter_survives_the_oracles_state_dict():
    """until_step 3, 6 steps, lr 0.02, tau 1 (every step clips in the window). The oracle's state dict saved after
    step 1 (inside the window) and after step 3 (the window over), loaded into a fresh model and oracle, continues
    exactly as the uninterrupted oracle: per step the same clipped heads (none from step 4), the same parameters
    bit for bit, and no max-logit computation in any forward past the window (the stopped recording comes back
    with the load). A state dict without the counter (saved before the oracle saved it) takes it from
    the AdamW ``step``; an earlier state dict loaded into the oracle that ran past the window records again."""
    import copy

    import ds_muon
    from ds_muon import MuonAdamW
    from ds_muon.model import hf_attention
    from ds_muon.names import QK_CLIP_STEPS_KEY
    ds_muon.register_attention()
    calls = []
    real = hf_attention.max_logits_per_head
    hf_attention.max_logits_per_head = lambda *a, **k: calls.append(1) or real(*a, **k)
    params = dict(lr=0.02, adam_lr=3e-3, weight_decay=0.0, qk_clip={"enabled": True, "threshold": 1.0,
                                                                      "until_step": UNTIL})

    def fresh(weights: dict):
        model = MODELS["llama_ds_muon_sdpa"](num_hidden_layers=1)
        model.load_state_dict(weights)
        return model, MuonAdamW(model, **params)

    try:
        torch.manual_seed(0)
        model = MODELS["llama_ds_muon_sdpa"](num_hidden_layers=1)
        opt = MuonAdamW(model, **params)
        saved, once = {}, []
        for step in range(RESUME_STEPS):
            if step in (1, UNTIL):
                saved[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            once += _until_run(model, opt, step, calls, stop=step + 1)
        figures = [(c, h) for c, h, _ in once]
        assert all(c == 1 and h > 0 for c, h in figures[:UNTIL]), figures  # the window clips
        assert figures[UNTIL:] == [(0, None)] * (RESUME_STEPS - UNTIL), figures
        assert saved[1][1][QK_CLIP_STEPS_KEY] == 1 and saved[UNTIL][1][QK_CLIP_STEPS_KEY] == UNTIL

        def same(start: int, got: list) -> None:
            want = once[start:]
            assert [(c, h) for c, h, _ in got] == [(c, h) for c, h, _ in want], (
                f"resumed at {start}: (max-logit computations, heads clipped) per step {[(c, h) for c, h, _ in got]}, "
                f"uninterrupted {[(c, h) for c, h, _ in want]}")
            for k, ((_, _, g), (_, _, w)) in enumerate(zip(got, want)):
                assert all(torch.equal(g[n], w[n]) for n in w), f"resumed at {start}: step {start + k} differs"

        for start, (weights, state) in saved.items():
            resumed, ropt = fresh(weights)
            ropt.load_state_dict(copy.deepcopy(state))
            same(start, _until_run(resumed, ropt, start, calls))
        weights, state = saved[1]
        old = copy.deepcopy(state)
        del old[QK_CLIP_STEPS_KEY]
        resumed, ropt = fresh(weights)
        ropt.load_state_dict(old)
        assert ropt._qk_clip_steps == 1
        same(1, _until_run(resumed, ropt, 1, calls))
        model.load_state_dict(weights)  # back into the oracle whose recording the window's end stopped
        opt.load_state_dict(copy.deepcopy(state))
        same(1, _until_run(model, opt, 1, calls))
    finally:
        hf_attention.max_logits_per_head = real


#: The high-learning-rate runs: Muon and AdamW lr (the q/k-norm gains are AdamW's: with the norms only they can
#: raise the logits), optimizer steps, QK-clip's threshold, and the bound: over the last WINDOW steps, the clipped
#: run's largest logit is below HELD of the unclipped run's, which is above GREW times the threshold.
HIGH_LR, HIGH_LR_STEPS, HIGH_LR_TAU, WINDOW, HELD, GREW = 0.5, 20, 10.0, 10, 1 / 3, 4.0


def _measure_attention(monkeypatch) -> None:
    """Record, in ``MEASURED``, the test's brute-force max logits of every forward on the query and key each model
    hands to its own attention function: transformers' ``sdpa_attention_forward`` (which ``ds_muon_sdpa`` calls)
    and the ``eager_attention_forward`` of each model file (which ``ds_muon_eager`` looks up at call time)."""
    import importlib

    from ds_muon.model import hf_attention
    from tests.support.qk_models import brute_max_logits

    def measuring(fn):
        def attention(module, query, key, value, mask, *args, **kwargs):
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            MEASURED[module] = brute_max_logits(query, key, scaling, mask).detach()
            return fn(module, query, key, value, mask, *args, **kwargs)
        return attention

    monkeypatch.setattr(hf_attention, "sdpa_attention_forward", measuring(hf_attention.sdpa_attention_forward))
    for name in ("deepseek_v3", "qwen3", "gemma3", "olmo2", "gpt_neox", "gpt_oss"):
        modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        monkeypatch.setattr(modeling, "eager_attention_forward", measuring(modeling.eager_attention_forward))


def _max_logit_run(name: str, clip: bool) -> tuple[list[float], int]:
    """Family ``name`` (``ds_muon_sdpa``, GPT-OSS ``ds_muon_eager``: ds_muon's own recording feeds the clip) trained
    by the oracle at HIGH_LR for HIGH_LR_STEPS steps. Returns per step the largest logit of its forward as the
    test measures it (:func:`_measure_attention`, not ds_muon's recorder), and the heads the clip scaled in all."""
    import ds_muon
    from ds_muon import MuonAdamW
    ds_muon.register_attention()
    torch.manual_seed(0)
    model = MODELS[name](attn_implementation="ds_muon_eager" if name == "gpt_oss" else "ds_muon_sdpa")
    opt = MuonAdamW(model, lr=HIGH_LR, adam_lr=HIGH_LR, weight_decay=0.0,
                    qk_clip={"enabled": clip, "threshold": HIGH_LR_TAU})
    out, clipped = [], 0
    for step in range(HIGH_LR_STEPS):
        tokens, targets = batch(step % 4, 0, 0)
        MEASURED.clear()
        model(tokens, targets).backward()
        out.append(max(float(v.max()) for m, v in MEASURED.items() if any(m is n for n in model.modules())))
        opt.step()
        opt.zero_grad()
        clipped += opt.qk_clip_stats["heads_clipped"] if clip else 0
    return out, clipped


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_high_lr_max_logit_held_well_below_the_run_without_clip(name, monkeypatch):
    """Each family at Muon and AdamW lr 0.5, 20 steps, tau 10, alpha 0.5, one micro-batch per step; the max logit
    measured through the model's own attention function. Bound: over the last 10 steps, the clipped run's largest
    logit is below 1/3 of the unclipped run's, and the unclipped run's exceeds 4 tau (Falcon: transformers >= 5.25).
    Measured (CPU, torch 2.13,
    transformers 5.24), largest logit of steps 11-20, clip / no clip: DeepSeek-V3 116 / 6290, with q_lora_rank
    188 / 9443, Qwen3 14.4 / 92.8, Gemma 3 13.2 / 59.1, OLMo 2 19.3 / 178.5, GPT-NeoX 82.0 / 4052, GPT-OSS (sinks)
    56.3 / 1840: ratios 0.02-0.22. The clip holds the logits near tau, not at it (docs/qk_clip.md, "At a high
    learning rate": each update adds to them again; most for MLA, whose shared rotary key is not scaled)."""
    _served(name)
    _measure_attention(monkeypatch)
    free, _ = _max_logit_run(name, False)
    held, clipped = _max_logit_run(name, True)
    print(f"{name} no clip", [round(x, 1) for x in free])
    print(f"{name} clip   ", [round(x, 1) for x in held])
    assert clipped > 0
    assert max(free[-WINDOW:]) > GREW * HIGH_LR_TAU, free
    assert max(held[-WINDOW:]) < HELD * max(free[-WINDOW:]), (held, free)
    assert all(math.isfinite(x) for x in held), held
