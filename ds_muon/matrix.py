"""How Muon sees a parameter as a matrix, and how it scales the orthogonalized update.

Pure shape arithmetic shared by the single-device reference optimizer and the ZeRO-3 owner step,
so both orthogonalize exactly the same matrices.
"""
from __future__ import annotations

import math
from typing import Sequence

UPDATE_SCALES = ("shape", "rms_match")


def ns_view_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """The (batch, rows, cols) view Newton–Schulz runs on for a parameter of ``shape``.

    * 2-D ``(m, n)`` -> ``(1, m, n)``.
    * 3-D ``(b, m, n)`` (stacked experts) -> a batch of ``b`` matrices ``(b, m, n)``.
    * 4-D and up, conv weights ``(out, in, kh, kw)`` -> ``(1, out, in*kh*kw)``, as in
      Keller Jordan's Muon (https://kellerjordan.github.io/posts/muon/).

    Raises:
        ValueError: for 0-D and 1-D shapes, which Muon does not orthogonalize (use AdamW).
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"Muon needs a parameter with >= 2 dims, got shape {shape}; 0-D/1-D parameters use AdamW")
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) == 3:
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
