"""The dtype rules (ds_muon.core.dtypes): Newton–Schulz compute dtype, owner-exchange wire dtype."""
from __future__ import annotations

import pytest
import torch

from ds_muon.core.dtypes import resolve_exchange_dtype, resolve_ns_dtype


def test_exchange_dtype_rule():
    """'auto' puts bf16 on the wire only when Newton-Schulz computes in bf16; a given dtype wins."""
    assert resolve_exchange_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_exchange_dtype("auto", "torch.bfloat16") is torch.bfloat16
    assert resolve_exchange_dtype("auto", torch.float16) is torch.float32  # fp16 Gram NS: exact exchange
    assert resolve_exchange_dtype("auto", "float16") is torch.float32
    assert resolve_exchange_dtype("auto", torch.float32) is torch.float32
    assert resolve_exchange_dtype("float32", torch.bfloat16) is torch.float32
    assert resolve_exchange_dtype("bfloat16", torch.float32) is torch.bfloat16
    with pytest.raises(ValueError, match="exchange_dtype must be one of"):
        resolve_exchange_dtype("float16", torch.float32)


def test_the_runtime_uses_the_rule():
    """The ZeRO optimizers (stage 3 and stages 1/2) build their exchanges with this rule (no second copy of it)."""
    import ds_muon.integration.zero_common as zero_common
    assert (zero_common.resolve_exchange_dtype is resolve_exchange_dtype
            and zero_common.resolve_ns_dtype is resolve_ns_dtype)

