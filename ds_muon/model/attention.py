"""QK-clip's targets: the attention modules of a model and the query/key rows of each head (layer ``model``).

:func:`find_clip_targets` finds them (declared with ``muon_qk_clip()``, or Hugging Face attention with
``q_proj``/``k_proj``, a fused ``qkv_proj``, GPT-NeoX's interleaved ``query_key_value``, MLA, or q/k norms whose
gains are scaled; head geometry from :func:`ds_muon.model.structure.head_geometry`);
:func:`factor_spans` turns them into flat element ranges per factor, which the oracle scales on whole
parameters and :mod:`ds_muon.sharded.qk_clip` on ZeRO partitions. :func:`take_max_logits` reads the
recorder (:mod:`ds_muon.model.max_logits`). The rule itself is :mod:`ds_muon.core.qk_clip`
(Kimi K2 technical report, arXiv 2507.20534, section 2.1).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..core.qk_clip import scale_rows_
from ..errors import ConfigError
from .max_logits import RECORDER
from .structure import head_geometry, param_shape, positive_int, text_config

#: The method a custom attention module defines to declare its query/key weights (see :func:`find_clip_targets`).
DECLARE_METHOD = "muon_qk_clip"
#: Children that normalize q/k after the projection (Qwen3, OLMo2, Gemma3, ...): QK-clip scales their gains, not W_q/W_k.
QK_NORM_CHILDREN = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")
FIX_RECORDING = ("pass attn_implementation=\"ds_muon_sdpa\" to a Hugging Face model (after ds_muon.register_attention() "
                 "or ds_muon.enable()), or attn_implementation=\"ds_muon_eager\" where the model has no SDPA support "
                 "(GPT-OSS), or call ds_muon.record_max_logits(self, max_logits) in a custom attention's "
                 "forward")


@dataclass(eq=False)
class HeadRows:
    """Consecutive head blocks of one parameter: rows ``[start + h*head_dim, start + (h+1)*head_dim)`` are head ``h``.

    Attributes:
        param: the weight ``(rows, cols)`` or bias ``(rows,)`` (``ds_shape`` under ZeRO-3).
        name: its name in ``model.named_parameters()``.
        start: first row of head 0 (0, or the key block's offset in a fused QKV).
        head_dim: rows per head.
        num_heads: heads in the block.
        cols: elements per row (``in_features`` of a weight, 1 for a bias or a norm gain).
        stride: rows from one head's first row to the next's (0: ``head_dim``, heads back to back); GPT-NeoX's
            interleaved ``query_key_value`` has ``3 * head_dim``, MLA's ``q_b_proj`` ``nope + rope``.
        plus_one: the parameter is a gain stored as ``w`` and applied as ``1 + w`` (Gemma's RMSNorm): scaling the
            gain by ``f`` sets ``w = f * w + (f - 1)``.
        first_head: the head index of the block's head 0 among the target's heads (0 unless the heads are laid out
            in several blocks: Falcon's new decoder architecture keeps each key head's query group apart).
    """

    param: nn.Parameter
    name: str
    start: int
    head_dim: int
    num_heads: int
    cols: int
    stride: int = 0
    plus_one: bool = False
    first_head: int = 0

    def head_span(self, h: int) -> tuple[int, int]:
        """``[lo, hi)`` flat (row-major) element range of head ``h`` in the parameter."""
        lo = (self.start + h * (self.stride or self.head_dim)) * self.cols
        return lo, lo + self.head_dim * self.cols

    @property
    def last_row(self) -> int:
        """One past the last row any head of the block uses."""
        return self.start + (self.num_heads - 1) * (self.stride or self.head_dim) + self.head_dim


@dataclass(eq=False)
class ClipTarget:
    """One attention module QK-clip acts on.

    Attributes:
        module: the module that records its max logits (``record_max_logits(module, (num_heads,))``).
        name: its name in ``model.named_modules()``.
        num_heads, num_kv_heads: query heads and key heads (``num_heads % num_kv_heads == 0``).
        query, key: the rows to scale by ``gamma^alpha`` and ``gamma_kv^(1-alpha)``: the weight, then the bias if
            there is one (or the q/k-norm gains).
        query_full: rows scaled by the whole ``gamma`` of their query head (MLA's rotary query part q_R, whose
            key k_R is shared by all heads and not scaled); empty elsewhere.
        per_layer: one ``gamma`` for the whole layer (``tau / max_h S_h``), for q/k-norm gains that all heads share
            (Qwen3, Gemma 3).
        rule: a short name of the rule, for messages and docs.
    """

    module: nn.Module
    name: str
    num_heads: int
    num_kv_heads: int
    query: tuple[HeadRows, ...]
    key: tuple[HeadRows, ...]
    query_full: tuple[HeadRows, ...] = ()
    per_layer: bool = False
    rule: str = "W_q/W_k rows per head"

    @property
    def rows(self) -> tuple[HeadRows, ...]:
        """Every block of rows the clip scales."""
        return self.query + self.key + self.query_full

    @property
    def num_factors(self) -> int:
        """Entries of this target in the factor vector: query heads, key heads, then (MLA) query heads again."""
        return self.num_heads + self.num_kv_heads + (self.num_heads if self.query_full else 0)


def _rows(p: nn.Parameter, name: str, start: int, head_dim: int, heads: int, where: str, stride: int = 0,
          plus_one: bool = False, first_head: int = 0) -> HeadRows:
    shape = param_shape(p)
    hr = HeadRows(p, name, start, head_dim, heads, shape[1] if len(shape) == 2 else 1, stride, plus_one, first_head)
    if len(shape) not in (1, 2) or shape[0] < hr.last_row:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: parameter {name!r} of shape {shape} cannot hold "
                          f"{heads} heads of {head_dim} rows from row {start} every {stride or head_dim} rows "
                          "(expected a (rows, in) weight or a (rows,) bias); correct the head geometry (num_heads, "
                          f"num_kv_heads, head_dim in the model config, or what {DECLARE_METHOD}() returns), or set "
                          "optimizer.params.qk_clip.enabled to false")
    return hr


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def _declared_target(name: str, module: nn.Module, names: dict[int, str]) -> ClipTarget:
    where = f"{type(module).__name__} {name!r}.{DECLARE_METHOD}()"
    spec = getattr(module, DECLARE_METHOD)()
    if not isinstance(spec, dict) or not {"q", "k", "num_heads", "num_kv_heads"} <= set(spec):
        raise ConfigError(f"optimizer.params.qk_clip: {where} must return a dict with 'q' and 'k' (the query and "
                          "key projection weights, (heads*head_dim, in)), 'num_heads' and 'num_kv_heads'; optional: "
                          "'q_bias', 'k_bias', 'head_dim', 'q_row_offset', 'k_row_offset' (a fused QKV weight)")
    nh, nkv = int(spec["num_heads"]), int(spec["num_kv_heads"])
    q, k = spec["q"], spec["k"]
    qo, ko = int(spec.get("q_row_offset", 0)), int(spec.get("k_row_offset", 0))
    hd = int(spec.get("head_dim") or (param_shape(q)[0] - qo) // nh)
    return _target(module, name, nh, nkv, hd, [(q, qo), (spec.get("q_bias"), qo)],
                   [(k, ko), (spec.get("k_bias"), ko)], names, where)


def _target(module, name, nh, nkv, hd, query, key, names, where, query_full=(), **extra) -> ClipTarget:
    """A target from row blocks: ``(param or None, start)`` pairs (``hd`` rows per head, back to back; a None
    param, an absent bias, is skipped) or :class:`HeadRows` built already; ``extra``: ``per_layer``, ``rule``."""
    if nh < 1 or nkv < 1 or nh % nkv or hd < 1:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: {nh} query heads, {nkv} key heads and head_dim {hd} "
                          "do not fit (all >= 1, num_heads a multiple of num_kv_heads); correct them (in the model "
                          f"config, or what {DECLARE_METHOD}() returns), or set optimizer.params.qk_clip.enabled to "
                          "false")
    built = []
    for parts, heads in ((query, nh), (key, nkv), (query_full, nh)):
        rows = []
        for part in parts:
            if isinstance(part, HeadRows):
                rows.append(part)
                continue
            p, start = part
            if p is None:
                continue
            rows.append(_rows(p, _name(p, names, where), start, hd, heads, where))
        built.append(tuple(rows))
    return ClipTarget(module, name, nh, nkv, built[0], built[1], built[2], **extra)


def _name(p: nn.Parameter, names: dict[int, str], where: str) -> str:
    if id(p) not in names:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: a declared tensor is not a parameter of the model; "
                          "return the module's own parameters (e.g. self.q_proj.weight), not a copy, slice or view")
    return names[id(p)]


#: Attention implementations of transformers that record nothing (QK-clip needs ds_muon's: FIX_RECORDING).
NON_RECORDING = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
#: Attention modules that compute their attention inline, not through transformers' attention functions: no
#: ``attn_implementation`` can record their max logits. Refused only where the installed forward really does
#: (:func:`calls_attention_functions`: Falcon calls them from transformers 5.25 on).
INLINE_ATTENTION = {
    "FalconAttention": "Falcon computes its attention inline in this transformers release (torch's SDPA or its own "
                       "matmul, ALiBi or RoPE), not through transformers' attention functions (transformers >= 5.25's "
                       "Falcon does: upgrade transformers to use QK-clip on it)",
    "BloomAttention": "Bloom computes its attention inline (alibi.baddbmm of q.k plus a position bias), not "
                      "through transformers' attention functions",
}
#: Falcon's modeling file; before transformers 5.25 its decoder layer picks the attention class from a dict keyed by
#: attn_implementation (:func:`ds_muon.model.hf_attention.guard_falcon` wraps that dict, right after this module's
#: import); from 5.25 on FalconAttention calls transformers' attention functions and QK-clip serves it.
FALCON_MODULE = "transformers.models.falcon.modeling_falcon"
#: The global through which transformers' attention modules look up their attention function (``attn_implementation``).
ATTENTION_FUNCTIONS = "ALL_ATTENTION_FUNCTIONS"


def calls_attention_functions(module: Any) -> bool:
    """Whether ``type(module).forward`` (``module.forward`` for a class), as installed, looks its attention function up in transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (so ``attn_implementation="ds_muon_sdpa"`` reaches it and records its max logits),
    read from the global names its code loads; False where it computes its attention inline (Falcon before
    transformers 5.25, Bloom) or has no Python code to read."""
    cls = module if isinstance(module, type) else type(module)
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return code is not None and ATTENTION_FUNCTIONS in code.co_names
#: Attention modules whose fused ``query_key_value`` layout ds_muon reads from the module's own flags
#: (:func:`_falcon_target`), where their forward calls transformers' attention functions.
FUSED_QKV_LAYOUTS = ("FalconAttention",)
#: Interleaved fused QKV whose layout ds_muon knows: GPT-NeoX's query_key_value is viewed as (heads, 3*head_dim)
#: and chunked into q, k, v (modeling_gpt_neox.GPTNeoXAttention.forward).
PER_HEAD_QKV = ("GPTNeoXAttention",)


def _linear(children: dict, *names: str) -> Optional[nn.Linear]:
    return next((children[n] for n in names if isinstance(children.get(n), nn.Linear)), None)


def _check_recording(module: nn.Module, where: str) -> None:
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if impl in NON_RECORDING:
        raise ConfigError(f"optimizer.params.qk_clip: {where} runs attn_implementation={impl!r}, which does not "
                          f"record the max logits QK-clip needs; {FIX_RECORDING}")


def _mla_target(name: str, module: nn.Module, children: dict, names: dict[int, str], where: str) -> ClipTarget:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; transformers' DeepseekV3Attention).

    Per head h the logit is ``q_C . k_C + q_R . k_R``: q_C and q_R are the no-rope and rotary rows of the query
    projection (``q_proj``, or ``q_b_proj`` after ``q_a_proj`` and its norm with ``q_lora_rank``), laid out per
    head as ``[nope; rope]``; k_C are the first ``nope`` of each head's ``[nope; v]`` rows of ``kv_b_proj``; k_R is
    one rotary key for all heads (the last ``rope`` outputs of ``kv_a_proj_with_mqa``). Kimi K2's rule (arXiv
    2507.20534, section 2.1): q_C and k_C by gamma_h^alpha and gamma_h^(1-alpha) (sqrt at alpha 0.5), q_R by
    gamma_h, k_R untouched: every logit of head h scales by gamma_h."""
    nope, rope, v, nh = (positive_int(getattr(module, k, None))
                         for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads"))
    if not (nope and rope and v and nh):
        raise ConfigError(f"optimizer.params.qk_clip: {where} looks like MLA (kv_a_proj_with_mqa, kv_b_proj) but "
                          "does not state qk_nope_head_dim, qk_rope_head_dim, v_head_dim and num_heads (all > 0); "
                          "set them on the module as transformers' DeepseekV3Attention does (from its config), or set "
                          "optimizer.params.qk_clip.enabled to false")
    q = _linear(children, "q_b_proj", "q_proj")
    kv_b = children["kv_b_proj"]
    query, full, key = [], [], []
    for p in (q.weight, q.bias):
        if p is not None:
            query.append(_rows(p, _name(p, names, where), 0, nope, nh, where, stride=nope + rope))
            full.append(_rows(p, _name(p, names, where), nope, rope, nh, where, stride=nope + rope))
    for p in (kv_b.weight, kv_b.bias):
        if p is not None:
            key.append(_rows(p, _name(p, names, where), 0, nope, nh, where, stride=nope + v))
    return _target(module, name, nh, nh, nope, query, key, names, where, query_full=full,
                   rule="MLA: q_C, k_C by sqrt(gamma); q_R by gamma; k_R kept")


def _gain(norm: nn.Module, where: str, which: str) -> tuple[list[nn.Parameter], bool]:
    """The learnable gain (and bias) of a q/k norm, and whether it is applied as ``1 + w`` (Gemma).

    Probed on a fresh module of the same class: with the gain set to 0 the output is 0 (``x_hat * w``) or
    ``x_hat`` (``x_hat * (1 + w)``); with it set to 2, ``2 x_hat`` or ``3 x_hat``."""
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    if not isinstance(weight, nn.Parameter) or len(param_shape(weight)) != 1:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: {which} has no learnable 1-D gain, so nothing the clip "
                          "can scale bounds its logits (the norm undoes any scaling of W_q/W_k); give the norm a "
                          "learnable gain (e.g. elementwise_affine=True), or set optimizer.params.qk_clip.enabled to "
                          "false for this model")
    d = param_shape(weight)[0]
    try:
        probe = type(norm)(d)
        x = torch.randn(3, d, generator=torch.Generator().manual_seed(0))
        out = []
        with torch.no_grad():
            for value in (0.0, 2.0):
                probe.weight.fill_(value)
                if isinstance(getattr(probe, "bias", None), torch.Tensor):
                    probe.bias.zero_()
                out.append(probe(x).float())
    except Exception as err:  # noqa: BLE001 - any failure means: not a norm this rule understands
        raise ConfigError(f"optimizer.params.qk_clip: {where}: cannot probe {which}: ds_muon builds "
                          f"{type(norm).__name__}({d}) to see how it applies its gain, which failed "
                          f"({type(err).__name__}: {err}); give the norm class a constructor that takes the normalized "
                          "size first (as torch.nn.RMSNorm), or set optimizer.params.qk_clip.enabled to false") from err
    zero, two = out
    if zero.abs().max() == 0 and two.abs().max() > 0:
        plus_one = False
    elif zero.abs().max() > 0 and torch.allclose(two, 3 * zero, rtol=1e-4, atol=1e-6):
        plus_one = True
    else:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: {which} ({type(norm).__name__}) applies its gain as "
                          "neither x_hat * w nor x_hat * (1 + w), so scaling the gain does not scale q/k by a known "
                          "factor; use a norm of either kind (torch.nn.RMSNorm, LayerNorm, Gemma's RMSNorm), or set "
                          "optimizer.params.qk_clip.enabled to false")
    params = [weight] + ([bias] if isinstance(bias, nn.Parameter) else [])
    return params, plus_one


def _qk_norm_target(name, module, children, nh, nkv, hd, norms, names, where) -> ClipTarget:
    """Attention with q/k norms after the projection (Qwen3, Qwen3-MoE, Gemma 3, OLMo 2).

    ``q = g_q * x_hat_q`` (``x_hat`` = the normalized projection, whatever W_q does; ``(1 + w)`` for Gemma), so the
    logit is bilinear in the gains: scaling g_q by ``c_q`` and g_k by ``c_k`` scales every logit they reach by
    ``c_q * c_k`` (RoPE is linear; a norm bias is scaled with its gain). The gains are the clip's lever: per head
    where the gain has one slice per head (OLMo 2: the norm spans the whole projection, ``heads * head_dim``), per
    layer (``gamma = tau / max_h S_h`` for every head) where one ``head_dim`` gain is shared by all heads (Qwen3,
    Gemma 3)."""
    blocks, per_layer = {}, False
    for which, heads in ((norms[0], nh), (norms[1], nkv)):
        params, plus_one = _gain(children[which], where, which)
        d = param_shape(params[0])[0]
        if d == hd * heads:
            count = heads
        elif d == hd:
            count, per_layer = 1, True
        else:
            raise ConfigError(f"optimizer.params.qk_clip: {where}: {which} has {d} gains, neither head_dim {hd} "
                              f"(shared by all heads) nor {heads} heads x {hd}, so they map to no head; normalize over "
                              "head_dim or over the whole projection, or set optimizer.params.qk_clip.enabled to false")
        blocks[which] = [_rows(p, _name(p, names, where), 0, hd, count, where, plus_one=plus_one and p is params[0])
                         for p in params]
    rule = "q/k-norm gains, " + ("one gamma per layer (shared gains)" if per_layer else "per head")
    return _target(module, name, nh, nkv, hd, blocks[norms[0]], blocks[norms[1]], names, where, per_layer=per_layer,
                   rule=rule)


def _falcon_target(name: str, module: nn.Module, qkv: nn.Linear, names: dict[int, str], where: str) -> ClipTarget:
    """Falcon's fused ``query_key_value`` (transformers >= 5.25, ``FalconAttention.forward``), by the module's own
    flags, ``head_dim`` rows per head: the new decoder architecture (Falcon-40B/180B) per key head ``[its G query
    heads; key; value]`` (``G = num_heads / num_kv_heads``); multi-query (Falcon-7B) ``[all query heads; key;
    value]``; otherwise per head ``[q; k; v]``. Weight and bias (``bias: true``) alike."""
    nh, nkv, hd = module.num_heads, module.num_kv_heads, module.head_dim
    query, key = [], []
    for p in (qkv.weight, qkv.bias):
        if p is None:
            continue
        pname = _name(p, names, where)
        if module.new_decoder_architecture:
            group = nh // nkv
            query += [_rows(p, pname, g * (group + 2) * hd, hd, group, where, first_head=g * group) for g in range(nkv)]
            key.append(_rows(p, pname, group * hd, hd, nkv, where, stride=(group + 2) * hd))
        elif module.multi_query:
            query.append(_rows(p, pname, 0, hd, nh, where))
            key.append(_rows(p, pname, nh * hd, hd, 1, where))
        else:
            query.append(_rows(p, pname, 0, hd, nh, where, stride=3 * hd))
            key.append(_rows(p, pname, hd, hd, nh, where, stride=3 * hd))
    return _target(module, name, nh, nkv, hd, query, key, names, where, rule="Falcon's fused query_key_value rows")


def _hf_target(name: str, module: nn.Module, cfg: Any, names: dict[int, str]) -> Optional[ClipTarget]:
    children = dict(module.named_children())
    where = f"attention {type(module).__name__} {name!r}"
    if isinstance(children.get("kv_b_proj"), nn.Linear) and isinstance(children.get("kv_a_proj_with_mqa"), nn.Linear) \
            and _linear(children, "q_b_proj", "q_proj") is not None:
        _check_recording(module, where)
        return _mla_target(name, module, children, names, where)
    interleaved = _linear(children, "query_key_value")
    separate = isinstance(children.get("q_proj"), nn.Linear) and isinstance(children.get("k_proj"), nn.Linear)
    fused = isinstance(children.get("qkv_proj"), nn.Linear)
    if not (separate or fused or interleaved is not None):
        return None
    kind = type(module).__name__
    if kind in INLINE_ATTENTION and not calls_attention_functions(module):
        raise ConfigError(f"optimizer.params.qk_clip: {where}: {INLINE_ATTENTION[kind]}, so no attn_implementation "
                          "can record its max logits and QK-clip cannot be used on it. Set "
                          "optimizer.params.qk_clip.enabled to false for this model")
    _check_recording(module, where)
    if kind in FUSED_QKV_LAYOUTS and interleaved is not None:
        return _falcon_target(name, module, interleaved, names, where)
    geometry = head_geometry(module, cfg)
    if geometry is None:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: no head geometry (model.config with "
                          "num_attention_heads, num_key_value_heads, head_dim); or declare it with a "
                          f"{DECLARE_METHOD}() method on the module")
    nh, nkv, hd = geometry
    if interleaved is not None:
        if kind not in PER_HEAD_QKV or nkv != nh or param_shape(interleaved.weight)[0] != 3 * nh * hd:
            raise ConfigError(f"optimizer.params.qk_clip: {where}: query_key_value interleaves q, k and v in a layout "
                              f"ds_muon knows only for {', '.join(PER_HEAD_QKV)} (per head [q; k; v], {nh} heads x "
                              f"3 x {hd} rows); if its q and k rows are contiguous blocks, declare them with a "
                              f"{DECLARE_METHOD}() method (q_row_offset/k_row_offset), otherwise set "
                              "optimizer.params.qk_clip.enabled to false")
        query, key = [], []
        for p in (interleaved.weight, interleaved.bias):
            if p is not None:
                query.append(_rows(p, _name(p, names, where), 0, hd, nh, where, stride=3 * hd))
                key.append(_rows(p, _name(p, names, where), hd, hd, nh, where, stride=3 * hd))
        return _target(module, name, nh, nkv, hd, query, key, names, where, rule="per head [q; k; v] rows")
    norms = [c for c in QK_NORM_CHILDREN if c in children]
    if norms:
        pair = next(((q, k) for q, k in zip(QK_NORM_CHILDREN[0::2], QK_NORM_CHILDREN[1::2]) if q in norms and k in norms),
                    None)
        if pair is None:
            raise ConfigError(f"optimizer.params.qk_clip: {where} normalizes only one of queries and keys "
                              f"({', '.join(norms)}): the clip scales the q/k-norm gains when both are normalized and "
                              "W_q/W_k when neither is, and a norm on one side undoes the scaling of that side's "
                              "weight; normalize both or neither, or set optimizer.params.qk_clip.enabled to false")
        return _qk_norm_target(name, module, children, nh, nkv, hd, pair, names, where)
    if separate:
        q, k = children["q_proj"], children["k_proj"]
        return _target(module, name, nh, nkv, hd, [(q.weight, 0), (q.bias, 0)], [(k.weight, 0), (k.bias, 0)],
                       names, where)
    qkv = children["qkv_proj"]
    rows = param_shape(qkv.weight)[0]
    if rows != (nh + 2 * nkv) * hd:
        raise ConfigError(f"optimizer.params.qk_clip: {where}: qkv_proj has {rows} rows, not (heads {nh} + 2 x kv "
                          f"heads {nkv}) x head_dim {hd}; declare the layout with a {DECLARE_METHOD}() method "
                          "(q_row_offset/k_row_offset), or set optimizer.params.qk_clip.enabled to false")
    return _target(module, name, nh, nkv, hd, [(qkv.weight, 0), (qkv.bias, 0)],
                   [(qkv.weight, nh * hd), (qkv.bias, nh * hd)], names, where)


def find_clip_targets(model: nn.Module) -> list[ClipTarget]:
    """The attention modules of ``model`` QK-clip acts on, in ``named_modules()`` order.

    A module is a target when (first match):

    * it defines ``muon_qk_clip()`` returning ``{"q": W_q, "k": W_k, "num_heads": H, "num_kv_heads": Hkv}``
      (weights ``(H*head_dim, in)`` and ``(Hkv*head_dim, in)``; optional ``"q_bias"``, ``"k_bias"``,
      ``"head_dim"``, and ``"q_row_offset"``/``"k_row_offset"`` for a fused weight);
    * it is MLA (``kv_a_proj_with_mqa``, ``kv_b_proj`` and ``q_proj`` or ``q_b_proj``: DeepSeek-V2/V3, Kimi K2):
      q_C, k_C by sqrt(gamma), q_R by gamma, the shared k_R kept (:func:`_mla_target`);
    * it has an interleaved ``query_key_value`` of GPT-NeoX (per head ``[q; k; v]`` rows), or Falcon's fused one
      (transformers >= 5.25, where FalconAttention calls transformers' attention functions: :func:`_falcon_target`);
    * it has ``nn.Linear`` children ``q_proj`` and ``k_proj`` (Llama, Qwen2, Mistral, Mixtral, GPT-OSS, ...) or a
      fused ``qkv_proj`` laid out ``[Q; K; V]`` (Phi-3), with the head geometry from the module or the
      model's config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``); with q/k norms after the
      projection (Qwen3, Gemma 3, OLMo 2) the norms' gains are scaled instead (:func:`_qk_norm_target`).

    Raises:
        ConfigError: no target at all (naming the fix); a Hugging Face attention whose ``attn_implementation``
            records nothing (``"sdpa"``, ``"eager"``, ...: use ``"ds_muon_sdpa"``/``"ds_muon_eager"``); an attention
            computed inline (Bloom; Falcon before transformers 5.25: :func:`calls_attention_functions`); a fused QKV of unknown layout; a q/k norm without a gain the clip
            can scale; a geometry that does not fit the weights.
    """
    cfg = text_config(model)
    names = _param_names(model)
    targets = []
    for name, module in model.named_modules():
        if callable(getattr(module, DECLARE_METHOD, None)):
            targets.append(_declared_target(name, module, names))
        else:
            t = _hf_target(name, module, cfg, names)
            if t is not None:
                targets.append(t)
    if not targets:
        raise ConfigError(
            "optimizer.params.qk_clip.enabled is true but no attention module was found: QK-clip recognises "
            "attention modules with q_proj/k_proj or qkv_proj linear layers (Hugging Face models) and modules that "
            f"define {DECLARE_METHOD}() returning {{'q': W_q, 'k': W_k, 'num_heads': H, 'num_kv_heads': Hkv}}; "
            "declare yours, or disable qk_clip")
    return targets


# ------------------------------------------------------------------------------------------------
# runtime
# ------------------------------------------------------------------------------------------------
def take_max_logits(targets: Sequence[ClipTarget], device: torch.device) -> torch.Tensor:
    """Take every target's recorded max logits since the last take (resetting the recorder), concatenated.

    Returns:
        ``(sum of num_heads,)`` fp32 on ``device``; ``-inf`` for a target that recorded nothing.

    Raises:
        ValueError: a target recorded a different number of heads than it has.
    """
    parts = []
    for t in targets:
        value = RECORDER.take(t.module)
        if value is None:
            value = torch.full((t.num_heads,), float("-inf"))
        elif value.numel() != t.num_heads:
            raise ValueError(f"qk_clip: {t.name!r} recorded {value.numel()} max logits, but it has {t.num_heads} "
                             "query heads")
        parts.append(value.to(device=device, dtype=torch.float32))
    return torch.cat(parts)


def stop_recording(targets: Sequence[ClipTarget]) -> None:
    """Stop the max-logit recording of every target's module (QK-clip's ``until_step`` window is over): their
    records are dropped and ``ds_muon_sdpa``/``ds_muon_eager`` (and a custom attention asking
    :func:`ds_muon.model.max_logits.wants_max_logits`) compute nothing more for them."""
    for t in targets:
        RECORDER.stop(t.module)


def sync_recording(targets: Sequence[ClipTarget], steps_done: int, until_step: Optional[int]) -> None:
    """After a checkpoint load: the max-logit recording of every target's module as the restored step count
    ``steps_done`` says. Stopped (:func:`stop_recording`) when QK-clip's window is over (``until_step`` set and
    ``steps_done >= until_step``), so the next forwards compute nothing; otherwise on again, also for modules a
    run past the window had stopped (loading an earlier checkpoint into the same model)."""
    if until_step is not None and steps_done >= until_step:
        stop_recording(targets)
        return
    for t in targets:
        RECORDER.resume(t.module)


def check_recorded(max_logits: torch.Tensor) -> None:
    """Raise RuntimeError (naming the fix) when no target recorded anything: every value is ``-inf``."""
    if bool((max_logits == float("-inf")).all()):
        raise RuntimeError("ds_muon: optimizer.params.qk_clip is enabled, but no attention module recorded its max "
                           f"logits in this optimizer step; {FIX_RECORDING}")



def factor_spans(targets: Sequence[ClipTarget]) -> list[tuple[nn.Parameter, int, int, int, bool]]:
    """Every head's rows as a flat element range of its parameter, with its index in the factor vector.

    Args:
        targets: from :func:`find_clip_targets`.

    Returns:
        ``[(param, lo, hi, k, plus_one)]``: elements ``[lo, hi)`` of the flattened (row-major) ``param`` are scaled
        by factor ``k`` of :func:`ds_muon.core.qk_clip.factor_vector` (per target: query heads, key heads, then the
        query heads' whole-gamma rows of MLA; weights, biases and norm gains alike); with ``plus_one`` (a gain
        applied as ``1 + w``) the range ``w`` becomes ``f * w + (f - 1)``.
    """
    out, pos = [], 0
    for t in targets:
        for rows_list, base in ((t.query, pos), (t.key, pos + t.num_heads), (t.query_full, pos + t.num_heads + t.num_kv_heads)):
            for hr in rows_list:
                out.extend((hr.param, *hr.head_span(h), base + hr.first_head + h, hr.plus_one)
                           for h in range(hr.num_heads))
        pos += t.num_factors
    return out


def scale_spans_(spans: Sequence[tuple[nn.Parameter, int, int, int, bool]], factors: torch.Tensor) -> None:
    """In place on whole (single-device) parameters: each span times its factor (the oracle's clip; a
    ``plus_one`` gain ``w`` becomes ``f * w + (f - 1)``); factors of 1 touch nothing."""
    values = factors.tolist()
    for param, lo, hi, k, plus_one in spans:
        if values[k] != 1.0:
            scale_rows_(param.data.view(-1)[lo:hi], values[k], plus_one)
