"""Collectives that name themselves when they fail (layer ``sharded``: torch.distributed, no DeepSpeed).

A dead peer surfaces as a backend error deep inside a collective; :func:`named_collective` turns exactly
those errors (and no others) into :class:`ds_muon.errors.CollectiveError` naming what was being done.
"""
from __future__ import annotations

import contextlib
import os
import re
import traceback

import torch
import torch.distributed as dist

from ..errors import CollectiveError

__all__ = ["named_collective", "from_collective"]

# A communication backend's own error text: gloo's ("[.../third_party/gloo/...] Read error ...: Connection
# reset by peer", "Timed out waiting ..."), NCCL/RCCL/HCCL/oneCCL's, a watchdog timeout's.
_BACKEND_MESSAGE = re.compile(r"gloo|[nrhx]ccl|oneccl|connection (closed|reset) by peer|timed out|timeout|watchdog",
                              re.IGNORECASE)
# Frames of the communication layers: torch.distributed (c10d) and DeepSpeed's comm wrappers.
_COMM_FILES = (os.sep + os.path.join("torch", "distributed", ""), os.sep + os.path.join("deepspeed", "comm", ""))


def from_collective(err: BaseException) -> bool:
    """Whether ``err`` (caught inside a :func:`named_collective` block) came from a collective: a
    ``torch.distributed.DistError`` (NCCL's ``DistBackendError``, store and network errors), a backend's
    error text (gloo raises plain ``RuntimeError`` from ``Work.wait()``, e.g. DeepSpeed's parameter
    all_gather handle or the owner exchange's all_to_all), or a frame of torch.distributed or
    deepspeed.comm between the block and the raise."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    if _BACKEND_MESSAGE.search(str(err)):
        return True
    return any(marker in frame.filename for frame in traceback.extract_tb(err.__traceback__)
               for marker in _COMM_FILES)


@contextlib.contextmanager
def named_collective(what: str):
    """Re-raise an error of a collective inside the block (:func:`from_collective`) as a
    :class:`CollectiveError` naming ``what``; any other error propagates unchanged."""
    try:
        yield
    except (CollectiveError, torch.OutOfMemoryError, torch._dynamo.exc.TorchDynamoException):
        raise  # out of memory or a compile error inside Newton-Schulz is not a dead peer
    except RuntimeError as err:  # gloo: RuntimeError; NCCL: torch.distributed.DistBackendError (a subclass)
        if not from_collective(err):
            raise  # not a collective's error (e.g. of an element-wise function inside DeepSpeed's step)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise CollectiveError(
            f"ds_muon: {what} failed on rank {rank}: {err}\nA peer rank probably exited or lost its connection: "
            "check the other ranks' logs for the first error. A rank that hangs instead is bounded by the "
            "process-group timeout (deepspeed.init_distributed(timeout=...), 30 minutes by default)") from err
