"""The single-device reference optimizer (layer ``oracle``): Muon for hidden matrices, AdamW for the rest.

This class is the oracle that every distributed ds_muon path is compared against, parameter by
parameter. It favours clarity over speed; its math is :mod:`ds_muon.core` (the sharded step uses the
same functions).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from torch import nn

from ..config import MuonOptimizerParams, parse_muon_params
from ..core.adam_update import adamw_update_
from ..core.dtypes import resolve_ns_dtype
from ..core.matrix import matrix_view, orthogonalize_blocks_
from ..core.muon_update import apply_update_, momentum_update_, scaled_orthogonalizer, set_aside
from ..core.qk_clip import factor_vector
from ..errors import ConfigError
from ..model.attention import (check_recorded, factor_spans, find_clip_targets, scale_spans_, stop_recording,
                               sync_recording, take_max_logits)
from ..model.param_groups import split_param_groups
from ..model.selection import SelectionRules
from ..model.structure import param_shape
from ..names import MOMENTUM_KEY, MUON, QK_CLIP_STEPS_KEY, SPLIT_ATTR, algorithm_of

#: MuonAdamW's keywords whose None means "the config's default" (not a value of the key: the default is mutable, or
#: the key has an alias that must not be given together with it).
DEFAULT_WHEN_NONE = ("update_scale", "betas", "eps", "muon_params", "adamw_params", "muon_splits", "qk_clip")


class MuonAdamW(torch.optim.Optimizer):
    r"""Muon with an auxiliary AdamW, on one device.

    For a parameter ``W`` with ``use_muon=True`` (shape ``(m, n)``, a stack ``(b, m, n)``, or a conv
    weight ``(out, in, kh, kw)`` seen as ``(out, in*kh*kw)``), with gradient ``G`` (any float dtype;
    all optimizer math is fp32):

    .. math::
        M &\leftarrow \beta M + (1-\beta) G                         && \text{momentum (computed in fp32, stored in momentum\_dtype)}\\
        U &\leftarrow \text{nesterov} \; ? \; (1-\beta) G + \beta M : M \\
        O &\leftarrow \mathrm{NS}_k(U) \cdot s(m, n)                 && \text{Newton–Schulz, } k=\text{ns\_steps}\\
        W &\leftarrow W (1 - \eta \lambda) - \eta O                  && \text{decoupled weight decay}

    where ``NS`` and the scale ``s`` apply to each block of the parameter's matrix view
    (:func:`ds_muon.core.matrix.matrix_view`: one matrix, one per stacked expert, gate and up apart,
    Q/K/V or heads apart, or a declared split; recorded on the parameter by
    :func:`ds_muon.model.selection.tag_model` as ``param.ds_muon_split``), ``(m, n)`` being the block's shape,
    with ``s = sqrt(max(1, m/n))`` (``update_scale="shape"``, Keller Jordan,
    https://kellerjordan.github.io/posts/muon/) or ``s = 0.2 sqrt(max(m, n))``
    (``"rms_match"``, Moonlight, arXiv 2502.16982). ``NS`` is selected by ``ns_method``
    (:mod:`ds_muon.core.newton_schulz`). Other parameters get AdamW (Loshchilov & Hutter,
    arXiv 1711.05101) exactly as ``torch.optim.AdamW``:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        W &\leftarrow W (1 - \eta\lambda) - \eta \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    **No gradient, no step.** A parameter whose ``.grad`` is ``None`` is skipped (its state is
    untouched), as in ``torch.optim``. A Muon parameter is also skipped block by block: each of the
    ``b`` matrices of its Newton–Schulz view (:func:`ds_muon.core.matrix.ns_view_shape`, e.g. one expert
    of a stacked ``(E, m, n)`` parameter) whose gradient is exactly zero in every element (an expert
    no token was routed to, a branch not taken) keeps its momentum and weights as they are: no
    momentum decay, no update from the old momentum (Newton–Schulz would normalize it back to a
    full-size step) and no weight decay. The ZeRO-3 optimizer applies the same rule, where a missing
    gradient reads as zeros. An AdamW parameter with a zero (not ``None``) gradient is stepped, as in
    ``torch.optim.AdamW``.

    **QK-clip** (``qk_clip={"enabled": True, ...}``, MuonClip, Kimi K2 arXiv 2507.20534 §2.1): after
    all updates of a step, the query/key rows of each attention head whose recorded max logit of the
    step exceeded the threshold are scaled down (:mod:`ds_muon.core.qk_clip`, :mod:`ds_muon.model.attention`; the attention records its
    logits with :func:`ds_muon.record_max_logits`). Single-device: the step's max is over everything
    this process recorded since the last step (no all_reduce). The figures of the last step are in
    ``qk_clip_stats`` (``heads_clipped``, ``max_logit``, ``max_logit_per_layer``).

    Args:
        params: an ``nn.Module`` (parameters selected by :func:`ds_muon.model.selection.tag_model`),
            parameters tagged ``use_muon``, or param-group dicts. Group keys override the
            defaults per group (``lr``/``weight_decay`` apply to both halves; ``muon_lr``,
            ``adam_lr``, ``adam_weight_decay`` to one).
        model: the model whose attention modules QK-clip acts on (:func:`ds_muon.model.attention.find_clip_targets`);
            only with ``qk_clip`` enabled; defaults to ``params`` when that is an ``nn.Module``.
        lr, muon_lr, ..., qk_clip: keyword-only, the keys of the ``"Muon"`` DeepSpeed optimizer config with the
            same meaning, bounds and defaults (:class:`ds_muon.config.MuonOptimizerParams`; each key's unit and source
            are in docs/configuration.md): ``lr`` shared learning rate, ``muon_lr``/``adam_lr`` per half (None: ``lr``),
            ``momentum`` beta, ``momentum_dtype``, ``nesterov``, ``ns_method``/``ns_steps``/``ns_dtype`` (Newton–Schulz),
            ``update_scale``, ``weight_decay`` (decoupled), ``adam_weight_decay`` (None: ``weight_decay``),
            ``decay_norms_and_biases``, ``betas``/``eps`` (AdamW), ``muon_params``/``adamw_params`` (name globs),
            ``per_head_muon``, ``muon_splits``, ``qk_clip`` (a dict of :class:`ds_muon.config.QKClipParams`'s keys).
            ``ns_compile``, ``ns_autotune``, ``elementwise_compile``, ``overlap_backward``, ``overlap_cuda_graphs``, ``exchange_dtype``,
            ``exchange_bucket_mb``, ``tp_mode``,
            ``max_consecutive_skipped_steps``, ``torch_adam``, ``foreach``, ``adam_w_mode`` and
            ``fp32_optimizer_states`` are accepted so that a config's params dict can be passed as ``**params``;
            they have no effect on one device. A None for ``update_scale``, ``betas``, ``eps``, ``muon_params``,
            ``adamw_params``, ``muon_splits`` or ``qk_clip`` means the config's default (``"shape"``, ``(0.9,
            0.999)``, ``1e-8``, ``[]``, ``[]``, ``{}``, QK-clip off).
        **aliases: the aliases the config accepts, ``adam_betas`` (``betas``), ``adam_eps`` (``eps``) and
            ``adjust_lr_fn`` (``update_scale``; torch's ``"original"``/``"match_rms_adamw"`` are accepted as
            ``"shape"``/``"rms_match"`` under either name). Any other keyword is refused with a
            :class:`~ds_muon.config.ConfigError` that names it (with "did you mean"), as in a config.

    Raises:
        ds_muon.config.ConfigError: a bad hyperparameter (names the key and the allowed values);
            ``qk_clip`` enabled without a model, without an attention module it recognises, or with
            query/key weights this optimizer does not train.
        ValueError: ``use_muon=True`` on a parameter with fewer than 2 dims.
        RuntimeError: (at ``step``) ``qk_clip`` is enabled and no attention recorded its max logits.

    State per Muon parameter: ``momentum_buffer`` (the parameter's shape, fp32 or bf16 by
    ``momentum_dtype``; see :func:`ds_muon.core.muon_update.momentum_update_` for where bf16 rounds). Per AdamW
    parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (fp32). The state dict also holds QK-clip's step count
    (:meth:`state_dict`).
    """

    def __init__(self, params: Any, model: Optional[nn.Module] = None, *,
                 lr: float = 0.02,
                 muon_lr: Optional[float] = None,
                 adam_lr: Optional[float] = None,
                 momentum: float = 0.95,
                 momentum_dtype: Literal["float32", "bfloat16"] = "float32",
                 nesterov: bool = True,
                 ns_method: Literal["standard", "gram", "polar_express"] = "standard",
                 ns_steps: int = 5,
                 ns_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
                 ns_compile: bool = True,
                 ns_autotune: bool = False,
                 elementwise_compile: Union[Literal["auto"], bool] = "auto",
                 overlap_backward: Union[Literal["auto"], bool] = "auto",
                 overlap_cuda_graphs: bool = True,
                 update_scale: Optional[Literal["shape", "rms_match", "original", "match_rms_adamw"]] = None,
                 weight_decay: float = 0.0,
                 adam_weight_decay: Optional[float] = None,
                 decay_norms_and_biases: bool = False,
                 betas: Optional[tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 adam_w_mode: bool = True,
                 torch_adam: bool = False,
                 foreach: Optional[bool] = None,
                 fp32_optimizer_states: bool = True,
                 exchange_dtype: Literal["auto", "bfloat16", "float32"] = "auto",
                 exchange_bucket_mb: float = 256.0,
                 tp_mode: Literal["full", "shard"] = "full",
                 max_consecutive_skipped_steps: int = 50,
                 muon_params: Optional[list[str]] = None,
                 adamw_params: Optional[list[str]] = None,
                 per_head_muon: bool = False,
                 muon_splits: Optional[dict[str, Any]] = None,
                 qk_clip: Optional[dict[str, Any]] = None,
                 **aliases: Any) -> None:
        given = dict(locals())  # the keywords above by name (no other local exists yet)
        # one dict of the keys given, validated exactly as a config's optimizer.params (ds_muon.config)
        hyperparameters = {k: v for k, v in given.items() if k in MuonOptimizerParams.model_fields
                           and not (v is None and k in DEFAULT_WHEN_NONE)}
        cfg = parse_muon_params({**hyperparameters, **aliases}, path="MuonAdamW")
        if model is None and isinstance(params, nn.Module):
            model = params
        groups = split_param_groups(params, cfg.muon_group_defaults(), cfg.adamw_group_defaults(),
                                    SelectionRules.from_params(cfg), cfg.decay_norms_and_biases)
        super().__init__(groups, {})
        self.config = cfg
        self.qk_clip_targets = []
        self._qk_spans: list = []
        self._qk_clip_steps = 0  # steps that reached the clip (the until_step window counts them)
        self.qk_clip_stats: Optional[dict] = None
        if cfg.qk_clip.enabled:
            if model is None:
                raise ConfigError("MuonAdamW.qk_clip: QK-clip needs the model to find its attention modules; pass "
                                  "model=<the nn.Module> (or the module itself as params)")
            self.qk_clip_targets = find_clip_targets(model)
            mine = {id(p) for g in self.param_groups for p in g["params"]}
            for t in self.qk_clip_targets:
                for hr in t.rows:
                    if id(hr.param) not in mine:
                        raise ConfigError(f"MuonAdamW.qk_clip: {hr.name!r} ({t.name}) is not trained by this optimizer "
                                          "(frozen, or left out of params); QK-clip scales the query and key weights "
                                          "after each step, so they must be trainable (or disable qk_clip)")
            self._qk_spans = factor_spans(self.qk_clip_targets)

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict`` plus QK-clip's step counter under
        :data:`ds_muon.names.QK_CLIP_STEPS_KEY` (an int: the optimizer steps taken, which the ``until_step`` window
        counts; saved with QK-clip off too)."""
        state_dict = super().state_dict()
        state_dict[QK_CLIP_STEPS_KEY] = self._qk_clip_steps
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping each state tensor's saved dtype, and QK-clip's step
        counter.

        Torch casts floating-point state to each parameter's dtype; here Adam moments stay fp32 and
        momentum stays in its ``momentum_dtype`` whatever the model dtype (docs/design.md), so they are
        restored from ``state_dict`` without that cast.

        QK-clip's counter comes from :data:`ds_muon.names.QK_CLIP_STEPS_KEY`. A state dict saved before the oracle
        saved it has no such key: the counter is then the largest AdamW ``step`` in
        it (every step advances the ``step`` of each AdamW parameter that has a gradient, so this is exact
        whenever some AdamW parameter, an embedding or a norm, got a gradient at every step; else it is lower and
        the window stays open for the difference), 0 with no AdamW state. The max-logit recording then follows
        the counter (:func:`ds_muon.model.attention.sync_recording`): stopped when the ``until_step`` window is
        over, on again otherwise (also after loading an earlier state dict into an oracle that had stopped it).
        """
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, copy=True)
        steps = state_dict.get(QK_CLIP_STEPS_KEY)
        if steps is None:  # saved before the counter was
            steps = max((int(st["step"]) for st in state_dict["state"].values() if "step" in st), default=0)
        self._qk_clip_steps = int(steps)
        if self.qk_clip_targets:
            sync_recording(self.qk_clip_targets, self._qk_clip_steps, self.config.qk_clip.until_step)

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update to every parameter that has a gradient. Returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if algorithm_of(group) == MUON:  # groups of checkpoint format 1 as first written have no "algorithm"
                    self._muon(p, group)
                else:
                    self._adamw(p, group)
        if self.qk_clip_targets:
            self._qk_clip()
        return loss

    def _qk_clip(self) -> None:
        """QK-clip after the update (see the class docstring and :mod:`ds_muon.core.qk_clip`); after the
        ``until_step`` window it clips nothing and stops the recording (:func:`stop_recording`)."""
        targets = self.qk_clip_targets
        clip = self.config.qk_clip
        self._qk_clip_steps += 1
        if clip.until_step is not None and self._qk_clip_steps > clip.until_step:
            stop_recording(targets)
            self.qk_clip_stats = None
            return
        s = take_max_logits(targets, torch.device("cpu"))
        check_recorded(s)
        factors, self.qk_clip_stats = factor_vector(targets, s, clip.threshold, clip.alpha)
        scale_spans_(self._qk_spans, factors)
        if clip.until_step is not None and self._qk_clip_steps == clip.until_step:
            stop_recording(targets)  # the next forwards need not record

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if MOMENTUM_KEY not in state:
            state[MOMENTUM_KEY] = torch.zeros_like(p, dtype=getattr(torch, group["momentum_dtype"]))
        m = state[MOMENTUM_KEY]
        g = p.grad.to(torch.float32, copy=True).view(-1)  # a copy: the update is written into it
        # No gradient, no step (per matrix of the (b, rows, cols) view: one expert of a stack): a block
        # whose gradient is exactly zero keeps its momentum and weights. Every block of the matrix view
        # lies inside one of these b matrices, so the others' update is unaffected.
        view = matrix_view(param_shape(p), getattr(p, SPLIT_ATTR, None))
        b = view.ns_shape[0]
        idle = g.view(b, -1).eq(0).all(dim=1)  # (b,) bool
        if bool(idle.all()):
            return
        size = g.numel() // b
        put_back = (set_aside([(k * size, size) for k in torch.nonzero(idle).flatten().tolist()], m.view(-1),
                              p.data.view(-1)) if bool(idle.any()) else None)
        u = momentum_update_(m.view(-1), g, group["momentum"], group["nesterov"])
        ns_dtype = resolve_ns_dtype(group["ns_dtype"], group["ns_method"], p.device)
        scaled_ns = scaled_orthogonalizer(group["ns_method"], group["ns_steps"], ns_dtype, group["update_scale"],
                                          out_dtype=torch.float32)  # (1, *batch, rows, cols) -> the same

        o = u.reshape(1, -1).clone()  # each block of the view in place; u may be the momentum itself
        orthogonalize_blocks_(o, view, scaled_ns)
        apply_update_(p, o.view(p.shape).to(p.dtype), group["lr"], group["weight_decay"])
        if put_back is not None:  # idle blocks: momentum and weights as they were
            put_back()

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        adamw_update_(p, p.grad.float(), state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"],
                      tuple(group["betas"]), group["eps"], group["weight_decay"])
