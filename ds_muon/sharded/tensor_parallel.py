"""A tensor-parallel matrix on its owner: the stacked form (the shards back to back) <-> the full matrix.

Layer ``sharded``. The owner exchange (:mod:`ds_muon.sharded.exchange`) rebuilds a tensor-parallel Muon matrix
from every rank's piece in its *stacked* form (:func:`ds_muon.partitions.tensor_parallel_pieces`); Newton–Schulz
must see the full matrix. For a column-parallel split (``dim=0``) the two are the same row-major layout; for a
row-parallel split (``dim=1``) the full matrix is the shards concatenated along the columns (docs/parallelism_tp.md).
"""
from __future__ import annotations

import torch

from ..partitions import TensorParallelSplit

__all__ = ["stacked_to_full", "full_to_stacked_"]


def stacked_to_full(stacked: torch.Tensor, split: TensorParallelSplit) -> torch.Tensor:
    """The full matrices of a batch in stacked form.

    Args:
        stacked: ``(k, rows * cols)``, ``k`` matrices in stacked form, any dtype.
        split: their tensor-parallel split (``shape = (rows, cols)``).

    Returns:
        ``(k, rows * cols)`` row-major full matrices: ``stacked`` itself for ``dim=0``, a new tensor for ``dim=1``.
    """
    if split.dim == 0:
        return stacked
    k, rows = stacked.shape[0], split.shape[0]
    shards = stacked.split([rows * c for c in split.sizes], dim=1)
    return torch.cat([s.reshape(k, rows, c) for s, c in zip(shards, split.sizes)], dim=2).reshape(k, -1)


def full_to_stacked_(stacked: torch.Tensor, full: torch.Tensor, split: TensorParallelSplit) -> None:
    """Write row-major full matrices ``full`` ``(k, rows * cols)`` into ``stacked`` ``(k, rows * cols)`` in stacked
    form (the inverse of :func:`stacked_to_full`); nothing to do when ``full`` is ``stacked`` (``dim=0``)."""
    if full is stacked:
        return
    k, rows = stacked.shape[0], split.shape[0]
    cols = full.view(k, rows, -1).split(list(split.sizes), dim=2)
    torch._foreach_copy_(list(stacked.split([rows * c for c in split.sizes], dim=1)),
                         [c.reshape(k, -1) for c in cols])
