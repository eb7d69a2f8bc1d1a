"""The dtype rules: Newton–Schulz compute dtype, owner-exchange wire dtype, momentum storage dtype.

One place for the three ``"auto"`` rules (layer ``core``: torch only). Sources: ds_muon; the
built-in Muon of DeepSpeed 0.19.8 fixes bf16 (fp16 for Gram) for Newton–Schulz.
"""
from __future__ import annotations

from typing import Any

import torch

from .ns_cost import check_method

__all__ = ["NS_DTYPES", "EXCHANGE_DTYPES", "MOMENTUM_DTYPES", "resolve_ns_dtype", "resolve_exchange_dtype"]

NS_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32")
EXCHANGE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float32")
MOMENTUM_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def resolve_ns_dtype(ns_dtype: str, method: str, device: torch.device | str) -> torch.dtype:
    """Map a configured NS compute dtype name to a ``torch.dtype``.

    Args:
        ns_dtype: one of ``NS_DTYPES``. ``"auto"`` gives float32 on CPU (CPU parity tests are then
            exact to fp32 rounding); on any other device type (cuda, xpu, hpu, ...) bfloat16 for
            ``"standard"``/``"polar_express"`` and float16 for ``"gram"`` (the Gram NS blog runs
            in float16: its Gram matrices are bounded by 1, so fp16's extra mantissa is free).
            The other names give that dtype whatever the device.
        method: one of ``NS_METHODS``.
        device: a ``torch.device`` or device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...);
            only its type is looked at, no device is touched.

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

    Raises:
        ValueError: ``ns_dtype`` not in ``NS_DTYPES`` or ``method`` not in ``NS_METHODS``
            (the message names the allowed values), or ``device`` is not a device.
    """
    check_method(method)
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
    if ns_dtype != "auto":
        return getattr(torch, ns_dtype)
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"not a device: {device!r}") from err
    if device_type == "cpu":
        return torch.float32
    return torch.float16 if method == "gram" else torch.bfloat16


def resolve_exchange_dtype(exchange_dtype: str, ns_compute_dtype: Any) -> torch.dtype:
    """The owner exchange's wire dtype: ``exchange_dtype`` (``"auto"``, ``"bfloat16"`` or ``"float32"``) with
    ``"auto"`` resolved against the Newton–Schulz compute dtype (a ``torch.dtype`` or its name): bf16 on the
    wire only when NS itself computes in bf16 (an fp16 Gram NS gets an fp32 exchange: bf16 would lose more
    than fp16 keeps).

    Raises:
        ValueError: ``exchange_dtype`` not in :data:`EXCHANGE_DTYPES`.
    """
    if exchange_dtype not in EXCHANGE_DTYPES:
        raise ValueError(f"exchange_dtype must be one of {EXCHANGE_DTYPES}, got {exchange_dtype!r}")
    if exchange_dtype != "auto":
        return getattr(torch, exchange_dtype)
    name = str(ns_compute_dtype).removeprefix("torch.")
    return torch.bfloat16 if name in ("bfloat16", "bf16") else torch.float32
