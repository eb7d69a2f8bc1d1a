"""Which half-precision types this machine's accelerator can train in (tests skip what it cannot, saying why).

DeepSpeed refuses ``"fp16": {"enabled": true}`` where its accelerator reports no fp16 support
(``DeepSpeedEngine._do_sanity_check``: "Type fp16 is not supported on your device."): on the CPU accelerator that
depends on the CPU (AVX-512 FP16 / AMX-FP16), so some of this repository's CPU test machines have it and some do
not. An fp16 case there is skipped with :data:`FP16_SKIP`, never reported as a pass.
"""
from __future__ import annotations

import functools

__all__ = ["fp16_supported", "FP16_SKIP", "is_fp16_config"]

FP16_SKIP = ("fp16 is not supported by this machine's DeepSpeed accelerator (get_accelerator().is_fp16_supported() "
             "is False: DeepSpeed refuses fp16 configs here, with or without ds_muon)")


@functools.lru_cache(maxsize=1)
def fp16_supported() -> bool:
    """Whether DeepSpeed's accelerator here trains fp16 models."""
    from deepspeed.accelerator import get_accelerator
    return bool(get_accelerator().is_fp16_supported())


def is_fp16_config(cfg: dict) -> bool:
    """Whether a DeepSpeed config dict enables fp16."""
    fp16 = cfg.get("fp16")
    return isinstance(fp16, dict) and fp16.get("enabled") is True
