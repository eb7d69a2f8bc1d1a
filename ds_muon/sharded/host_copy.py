"""A device tensor's values brought to the host without a host sync of their own (layer ``sharded``: torch only).

A value the step needs on the host (the no-gradient flags, the overlapped step's clip decision) is copied into a host
buffer with a non-blocking copy (pinned memory on CUDA) as soon as it is computed, ahead of a host sync the step makes
anyway (DeepSpeed's read of the global gradient norm); reading it afterwards waits for nothing (docs/design.md, "Host
syncs of the step"). Read before such a sync, it waits for the copy: one host sync, a blocking copy, which CUDA's
sync debug mode reports (``benchmarks/step_time.py --sync-debug``) like any other.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["HostCopy"]


class HostCopy:
    """The values of ``tensor`` (any shape and dtype, on any device) in host memory, copied when constructed.

    On CUDA a non-blocking copy into pinned memory and an event recorded on the current stream after it; on the CPU
    a plain copy; on another accelerator a blocking copy (one host sync).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        cuda = tensor.device.type == "cuda"
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        # on the CPU a copy is synchronous whatever the flag says
        self._host.copy_(tensor, non_blocking=cuda or tensor.device.type == "cpu")
        self._source: Optional[torch.Tensor] = None
        self._landed: Optional[torch.cuda.Event] = None
        if cuda:
            self._source = tensor  # kept for a blocking copy in get(), should the copy not have landed
            self._landed = torch.cuda.Event()
            self._landed.record()

    def get(self) -> torch.Tensor:
        """The host tensor. If the copy has not landed yet (no host sync came between), a blocking copy instead: one
        host sync, which CUDA's sync debug mode names."""
        if self._landed is not None:
            if not self._landed.query():
                self._host = self._source.cpu()
            self._landed = self._source = None
        return self._host
