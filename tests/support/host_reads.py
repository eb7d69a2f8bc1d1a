"""Count, on the CPU, the calls that would make the host wait for an accelerator (host-device syncs).

On a CUDA device ``benchmarks/step_time.py --sync-debug`` counts the real syncs (``torch.cuda.set_sync_debug_mode``).
On the CPU nothing ever waits, so :class:`HostReads` counts the *calls* that would: a
:class:`torch.overrides.TorchFunctionMode` that sees every torch function and ``Tensor`` method called from Python
and keeps a residency for each tensor, "device" (where the accelerator would hold it) or "host":

- **host tensors**: made by a factory without a ``device`` argument or with a ``pin_memory`` argument (a staging
  buffer), returned by ``Tensor.cpu()`` or a blocking ``Tensor.to("cpu")`` (the string: DeepSpeed's CPU accelerator
  names its device ``"cpu"`` as well, so a ``torch.device`` argument and a non-blocking move count as device; where
  the CPU returns the tensor itself, the caller gets an alias marked host), and every result computed from host
  tensors only; every other tensor is a device tensor.
- **counted** (:data:`READS`, :data:`MASK_INDEXING`): a value of a device tensor read by the host (``item``,
  ``tolist``, ``bool()``, ``float()``, ``int()``, ``numpy``, a data-dependent output size such as ``nonzero``,
  indexing with a bool mask); a blocking move between host and device (``.cpu()``, ``.to("cpu")``, ``.to(device)``
  of a host tensor, ``copy_`` without ``non_blocking``); and ``torch.tensor``/``as_tensor`` of Python data with a ``device``
  (a copy from pageable host memory: CUDA's sync debug mode reports it, e.g. DeepSpeed's ``stage3.py:2483``).
  A ``copy_(..., non_blocking=True)`` is not counted: it is how a value reaches a host buffer without a wait.

What it cannot see: C++ code (DeepSpeed's ops, the collectives of ``torch.distributed``), legacy constructors
(``torch.FloatTensor([x])``, DeepSpeed's ``get_accelerator().FloatTensor``, which TorchFunctionMode never sees), and
waits that are not a tensor call (``torch.cuda.synchronize``, events). So the count is a lower bound of an
accelerator's, per source line; ``sources()`` names each by its innermost frame in ds_muon or DeepSpeed.
"""
from __future__ import annotations

import json
import os
import traceback
from collections import Counter
from typing import Any, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

#: Tensor methods and torch functions whose result the host reads (each a sync on an accelerator).
READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "numpy",
                   "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
                   "bincount", "__format__", "__repr__"})
#: Indexing with a bool mask: the result's size is data-dependent.
MASK_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
#: factories that copy Python data into a new tensor
DATA_FACTORIES = frozenset({"tensor", "as_tensor", "asarray"})
FACTORIES = DATA_FACTORIES | frozenset({"empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
                                        "ones_like", "full_like", "rand", "randn", "randint", "linspace"})
_HOST = "_host_reads_host"
_MINE = (os.sep + "ds_muon" + os.sep, os.sep + "deepspeed" + os.sep)


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return "__setitem__" if name == "__set__" else name


def _is_host(t: torch.Tensor) -> bool:
    return getattr(t, _HOST, False)


def _mark_host(out: Any) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _HOST, True)
            except (AttributeError, RuntimeError):  # e.g. a tensor subclass with slots
                pass


class HostReads(TorchFunctionMode):
    """The would-be syncs of the calls made inside ``with HostReads() as reads:`` (see the module docstring).

    Attributes:
        events: ``[(kind, where, stack)]``, one per counted call: ``kind`` the function (``"cpu"``, ``"__bool__"``,
            ``"tensor(device=)"``, ...), ``where`` ``"path:line"`` of the innermost ds_muon or DeepSpeed frame (path
            from the package directory; else the innermost frame), ``stack`` the formatted frames.
        timeline: ``where`` of each counted call and the labels of :meth:`note`, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str, list[str]]] = []
        self.timeline: list[str] = []

    def note(self, label: str) -> None:
        """Put ``label`` on the timeline (e.g. when something the test watches happens)."""
        self.timeline.append(label)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = [t for t in tensors if not _is_host(t)]
        kind = self._counted(name, args, kwargs, tensors, device)
        if kind is not None:
            self._record(kind)
        out = func(*args, **kwargs)
        if name.endswith("_") and not name.startswith("__"):
            return out  # in place: the tensor keeps its residency
        move = self._move(args, kwargs) if name == "to" else None
        if name == "cpu" or move == "host":
            if args and out is args[0]:  # a CPU tensor returns itself: mark an alias, the original stays a device tensor
                out = out.view_as(out)
            _mark_host(out)
        elif move == "device":
            if args and out is args[0] and _is_host(out):
                out = out.view_as(out)  # a host tensor "moved" on the CPU: an alias, a device tensor
        elif name in FACTORIES and not tensors:
            if "pin_memory" in kwargs or kwargs.get("device") is None:
                _mark_host(out)
        elif tensors and not device:
            _mark_host(out)
        return out

    @staticmethod
    def _move(args: tuple, kwargs: dict) -> Optional[str]:
        """Where ``Tensor.to(...)`` moves its tensor: ``"host"`` for a blocking ``.to("cpu")`` (the string; see the
        module docstring), ``"device"`` for any other device argument, None without one (a dtype change)."""
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, str):
            host = target.split(":")[0] == "cpu" and not kwargs.get("non_blocking", False)
            return "host" if host else "device"
        return "device" if isinstance(target, torch.device) else None

    def _counted(self, name: str, args: tuple, kwargs: dict, tensors: list, device: list) -> Optional[str]:
        if name in DATA_FACTORIES and kwargs.get("device") is not None and not tensors:
            return f"{name}(device=)"
        if name == "to" and tensors and not device and self._move(args, kwargs) == "device" and \
                not kwargs.get("non_blocking", False):
            return "to(device) from the host, blocking"  # a copy from pageable host memory
        if not device:
            return None  # host tensors only: nothing waits
        if name in READS:
            return name
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            return name
        if name == "where" and len(args) == 1 and not kwargs:
            return "where(cond)"
        if name in MASK_INDEXING and any(t.dtype == torch.bool for t in tree_flatten(args[1:2])[0]
                                         if isinstance(t, torch.Tensor)):
            return f"{name}[bool mask]"
        if name == "cpu" or (name == "to" and self._move(args, kwargs) == "host"):
            return name
        if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and \
                not kwargs.get("non_blocking", args[2] if len(args) > 2 else False) and \
                _is_host(args[0]) != _is_host(args[1]):
            return "copy_(blocking, host<->device)"
        return None

    def _record(self, kind: str) -> None:
        stack = traceback.extract_stack()[:-2]
        frame = next((f for f in reversed(stack) if any(m in f.filename for m in _MINE)), stack[-1])
        where = frame.filename
        for m in _MINE:
            if m in where:
                where = m.strip(os.sep) + "/" + where.split(m, 1)[1]
                break
        self.events.append((kind, f"{where.replace(os.sep, '/')}:{frame.lineno}",
                            [f"{f.filename}:{f.lineno} {f.name}" for f in stack]))
        self.timeline.append(self.events[-1][1])

    # ---- reading the result ----------------------------------------------------------------------------------
    @property
    def count(self) -> int:
        return len(self.events)

    def sources(self) -> Counter:
        """``Counter({"where (kind)": n})`` over the counted calls."""
        return Counter(f"{where} ({kind})" for kind, where, _ in self.events)

    def ours(self) -> list[tuple[str, str, list[str]]]:
        """The counted calls whose innermost ds_muon/DeepSpeed frame is ds_muon's."""
        return [e for e in self.events if e[1].startswith("ds_muon/")]


# ---- one optimizer step of each arm, counted -----------------------------------------------------------------
#: the arms :func:`count_steps` builds: ds_muon's Muon, DeepSpeed's built-in Muon (ds_muon disabled, as ``DS_MUON=0``;
#: ZeRO-3 with ``reduce_scatter`` false, which the built-in needs there, as benchmarks/step_time.py's
#: ``builtin_muon`` arm), DeepSpeed's AdamW, and ds_muon with the overlapped step
ARMS = ("ds_muon", "builtin_muon", "adamw", "ds_muon_overlap")


def arm_config(arm: str, clip: float = 1.0, **params) -> dict:
    """The ZeRO-3 fp32 config of ``arm`` (:data:`ARMS`, optionally ``arm+key=json`` for ds_muon's
    ``optimizer.params``) on the parity model (``tests/support/harness.py``); ``params`` add to the optimizer's."""
    from tests.support.harness import MUON_PARAMS, ds_config
    arm, *items = arm.split("+")
    params = dict(params, **{k: json.loads(v) for k, v in (item.split("=", 1) for item in items)})
    if arm == "adamw":
        return ds_config(clip=clip, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, **params}})
    if arm == "builtin_muon":
        return ds_config(clip=clip, optimizer={"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95,
                                                                          "weight_decay": 0.1, **params}},
                         reduce_scatter=False)
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")
    params = dict(MUON_PARAMS, overlap_backward=arm == "ds_muon_overlap", **params)
    return ds_config(clip=clip, optimizer={"type": "Muon", "params": params})


def count_steps(rank: int, world_size: int, arms: Sequence[str], warmup: int = 1, clip: float = 1.0) -> dict:
    """For each of ``arms`` (:func:`arm_config`; ds_muon's first: the others disable ds_muon, as ``DS_MUON=0``):
    build it on the parity model, run ``warmup`` steps, then count one more ``engine.step()`` (:class:`HostReads`).
    Returns ``{arm: {"count", "sources": {where (kind): n}, "events": [(kind, where)], "stacks": [...],
    "timeline": [...], "sub_groups": n, "optimizer": class name}}``; on the timeline ``"flags agreed"`` marks each
    all_reduce of ds_muon's no-gradient flags (:meth:`ds_muon.sharded.no_grad.GradientFlags.agree`). One rank of
    :func:`tests.support.spawn.run_distributed`."""
    import deepspeed
    import ds_muon
    from ds_muon.sharded.no_grad import GradientFlags
    from tests.support.harness import build_engine
    from tests.support.models import batch, use_extra
    out = {}
    for arm in sorted(arms, key=lambda a: not a.startswith("ds_muon")):
        ours = arm.startswith("ds_muon")
        if not ours:
            ds_muon.disable()  # DeepSpeed alone, as DS_MUON=0
        engine, _ = build_engine(arm_config(arm, clip), initialize=None if ours else deepspeed.initialize)
        reads = HostReads()
        agree = GradientFlags.agree

        def noted(flags, *args, **kwargs):
            reads.note("flags agreed")
            return agree(flags, *args, **kwargs)

        for step in range(warmup + 1):
            tokens, targets = (t.to(engine.device) for t in batch(step, rank, 0))
            engine.backward(engine(tokens, targets, use_extra(step)))
            if step < warmup:
                engine.step()
                continue
            GradientFlags.agree = noted
            try:
                with reads:
                    engine.step()
            finally:
                GradientFlags.agree = agree
        opt = engine.optimizer
        out[arm] = {"count": reads.count, "sources": dict(reads.sources()), "events": [e[:2] for e in reads.events],
                    "stacks": [e[2] for e in reads.events], "timeline": reads.timeline, "sub_groups": len(opt.fp16_groups),
                    "optimizer": type(opt).__name__}
        engine.destroy()
    return out
