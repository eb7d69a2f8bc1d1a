"""Per-head maximum attention logits, recorded during the forward for MuonClip (QK-clip).

MuonClip (Kimi K2 technical report, arXiv 2507.20534, §2.1) needs, for every attention layer and
query head ``h``, the largest pre-softmax logit of the optimizer step,
``S_max[h] = max over (batch, query i, key j allowed by the mask) of q_i^h · k_j^h * scaling``,
after RoPE, exactly as the softmax sees it. The attention reports it here; the clip
(:mod:`ds_muon.model.attention`, :mod:`ds_muon.core.qk_clip`) takes it once per optimizer step, reduces it over the data-parallel group
(all_reduce MAX) and rescales the heads' query and key weights.

Interface (shared by the attention side and the clip side):

* :func:`record_max_logits` ``(module, max_logits)``: called by an attention module (or by the
  ``ds_muon_sdpa`` attention function on its behalf) once per forward, with ``max_logits`` of shape
  ``(num_query_heads,)``, the max over this forward's batch and positions. The recorder keeps the
  element-wise running max per module over the micro-batches of the step (no host sync, stays on
  the logits' device, fp32). Calls made with autograd off (evaluation, ``torch.no_grad``) are ignored,
  so only training forwards count; a recompute under activation checkpointing records the same value
  again, which a max absorbs.
* :data:`RECORDER` ``.take(module)``: the running max of ``module`` since the last take, or ``None``
  if it recorded nothing; taking resets it. ``.peek(module)`` reads it without resetting (logging).

Computing the values: :func:`max_logits_per_head` takes the query and key an attention layer hands to
its softmax (after RoPE and any q/k norm) and returns the exact per-head max, query chunk by query
chunk, so no full ``(Sq, Sk)`` score matrix is held. HF models get it through the ``ds_muon_sdpa``
attention function (:mod:`ds_muon.model.hf_attention`); a custom attention calls
``record_max_logits(self, max_logits_per_head(q, k, scaling, mask, is_causal))``.
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
from torch import nn


class MaxLogitRecorder:
    """Running per-head max logits, keyed by attention module (held weakly).

    Shapes: every value is a ``(num_query_heads,)`` fp32 tensor on the device of the logits.
    """

    def __init__(self) -> None:
        self._max: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()
        self._stopped: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

    def wants(self, module: nn.Module) -> bool:
        """Whether a training forward of ``module`` should compute its max logits now: autograd on and the
        recording not stopped for it (:meth:`stop`; QK-clip's ``until_step`` window has passed)."""
        return torch.is_grad_enabled() and module not in self._stopped

    def stop(self, module: nn.Module) -> None:
        """Stop recording for ``module`` (its records are dropped; later :meth:`record` calls are ignored and
        :meth:`wants` is False). QK-clip calls it when its ``until_step`` window ends."""
        self._stopped.add(module)
        self._max.pop(module, None)

    def resume(self, module: nn.Module) -> None:
        """Undo :meth:`stop` for ``module`` (a checkpoint from inside QK-clip's ``until_step`` window was loaded
        after the window had ended)."""
        self._stopped.discard(module)

    def record(self, module: nn.Module, max_logits: torch.Tensor) -> None:
        """Fold ``max_logits`` ``(num_query_heads,)`` into ``module``'s running max (ignored with autograd off).

        Raises:
            ValueError: ``max_logits`` is not 1-D, or its length differs from an earlier record of ``module``.
        """
        if not self.wants(module):
            return
        if max_logits.dim() != 1:
            raise ValueError(f"record_max_logits expects one value per query head, shape (num_heads,); "
                             f"got shape {tuple(max_logits.shape)}")
        value = max_logits.detach().float()
        old = self._max.get(module)
        if old is None:
            self._max[module] = value.clone()
            return
        if old.shape != value.shape:
            raise ValueError(f"record_max_logits: {type(module).__name__} recorded {old.numel()} heads before and "
                             f"{value.numel()} now")
        torch.maximum(old, value, out=old)

    def take(self, module: nn.Module) -> Optional[torch.Tensor]:
        """``module``'s running max since the last take (and reset it), or ``None`` if it recorded nothing."""
        return self._max.pop(module, None)

    def peek(self, module: nn.Module) -> Optional[torch.Tensor]:
        """``module``'s running max since the last take, without resetting it (for logging), or ``None``."""
        return self._max.get(module)

    def clear(self) -> None:
        """Forget every record (and every :meth:`stop`)."""
        self._max.clear()
        self._stopped.clear()


RECORDER = MaxLogitRecorder()


def record_max_logits(module: nn.Module, max_logits: torch.Tensor) -> None:
    """Public API for custom attention: report this forward's per-head max logits ``(num_query_heads,)``.

    See the module docstring for the semantics; :data:`RECORDER` holds the values.
    """
    RECORDER.record(module, max_logits)


def wants_max_logits(module: nn.Module) -> bool:
    """Public API for custom attention: whether to compute this forward's max logits at all (autograd on, and
    QK-clip's ``until_step`` window not over for ``module``); skip :func:`max_logits_per_head` when False."""
    return RECORDER.wants(module)


#: Default chunk budget of :func:`max_logits_per_head`: at most this many score elements
#: (``B * H * chunk * Sk``) exist at once, i.e. 128 MiB in bf16 (256 MiB in fp32). A forward whose whole score
#: matrix fits (the 934M benchmark's 4 x 16 heads x 1024 x 1024) takes one chunk: about six kernels per layer,
#: so the recording adds little host time to a host-bound ZeRO-3 forward (docs/benchmarks.md, issue 27 item 5).
CHUNK_ELEMENTS = 1 << 26

#: A float (additive) mask entry at or below this value marks a masked position: HF's masks use the
#: dtype's most negative value or ``-inf``, older code ``-10000`` or ``-1e9``; no positional bias is
#: that negative where its softmax weight would not be zero anyway.
MASKED_BELOW = -1e4


def max_logits_per_head(query: torch.Tensor, key: torch.Tensor, scaling: float,
                        attention_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                        chunk_size: Optional[int] = None) -> torch.Tensor:
    """Exact per-query-head max of the pre-softmax attention logits, ``(H,)`` fp32.

    ``out[h] = max over batch b, query i, key j allowed by the mask of
    float(query[b, h, i] · key[b, h // G, j]) * scaling`` with ``G = H // Hkv`` (grouped-query
    attention: query head ``h`` reads kv head ``h // G``, as transformers' ``repeat_kv``). The dot
    products are computed by a matmul in the inputs' dtype (as SDPA computes the scores), the max is
    exact in that dtype and is converted to fp32 before the (positive) ``scaling`` multiplies it,
    so ``out`` equals the max of a full-matrix computation. This is the logit QK-clip controls
    (Kimi K2 technical report, arXiv 2507.20534, §2.1): an additive mask's finite values (a position
    bias) are not added.

    Computed under ``torch.no_grad`` over chunks of query positions, so the extra memory is
    ``O(B * H * chunk * Sk)`` elements (at most :data:`CHUNK_ELEMENTS` by default). Per chunk: one matmul
    (the ``G`` query heads of a kv head stacked against its keys: one bmm over ``B * Hkv``), one in-place mask
    (causal: of the diagonal block only, a cached triangle) and one contiguous last-dim max, reduced to
    ``(H,)`` once at the end. A forward whose whole score matrix fits the budget is one chunk (about six
    kernels: the cost in a host-bound training forward is the number of kernels, not their FLOPs); past it,
    a causal chunk skips the keys after its last query. The previous form (two matmuls and ~10 kernels
    per chunk of at most ``2**24`` scores, a reduction over non-contiguous dims) is
    ``benchmarks/max_logit_cost.py``'s ``previous_max_logits_per_head``.

    Args:
        query: ``(B, H, Sq, D)``, floating point.
        key: ``(B, Hkv, Sk, D)``, same dtype, ``H % Hkv == 0`` (``B`` may be 1 to broadcast).
        scaling: the softmax scale (usually ``D ** -0.5``), > 0.
        attention_mask: as SDPA takes it, broadcastable to ``(B, H, Sq, Sk)``: bool (``True`` =
            attend) or additive float (masked where ``<= MASKED_BELOW``, e.g. ``-inf`` or the dtype's
            min). Rows with no allowed key (left padding) contribute nothing.
        is_causal: SDPA's ``is_causal`` (no mask then): query ``i`` sees keys ``j <= i``, aligned to
            the upper left as SDPA does when ``Sq != Sk``.
        chunk_size: query positions per chunk; default: as many as keep ``B * H * chunk * Sk``
            within :data:`CHUNK_ELEMENTS` (all ``Sq`` when the whole score matrix fits).

    Returns:
        ``(H,)`` fp32 on the query's device; ``-inf`` for a head that saw no allowed position.

    Raises:
        ValueError: shapes that do not fit (ranks, head dims, ``H % Hkv``, the mask's broadcast),
            ``scaling <= 0``, ``chunk_size < 1``, or a mask together with ``is_causal``.
    """
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"max_logits_per_head expects query (B, H, Sq, D) and key (B, Hkv, Sk, D); got shapes "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    B, H, Sq, D = query.shape
    Bk, Hkv, Sk, Dk = key.shape
    if Dk != D or H % Hkv or Bk not in (1, B):
        raise ValueError(f"max_logits_per_head: key {tuple(key.shape)} does not fit query {tuple(query.shape)} "
                         "(same head dim, query heads a multiple of kv heads, same batch or 1)")
    if not scaling > 0:
        raise ValueError(f"max_logits_per_head: scaling must be > 0, got {scaling}")
    if attention_mask is not None and is_causal:
        raise ValueError("max_logits_per_head: pass either attention_mask or is_causal=True, not both (as SDPA)")
    G = H // Hkv
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(1, B * H * Sk))
    if chunk_size < 1:
        raise ValueError(f"max_logits_per_head: chunk_size must be >= 1, got {chunk_size}")
    mask = None if attention_mask is None else _grouped_mask(attention_mask, B, H, Hkv, Sq, Sk)
    if B == 0 or Sq == 0 or Sk == 0:
        return torch.full((H,), float("-inf"), dtype=torch.float32, device=query.device)
    with torch.no_grad():
        q = query.detach().reshape(B, Hkv, G, Sq, D)                # query head h = kv head h // G, member h % G
        kt = key.detach().transpose(-1, -2)                          # (Bk, Hkv, D, Sk): a view, read transposed
        if Bk != B:
            kt = kt.expand(B, Hkv, D, Sk)
        blocked = None if mask is None else ~mask
        # Per chunk of query rows: one matmul of the G query heads of each kv head against its keys (one bmm over
        # B * Hkv, no broadcast copy), one in-place mask (causal: of the diagonal block only), one last-dim amax;
        # then one reduction over (B, Sq). With one chunk (the whole score matrix within CHUNK_ELEMENTS) that is
        # about six kernels; with several, a causal chunk never computes the keys after its last query.
        rowmax = None if chunk_size >= Sq else torch.empty((B, Hkv, G, Sq), dtype=query.dtype, device=query.device)
        for i0 in range(0, Sq, chunk_size):
            i1 = min(i0 + chunk_size, Sq)
            c, end = i1 - i0, (min(i1, Sk) if is_causal else Sk)
            scores = torch.matmul(q[:, :, :, i0:i1].reshape(B, Hkv, G * c, D), kt[..., :end])
            scores = scores.view(B, Hkv, G, c, end)                  # (B, Hkv, G, c, end)
            if is_causal:
                # query i sees keys j <= i (upper-left aligned): in the block of keys [i0, i1) only the lower
                # triangle is allowed; keys at or after i1 were not computed
                if i0 < end:
                    scores[..., i0:end].masked_fill_(_future_keys(c, end - i0, query.device), float("-inf"))
            elif blocked is not None:
                scores.masked_fill_(blocked[:, :, :, i0:i1] if blocked.size(3) == Sq else blocked, float("-inf"))
            if rowmax is None:
                rowmax = scores.amax(dim=-1)                         # (B, Hkv, G, Sq)
            else:
                torch.amax(scores, dim=-1, out=rowmax[..., i0:i1])
        return rowmax.amax(dim=(0, 3)).reshape(H).float() * scaling


@functools.lru_cache(maxsize=32)
def _strict_upper(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """``(rows, cols)`` bool, True where ``col > row``: the future keys of a causal chunk's diagonal block (cached
    per shape and device, so a training step builds it once)."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).triu_(1)


def _future_keys(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """:func:`_strict_upper`, cached in eager mode; built in the graph under ``torch.compile`` (no cached tensors
    captured as constants)."""
    if torch.compiler.is_compiling():
        return _strict_upper.__wrapped__(rows, cols, device)
    return _strict_upper(rows, cols, device)


def _grouped_mask(mask: torch.Tensor, B: int, H: int, Hkv: int, Sq: int, Sk: int) -> torch.Tensor:
    """An SDPA mask broadcastable to ``(B, H, Sq, Sk)`` as a bool "allowed" view ``(B|1, Hkv|1, G|1, Sq|1, Sk|1)``."""
    if mask.dim() > 4:
        raise ValueError(f"max_logits_per_head: attention_mask has {mask.dim()} dims; expected at most 4 "
                         "(broadcastable to (B, H, Sq, Sk))")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if any(s not in (1, full) for s, full in zip(m.shape, (B, H, Sq, Sk))):
        raise ValueError(f"max_logits_per_head: attention_mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"(B, H, Sq, Sk) = {(B, H, Sq, Sk)}")
    if m.dtype != torch.bool:
        m = m > MASKED_BELOW
    if m.size(1) == 1:
        return m.unsqueeze(2)                                        # (B|1, 1, 1, Sq|1, Sk|1)
    return m.unflatten(1, (Hkv, H // Hkv))                           # (B|1, Hkv, G, Sq|1, Sk|1)
