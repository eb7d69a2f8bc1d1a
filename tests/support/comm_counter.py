"""Count the bytes each rank puts on the wire, per collective, by wrapping ``torch.distributed``.

Installed in a spawned worker *before* ``deepspeed.init_distributed`` (DeepSpeed binds some
collectives at that point). Counts the payload this rank sends: the input of ``all_reduce``,
``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``broadcast``; for ``all_to_all_single``
the input minus the part a rank sends to itself; ``send``/``isend``/``gather`` their tensor,
``batch_isend_irecv`` its ``isend`` tensors, ``scatter`` its ``scatter_list`` (on the source rank).
Receives (``recv``/``irecv``) and the ``*_object`` collectives are recorded with 0 elements: the
receiver sends nothing, and an object collective's pickled payload goes through ``broadcast`` /
``all_gather`` / ``send``, which are counted themselves. :data:`NOT_EXPECTED` names the ops a ZeRO-3
step (DeepSpeed's or ds_muon's) never uses; the communication test asserts none of them is recorded.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "_all_gather_base", "_reduce_scatter_base",
          "all_to_all_single", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce",
          "all_reduce_coalesced", "all_gather_coalesced",
          # point-to-point, rooted and object collectives: NOT_EXPECTED
          "send", "recv", "isend", "irecv", "batch_isend_irecv", "scatter", "gather",
          "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
          "send_object_list", "recv_object_list")
# Ops no ZeRO-3 training step should call: any record of them is traffic outside the collectives
# the communication budget accounts for.
NOT_EXPECTED = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "scatter", "gather",
                          "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                          "send_object_list", "recv_object_list"})

RECORDS: list[tuple[str, int, int]] = []  # (op, elements sent, bytes sent)
ENABLED = [False]


def _nbytes(t: Any) -> tuple[int, int]:
    if isinstance(t, torch.Tensor):
        return t.numel(), t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        sizes = [_nbytes(x) for x in t]
        return sum(s[0] for s in sizes), sum(s[1] for s in sizes)
    return 0, 0


def _payload(name: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    def arg(i: int, key: str):
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else None)

    if name in ("all_reduce", "broadcast", "reduce"):
        return _nbytes(arg(0, "tensor"))
    if name == "all_reduce_coalesced":
        return _nbytes(arg(0, "tensors"))
    if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_into_tensor", "_all_gather_base"):
        return _nbytes(arg(1, "input") if "input" in kwargs or len(args) > 1 else arg(1, "input_tensor"))
    if name in ("all_gather", "reduce_scatter"):
        return _nbytes(arg(1, "tensor") if name == "all_gather" else arg(1, "input_list"))
    if name == "all_to_all_single":
        inp = arg(1, "input")
        splits = arg(3, "input_split_sizes")
        group = kwargs.get("group")
        n, b = _nbytes(inp)
        rank = dist.get_rank(group)
        own = splits[rank] if splits else n // dist.get_world_size(group)
        return n - own, (n - own) * inp.element_size()
    if name == "all_to_all":
        return _nbytes(arg(1, "input_tensor_list"))
    if name in ("send", "isend", "gather"):
        return _nbytes(arg(0, "tensor"))
    if name == "all_gather_coalesced":
        return _nbytes(arg(1, "input_tensor_list"))
    if name == "batch_isend_irecv":
        ops = arg(0, "p2p_op_list") or []
        return _nbytes([op.tensor for op in ops if getattr(op.op, "__name__", "") == "isend"])
    if name == "scatter":
        return _nbytes(arg(1, "scatter_list"))
    return 0, 0  # recv, irecv (nothing sent) and the *_object collectives (counted in their inner ops)


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if ENABLED[0]:
            n, b = _payload(name, args, kwargs)
            RECORDS.append((name, n, b))
        return fn(*args, **kwargs)

    wrapper.__ds_muon_counted__ = True
    return wrapper


def install() -> None:
    """Wrap the collectives in ``torch.distributed`` and ``distributed_c10d`` (idempotent)."""
    for name in _NAMES:
        wrapped: dict[int, Any] = {}  # one wrapper per function, so identity checks (P2POp's op) still hold
        for mod in (dist, c10d):
            fn = getattr(mod, name, None)
            if fn is not None and not getattr(fn, "__ds_muon_counted__", False):
                setattr(mod, name, wrapped.setdefault(id(fn), _wrap(name, fn)))


class counting:
    """``with counting() as records:`` collects ``(op, elements, bytes)`` sent inside the block."""

    def __enter__(self) -> list[tuple[str, int, int]]:
        RECORDS.clear()
        ENABLED[0] = True
        return RECORDS

    def __exit__(self, *exc) -> None:
        ENABLED[0] = False


def by_op(records) -> Counter:
    """Bytes per op name."""
    c: Counter = Counter()
    for op, _, b in records:
        c[op] += b
    return c
