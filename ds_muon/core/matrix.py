"""How Muon sees a parameter as a matrix, and how it scales the orthogonalized update.

Pure shape arithmetic (layer ``core``) shared by the single-device oracle and the sharded owner step,
so both orthogonalize exactly the same matrices (docs/design.md, "Matrix views"). Selection
(:mod:`ds_muon.model.views`) decides each parameter's :class:`Split` and records it on the parameter
as ``ds_muon.names.SPLIT_ATTR``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    import torch

from .ns_cost import DEFAULT_QUINTIC_FORM, ns_flops

UPDATE_SCALES = ("shape", "rms_match")


def ns_view_shape(shape: Sequence[int], conv: bool = False) -> tuple[int, int, int]:
    """The (batch, rows, cols) view Newton–Schulz runs on for a parameter of ``shape``.

    * 2-D ``(m, n)`` -> ``(1, m, n)``.
    * 3-D ``(b, m, n)`` (stacked experts) -> a batch of ``b`` matrices ``(b, m, n)``.
    * 4-D and up, conv weights ``(out, in, kh, kw)`` -> ``(1, out, in*kh*kw)``, as in
      Keller Jordan's Muon (https://kellerjordan.github.io/posts/muon/).
    * ``conv=True`` (a convolution weight ``(out, in, *kernel)``, also a 3-D ``nn.Conv1d`` one):
      ``(1, out, in*prod(kernel))``, never a stack.

    Raises:
        ValueError: for 0-D and 1-D shapes, which Muon does not orthogonalize (use AdamW).
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"Muon needs a parameter with >= 2 dims, got shape {shape}; 0-D/1-D parameters use AdamW")
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) == 3 and not conv:
        return shape  # type: ignore[return-value]
    return (1, shape[0], math.prod(shape[1:]))


def update_scale(rows: int, cols: int, mode: str = "shape") -> float:
    """Multiplier applied to the orthogonalized update of one ``rows x cols`` matrix.

    * ``"shape"``: ``sqrt(max(1, rows/cols))`` (Keller Jordan's Muon).
    * ``"rms_match"``: ``0.2 * sqrt(max(rows, cols))`` so the update RMS matches AdamW's
      (Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982, Moonlight).

    Raises:
        ValueError: for an unknown ``mode``.
    """
    if mode == "shape":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "rms_match":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"update_scale must be one of {UPDATE_SCALES}, got {mode!r}")


# ------------------------------------------------------------------------------------------------
# Matrix views: the blocks Newton–Schulz orthogonalizes separately (docs/design.md, "Matrix views")
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """How each matrix of a parameter is cut into blocks: contiguous row and/or column sizes.

    The matrix is the parameter's 2-D form (conv ``(out, in*kh*kw)``), or each entry of a stacked
    3-D parameter ``(E, rows, cols)``. ``rows``/``cols`` list block sizes along that axis in order
    (``None``: the axis is not cut); the blocks are the grid of both. Examples: a fused gate/up
    ``(2I, H)`` is ``rows=(I, I)``; a fused QKV ``((nh + 2 nkv) hd, H)`` is ``rows=(nh hd, nkv hd,
    nkv hd)``, per head ``rows=(hd,) * (nh + 2 nkv)``; GPT-2's ``Conv1D`` ``c_attn`` ``(H, 3H)``
    is ``cols=(H, H, H)``.

    Attributes:
        rows, cols: block sizes (elements along that axis, each >= 1), or ``None``.
        label: how the split came about, for the start-up summary (``"gate/up"``, ``"q/k/v"``,
            ``"per head"``, ``"declared"``, ``"conv"``, ``"conv per group"``).
        interleave: ``k > 1``: the columns are ``k`` interleaved blocks, block ``j`` holding columns
            ``j, j+k, j+2k, ...`` (GPT-OSS's experts store gate and up alternating along the last dimension and
            read ``gate = x[..., ::2]``, ``up = x[..., 1::2]``: ``interleave=2``). Only with ``cols`` unset; row
            blocks still apply.
        conv: the parameter is a convolution weight ``(out, in/groups, *kernel)``: its matrix is
            ``(out, in/groups * prod(kernel))`` (:func:`ns_view_shape` with ``conv=True``), so a 3-D
            ``nn.Conv1d`` weight is one matrix, not a stack of ``out`` matrices.
    """

    rows: Optional[tuple[int, ...]] = None
    cols: Optional[tuple[int, ...]] = None
    label: str = "declared"
    conv: bool = False
    interleave: int = 1

    def describe(self) -> str:
        parts = [f"{axis} {_runs_text(sizes)}" for axis, sizes in (("rows", self.rows), ("cols", self.cols)) if sizes]
        if self.interleave > 1:
            parts.append(f"cols {self.interleave} interleaved, block b = [..., b::{self.interleave}]")
        return f"{self.label} ({', '.join(parts)})" if parts else self.label


def _runs(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[(start, size, count)]``: maximal runs of equal consecutive sizes."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for s in sizes:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s, out[-1][2] + 1)
        else:
            out.append((start, s, 1))
        start += s
    return out


def _runs_text(sizes: Sequence[int]) -> str:
    return "+".join(f"{c}x{s}" if c > 1 else str(s) for _, s, c in _runs(sizes))


def as_split(value: Any, where: str = "muon_split") -> Optional[Split]:
    """Normalize a declared split: a :class:`Split`, a list of row sizes, or a dict with ``rows``
    and/or ``cols`` lists (``None`` stays ``None``).

    Raises:
        ValueError: any other form, or a size that is not an int >= 1 (names ``where``).
    """
    if value is None or isinstance(value, Split):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"rows", "cols"}
        if unknown or not value:
            raise ValueError(f"{where}: {value!r} is invalid: a dict takes the keys 'rows' and/or 'cols' "
                             "(lists of block sizes)")
        rows, cols = value.get("rows"), value.get("cols")
    elif isinstance(value, (list, tuple)):
        rows, cols = value, None
    else:
        raise ValueError(f"{where}: {value!r} is invalid: give a list of row sizes, or {{'rows': [...], "
                         "'cols': [...]}}")
    for axis, sizes in (("rows", rows), ("cols", cols)):
        if sizes is not None and (not isinstance(sizes, (list, tuple)) or not sizes or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)):
            raise ValueError(f"{where}: {axis} {sizes!r} is invalid: a non-empty list of ints >= 1")
    return Split(tuple(rows) if rows is not None else None, tuple(cols) if cols is not None else None, "declared")


@dataclass(frozen=True)
class BlockGroup:
    """Equal-shape blocks of one parameter, as one strided view of its flat (row-major) storage.

    ``torch.as_strided(flat, sizes, strides, offset)`` is a ``(*batch, rows, cols)`` tensor whose
    trailing two dims are the blocks; the blocks of all groups of a view tile the parameter.
    """

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.sizes[-2]

    @property
    def cols(self) -> int:
        return self.sizes[-1]

    @property
    def count(self) -> int:
        """Number of blocks."""
        return math.prod(self.sizes[:-2])


@dataclass(frozen=True)
class MatrixView:
    """The matrix view of a parameter: the blocks Newton–Schulz orthogonalizes separately, each
    with its own update scale (docs/design.md, "Matrix views"). Built by :func:`matrix_view`; pure shape arithmetic.

    Attributes:
        shape: the parameter's logical shape.
        groups: the blocks, grouped into equal-shape strided views (one Newton–Schulz call each).
        split: the :class:`Split` applied to each matrix, or ``None``.
    """

    shape: tuple[int, ...]
    groups: tuple[BlockGroup, ...]
    split: Optional[Split] = None

    @property
    def ns_shape(self) -> tuple[int, int, int]:
        """``(batch, rows, cols)`` of the unsplit view (:func:`ns_view_shape`)."""
        return ns_view_shape(self.shape, conv=self.split is not None and self.split.conv)

    @property
    def num_blocks(self) -> int:
        return sum(g.count for g in self.groups)

    def sort_key(self) -> tuple:
        """A total order over views; equal keys = the same blocks at the same places (a conv
        ``(o, i, k, 1)`` and a matrix ``(o, i*k)`` share one), so plans batch such parameters."""
        return (self.ns_shape, tuple((g.offset, g.sizes, g.strides) for g in self.groups))

    def cost(self, steps: int, method: str, form: str = DEFAULT_QUINTIC_FORM) -> int:
        """Newton–Schulz matmul FLOPs of all blocks in quintic ``form`` (:func:`ds_muon.core.ns_cost.ns_flops`,
        summed; ``"auto"`` resolved per block shape)."""
        return sum(ns_flops(g.rows, g.cols, steps, method, batch=g.count, form=form) for g in self.groups)

    def describe(self) -> str:
        """E.g. ``"16 blocks of 32x64"`` or ``"1 block of 64x64 + 2 blocks of 16x64"``."""
        return " + ".join(f"{g.count} block{'s' if g.count > 1 else ''} of {g.rows}x{g.cols}" for g in self.groups)


def matrix_view(shape: Sequence[int], split: Optional[Split] = None) -> MatrixView:
    """The :class:`MatrixView` of a parameter of ``shape``, cut by ``split``.

    The matrices are those of :func:`ns_view_shape` (2-D: one; 3-D ``(E, m, n)``: ``E``; conv
    ``(out, in, kh, kw)``, or any conv weight when ``split.conv``: one ``(out, in*kh*kw)``);
    ``split`` cuts each of them into the grid of its row and column blocks. Blocks of equal shape in one run (consecutive equal row sizes x
    consecutive equal column sizes, over all stacked matrices) form one :class:`BlockGroup`.

    With ``split.interleave = k``, each row block's columns are ``k`` interleaved blocks of ``C/k`` columns
    (column stride ``k``), still one strided view per group.

    Raises:
        ValueError: 0-D/1-D ``shape``, ``split`` sizes that do not sum to the matrix's rows/cols
            (the message names both), or an ``interleave`` that does not divide the columns or comes with ``cols``.
    """
    shape = tuple(int(s) for s in shape)
    stack, R, C = ns_view_shape(shape, conv=split is not None and split.conv)
    rows = split.rows if split is not None and split.rows else (R,)
    cols = split.cols if split is not None and split.cols else (C,)
    k = split.interleave if split is not None else 1
    if k > 1 and (C % k or (split.cols and len(split.cols) > 1)):
        raise ValueError(f"split interleave {k} needs the {C} columns of the parameter of shape {shape} to be a "
                         "multiple of it and no cols split")
    for axis, sizes, total in (("rows", rows, R), ("cols", cols, C)):
        if sum(sizes) != total:
            raise ValueError(f"split {axis} {list(sizes)} sum to {sum(sizes)}, but the parameter of shape {shape} "
                             f"has matrices of {R}x{C} ({total} {axis})")
    groups = []
    for r0, r, nr in _runs(rows):
        for c0, c, nc in _runs(cols):
            if k > 1:  # k interleaved column blocks: block j starts at column j, column stride k
                batch = [(n, s) for n, s in ((stack, R * C), (nr, r * C), (k, 1)) if n > 1]
                groups.append(BlockGroup(r0 * C, tuple(n for n, _ in batch) + (r, C // k),
                                         tuple(s for _, s in batch) + (C, k)))
                continue
            batch = [(n, s) for n, s in ((stack, R * C), (nr, r * C), (nc, c)) if n > 1]
            merged: list[tuple[int, int]] = []
            for n, s in batch:  # merge (n1, s1), (n2, s2) into (n1*n2, s2) where s1 == n2*s2
                if merged and merged[-1][1] == n * s:
                    merged[-1] = (merged[-1][0] * n, s)
                else:
                    merged.append((n, s))
            merged = merged or [(1, R * C)]
            groups.append(BlockGroup(r0 * C + c0, tuple(n for n, _ in merged) + (r, c),
                                     tuple(s for _, s in merged) + (C, 1)))
    keep = split is not None and bool(split.rows or split.cols or k > 1 or (split.conv and len(shape) == 3))
    return MatrixView(shape, tuple(groups), split if keep else None)


def view_blocks(flat: "torch.Tensor", view: MatrixView) -> list["torch.Tensor"]:
    """The block groups of ``view`` in ``flat``, as strided views (one per group, shape ``(k, *batch, rows, cols)``):
    writing into one writes into ``flat``.

    Args:
        flat: ``(k, L)`` with ``L >= prod(view.shape)`` and unit stride along dim 1: ``k`` parameters
            of the same view, one flat (row-major) parameter per row (elements past the parameter
            are not covered).
        view: the parameters' :class:`MatrixView`.

    Raises:
        ValueError: ``flat`` is not 2-D with unit stride along dim 1.
    """
    if flat.dim() != 2 or flat.stride(1) != 1:
        raise ValueError(f"expected a (k, L) tensor with unit stride along L, got shape {tuple(flat.shape)} "
                         f"strides {flat.stride()}")
    return [flat.as_strided((flat.shape[0],) + g.sizes, (flat.stride(0),) + g.strides, flat.storage_offset() + g.offset)
            for g in view.groups]


def orthogonalize_blocks_(flat: "torch.Tensor", view: MatrixView, fn: Callable[["torch.Tensor"], "torch.Tensor"]) -> None:
    """In place: replace every block of ``view`` in ``flat`` by ``fn(block)`` (:func:`view_blocks`).

    Args:
        flat: ``(k, L)`` with ``L >= prod(view.shape)`` and unit stride along dim 1: ``k`` parameters
            of the same view, one flat (row-major) parameter per row (elements past the parameter
            are not touched).
        view: the parameters' :class:`MatrixView`.
        fn: ``(k, *batch, rows, cols) -> same shape`` (any float dtype): the orthogonalization
            including the update scale of a ``rows x cols`` block. Called once per group.

    Raises:
        ValueError: as :func:`view_blocks`.
    """
    for blocks in view_blocks(flat, view):
        blocks.copy_(fn(blocks))
