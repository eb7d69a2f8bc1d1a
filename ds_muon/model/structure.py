"""What a model is made of, read from its modules and configs (layer ``model``: no torch.distributed).

The one place ds_muon reads a model's structure: parameter shapes (``ds_shape`` under
``deepspeed.zero.Init``), module kinds (matrix, conv, embedding), the model's configs, the repeated
layers, MoE expert containers and routers, and attention head geometry. Selection
(:mod:`ds_muon.model.selection`), Adam-mini's blocks (:mod:`ds_muon.model.adam_mini_blocks`) and
QK-clip's targets (:mod:`ds_muon.model.attention`) all ask here, so they agree: in particular
:func:`head_geometry` has one precedence rule for all three.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

MATRIX_MODULES: tuple[type, ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


CONV_TRANSPOSE_MODULES: tuple[type, ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


CONV_MODULES: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d) + CONV_TRANSPOSE_MODULES


EMBEDDING_MODULES: tuple[type, ...] = (nn.Embedding, nn.EmbeddingBag)


# Hugging Face's GPT-2 style Conv1D is a linear layer with a transposed weight. Matched by class
# name so transformers stays an optional dependency.
MATRIX_CLASS_NAMES = ("Conv1D",)


def param_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's logical shape: ``ds_shape`` under ZeRO-3 partitioning, else ``shape``."""
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if ds_shape is None else tuple(ds_shape)


def param_numel(p: torch.Tensor) -> int:
    """Logical element count (``ds_numel`` under ZeRO-3 partitioning, else ``numel()``)."""
    ds_numel = getattr(p, "ds_numel", None)
    return int(p.numel() if ds_numel is None else ds_numel)


def int_attrs(obj: Any, names: tuple[str, ...]) -> set[int]:
    """The positive int values of the attributes ``names`` of ``obj`` (a config)."""
    out = set()
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out.add(value)
    return out


def model_configs(model: nn.Module) -> list[Any]:
    """Every distinct ``config`` object of the model and its submodules, with their text configs."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or isinstance(cfg, (dict, str, int, float)) or id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        get_text = getattr(cfg, "get_text_config", None)
        if callable(get_text):
            try:
                text = get_text()
            except Exception:  # noqa: BLE001 - a config without a text part
                text = None
            if text is not None:
                seen.setdefault(id(text), text)
    return list(seen.values())


def declared(module: nn.Module, method: str) -> Any:
    """``module.<method>()`` (e.g. ``get_output_embeddings``), or None when it is missing or raises."""
    fn = getattr(module, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a getter that does not apply to this module declares nothing
        return None


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


# Config keys that hold a model's number of repeated layers (transformers: num_hidden_layers; GPT-2: n_layer;
# T5/Bart-style: num_layers, encoder_layers, decoder_layers).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers")


def _is_layer_candidate(m: nn.Module) -> bool:
    """A module that can be a repeated layer: neither a matrix nor a plain container."""
    return not is_matrix_module(m) and not isinstance(m, CONTAINERS)


def repeated_layer_ids(model: nn.Module) -> set[int]:
    """``id()`` of every module inside the repeated layers (see the module docstring), and inside any
    other instance of a repeated layer's class (an MTP module's extra decoder layer).

    A ``ModuleList``/``Sequential`` holds repeated layers when its children are layer candidates
    (:func:`_is_layer_candidate`) and either (a) there are two or more of them, all of one class, or
    (b) their number is a layer count some config of the model states (``num_hidden_layers``, ...):
    a 1-layer model, or layers of several classes (hybrid attention/SSM stacks).
    """
    counts = set().union(*(int_attrs(c, LAYER_COUNT_KEYS) for c in model_configs(model)))
    layer_types: set[type] = set()
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m.children())
        if not children or not all(_is_layer_candidate(c) for c in children):
            continue
        if (len(children) >= 2 and len({type(c) for c in children}) == 1) or len(children) in counts:
            layer_types.update(type(c) for c in children)
    layers = [m for m in model.modules() if type(m) in layer_types]
    return {id(x) for layer in layers for x in layer.modules()}


def is_depthwise_conv(m: nn.Module) -> bool:
    """A grouped convolution whose per-group matrix has one row (weight ``(C, 1, *kernel)`` with
    ``groups == C``, e.g. Mamba's depthwise ``conv1d``): every channel has its own filter and there
    is no matrix to orthogonalize (Newton–Schulz of one row only normalizes it)."""
    if not isinstance(m, CONV_MODULES) or m.groups <= 1:
        return False
    rows = m.in_channels if isinstance(m, CONV_TRANSPOSE_MODULES) else m.out_channels
    return rows // m.groups == 1


def is_matrix_module(m: nn.Module) -> bool:
    """A linear/conv layer (or Hugging Face's GPT-2 ``Conv1D``): a module whose weight is a matrix."""
    return isinstance(m, MATRIX_MODULES) or type(m).__name__ in MATRIX_CLASS_NAMES


# ------------------------------------------------------------------------------------------------
# MoE experts and routers, fused and per-head matrix views (docs/design.md, "Matrix views")
# ------------------------------------------------------------------------------------------------
# Config keys that hold a model's number of (routed) experts, in the transformers MoE configs
# (Mixtral/GPT-OSS/DeepSeek-V3/OLMoE/Phimoe: num_local_experts; Qwen2/3-MoE, OLMoE: num_experts;
# DeepSeek: n_routed_experts; DBRX: ffn_config.moe_num_experts).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


MOE_RULE = ("experts = a module whose >=2-D parameters (biases aside) are all 3-D with one leading size E, E = the "
            "model config's expert count (num_experts, num_local_experts, n_routed_experts, moe_num_experts) or the "
            "module's num_experts: Muon, one matrix per expert, a fused gate_up (E, 2I, H) as gate and up halves, "
            "(E, H, 2I) as gate and up interleaved (GPT-OSS); expert biases (E, n): AdamW\n"
            "router/gate = a matrix next to the experts (same parent module), or the one matrix of a router module "
            "there (DeepSpeed AutoEP's router.gate), with E or 1 output rows (E: all experts, also under expert "
            "parallelism): AdamW\n"
            "shared experts = ordinary hidden linear layers: Muon")


def text_config(model: nn.Module):
    """``model.config.get_text_config()`` where it has one (multimodal models), else ``model.config`` (or None)."""
    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text()
        except Exception:  # noqa: BLE001 - an unusual config: use it as it is
            return cfg
    return cfg


def positive_int(x) -> Optional[int]:
    """``x`` if it is an int >= 1 (not a bool), else None."""
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 1 else None


def expert_counts(cfg) -> set[int]:
    """The expert counts (>= 2) a model config states (:data:`EXPERT_COUNT_KEYS`, DBRX's ``ffn_config``)."""
    counts = {positive_int(getattr(cfg, k, None)) for k in EXPERT_COUNT_KEYS}
    counts.add(positive_int(getattr(getattr(cfg, "ffn_config", None), "moe_num_experts", None)))
    return {c for c in counts if c and c >= 2}


def is_bias_name(leaf: str) -> bool:
    """A parameter's own name (the last component of its ``named_parameters()`` name) says it is a bias:
    ``bias``, ``*_bias`` (``in_proj_bias`` of ``nn.MultiheadAttention``, GPT-OSS's expert ``gate_up_proj_bias``
    ``(E, 2I)`` and ``down_proj_bias`` ``(E, H)``, Qwen3-Next's ``dt_bias``) or ``bias_*`` (``bias_k``/``bias_v``)."""
    leaf = leaf.lower()
    return leaf == "bias" or leaf.endswith("_bias") or leaf.startswith("bias_")


# Hugging Face Trainer's no-decay name patterns (transformers 5.x Trainer.get_decay_parameter_names), besides
# its type rule (inside an nn.LayerNorm): the full parameter name, lower-cased, searched for each.
HF_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def is_norm_module(m: nn.Module) -> bool:
    """A normalization layer: a class name with "Norm" in it (``nn.LayerNorm``, ``nn.GroupNorm``, BatchNorm,
    every transformers ``*RMSNorm``; HF Trainer's type rule is ``nn.LayerNorm`` only, its name patterns catch the
    rest)."""
    return "norm" in type(m).__name__.lower()


def decay_exempt_names(model: nn.Module) -> set[str]:
    """Names of the parameters that get no weight decay by Hugging Face Trainer's convention: norm weights and
    biases (config key ``decay_norms_and_biases: false``, docs/selection.md, "Weight decay").

    A parameter is exempt when its module is a norm (:func:`is_norm_module`), its own name is a bias
    (:func:`is_bias_name`), or its full name matches one of Trainer's patterns (:data:`HF_NO_DECAY_PATTERNS`):
    the union of Trainer's rule and the structural one, so a model Trainer would treat one way is treated so here.
    """
    import re
    patterns = [re.compile(p) for p in HF_NO_DECAY_PATTERNS]
    out = set()
    for module_name, m in model.named_modules():
        for leaf, _ in m.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            if is_norm_module(m) or is_bias_name(leaf) or any(p.search(name.lower()) for p in patterns):
                out.add(name)
    return out


# Config keys holding the width of a model's raw input (image channels; audio features), for input layers that
# no get_input_embeddings() declares.
RAW_INPUT_WIDTH_KEYS = ("num_channels", "num_mel_bins")


def input_layer_ids(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): module name}`` of the >=2-D parameters of the input layers: the linear/conv layers that read
    the model's raw input (pixels, audio features) and make its first hidden states (docs/selection.md, "Input
    layers"). Token embeddings (``nn.Embedding``) are not listed here (they have their own rule).

    Found by structure, not by name:

    * declared: the matrix modules in what ``get_input_embeddings()`` of the model or of any submodule returns when
      that is not an ``nn.Embedding`` (ViT's ``embeddings.patch_embeddings``, whose ``projection`` is a Conv2d on the
      pixels; CLIP/SigLIP's ``patch_embedding``; Whisper's encoder ``conv1`` on the log-mel features);
    * by width: a conv outside the repeated layers whose input channels are a config's raw-input width
      (:data:`RAW_INPUT_WIDTH_KEYS`: ``num_channels``, ``num_mel_bins``).
    """
    found: dict[int, str] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        emb = declared(m, "get_input_embeddings")
        if not isinstance(emb, nn.Module) or isinstance(emb, EMBEDDING_MODULES):
            continue
        for sub in emb.modules():
            if is_matrix_module(sub):
                for p in sub.parameters(recurse=False):
                    if len(param_shape(p)) >= 2:
                        found.setdefault(id(p), names.get(id(sub), type(sub).__name__))
    widths = set().union(*(int_attrs(c, RAW_INPUT_WIDTH_KEYS) for c in model_configs(model)))
    if widths:
        inside = repeated_layer_ids(model)
        for name, m in model.named_modules():
            if isinstance(m, CONV_MODULES) and id(m) not in inside and m.in_channels in widths:
                for p in m.parameters(recurse=False):
                    if len(param_shape(p)) >= 2:
                        found.setdefault(id(p), name)
    return found


def is_multihead_attention(m: nn.Module) -> bool:
    """``torch.nn.MultiheadAttention`` (also inside ``nn.TransformerEncoderLayer``/``DecoderLayer``): its Q/K/V
    input projection is a bare parameter ``in_proj_weight`` ``(3E, E)`` (or ``q/k/v_proj_weight`` when
    ``kdim``/``vdim`` differ), not a Linear."""
    return isinstance(m, nn.MultiheadAttention)


MHA_PROJECTIONS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def expert_containers(model: nn.Module, counts: set[int]) -> dict[str, int]:
    """``{module name: E}`` of the expert containers (see :data:`MOE_RULE`); expert biases (``(E, n)``,
    named as biases: GPT-OSS's ``gate_up_proj_bias``, ``down_proj_bias``) are biases, not experts."""
    found = {}
    for name, m in model.named_modules():
        if is_matrix_module(m) or isinstance(m, EMBEDDING_MODULES):
            continue
        shapes = [param_shape(p) for leaf, p in m.named_parameters(recurse=False)
                  if len(param_shape(p)) >= 2 and not is_bias_name(leaf)]
        if not shapes or any(len(s) != 3 for s in shapes) or len({s[0] for s in shapes}) != 1:
            continue
        e = shapes[0][0]
        own = {positive_int(getattr(m, k, None)) for k in EXPERT_COUNT_KEYS}
        if e >= 2 and (e in counts or e in own):
            found[name] = e
    return found


def router_ids(model: nn.Module, containers: dict[str, int], counts: frozenset[int] | set[int] = frozenset()) -> set[int]:
    """``id()`` of the router matrices of the expert containers (see :data:`MOE_RULE`).

    A router is a 2-D matrix next to an expert container (in a child of the container's parent) with ``E`` or 1
    output rows: the child's own weight (transformers' ``gate``, ``shared_expert_gate``), or, for a child holding no
    matrix of its own, the only matrix in its subtree (a router module wrapping its gate: DeepSpeed AutoEP's
    ``router.gate``, an ``nn.Linear`` inside its ``TokenChoiceTopKRouter``). ``E`` is the container's leading size,
    an expert count the model config states (``counts``, :func:`expert_counts`) or one the parent module states
    (``num_experts``, ``num_local_experts``, ...): under expert parallelism the container holds only this rank's
    ``E / EP`` experts while the router still scores all ``E``.

    Args:
        model: the model (plain or under ``deepspeed.zero.Init``: shapes from :func:`param_shape`).
        containers: ``{module name: leading size}`` from :func:`expert_containers`.
        counts: the config's expert counts.
    """
    modules = dict(model.named_modules())
    ids: set[int] = set()
    for name, e in containers.items():
        parent = modules[name.rpartition(".")[0]] if "." in name else model
        rows_ok = {e, 1} | set(counts) | int_attrs(parent, EXPERT_COUNT_KEYS)
        for child in parent.children():
            if child is modules[name]:
                continue
            candidates = [(child, p) for p in child.parameters(recurse=False)]
            if not any(len(param_shape(p)) >= 2 for _, p in candidates):  # a router module: its one matrix
                inner = [(m, p) for m in child.modules() for p in m.parameters(recurse=False)
                         if len(param_shape(p)) >= 2]
                candidates = inner if len(inner) == 1 else []
            for owner, p in candidates:
                shape = param_shape(p)
                rows = shape[1] if len(shape) == 2 and type(owner).__name__ in MATRIX_CLASS_NAMES else shape[0]
                if len(shape) == 2 and rows in rows_ok:
                    ids.add(id(p))
    return ids


def config_head_geometry(cfg) -> Optional[tuple[int, int, int]]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` from a model config, or None."""
    nh = positive_int(getattr(cfg, "num_attention_heads", None))
    if nh is None:
        return None
    nkv = positive_int(getattr(cfg, "num_key_value_heads", None)) or nh
    hd = positive_int(getattr(cfg, "head_dim", None))
    hidden = positive_int(getattr(cfg, "hidden_size", None))
    if hd is None and hidden and hidden % nh == 0:
        hd = hidden // nh
    return (nh, nkv, hd) if hd else None


def head_geometry(attention: Optional[nn.Module], model_config: Any = None) -> Optional[tuple[int, int, int]]:
    """``(num_heads, num_kv_heads, head_dim)`` of an attention module: the one rule selection, Adam-mini and
    QK-clip share.

    Precedence, first that states the geometry: (1) the attention module itself (``num_attention_heads``/
    ``num_heads``/``n_heads``/``n_head`` and ``head_dim``/``head_size``; ``num_key_value_heads``/
    ``num_kv_heads``/``n_kv_heads`` or ``num_key_value_groups``); (2) the module's own ``config``
    (transformers' attention modules keep their tower's config: a vision encoder's differs from the text
    model's); (3) ``model_config`` (the model's text config, :func:`text_config`). A ``head_dim`` the module
    states wins over a config's (the module knows its own head width).

    Args:
        attention: the attention module (None: only ``model_config`` is read).
        model_config: a config with ``num_attention_heads`` (``num_key_value_heads``, ``head_dim``,
            ``hidden_size``), or None.

    Returns:
        The geometry (counts of heads, elements per head), or None when no source states it.
    """
    geometry = None
    if attention is not None:
        first = lambda *names: next((v for v in (positive_int(getattr(attention, n, None)) for n in names) if v), None)  # noqa: E731
        nh = first("num_attention_heads", "num_heads", "n_heads", "n_head")
        hd = first("head_dim", "head_size")
        if nh is not None and hd is not None:
            nkv = first("num_key_value_heads", "num_kv_heads", "n_kv_heads")
            groups = first("num_key_value_groups")
            if nkv is None and groups and nh % groups == 0:
                nkv = nh // groups
            geometry = (nh, nkv or nh, hd)
        else:
            geometry = config_head_geometry(getattr(attention, "config", None))
    if geometry is None:
        geometry = config_head_geometry(model_config)
    if geometry is not None and attention is not None:
        hd = positive_int(getattr(attention, "head_dim", None))
        if hd:
            geometry = (geometry[0], geometry[1], hd)
    return geometry
