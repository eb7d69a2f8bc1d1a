"""Host probes: can this machine do what the config asks (layer ``integration``; it may import deepspeed).

Run once per ``initialize`` (:func:`host_problems`), after the config itself parsed
(:func:`ds_muon.config.parse_ds_config`): an NVMe swap directory must exist, be writable and take O_DIRECT
files; DeepSpeed's async_io op must be buildable (libaio); and no stale JIT build lock of that op may be
left (DeepSpeed would wait for it forever). ZeRO++'s quantized weights and gradients (qwZ, qgZ) need DeepSpeed's
quantizer op, which the CPU accelerator does not have. Each problem is a line naming the key and the fix.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..config.sections import deepspeed_version

__all__ = ["host_problems"]


def _async_io_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe swapping) is prebuilt in this DeepSpeed install, or can
    be JIT-built here (needs libaio and its headers)."""
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get("async_io"):
            return True
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception:  # noqa: BLE001 - an unusual DeepSpeed build; let DeepSpeed report it later
        return True
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _async_io_build_lock_problem() -> Optional[str]:
    """A stale JIT build lock of DeepSpeed's async_io op, which would make NVMe offload hang.

    Unless async_io is prebuilt, DeepSpeed loads it through ``torch.utils.cpp_extension.load``, which
    takes a ``FileBaton`` (the file ``<TORCH_EXTENSIONS_DIR>/async_io/lock``) even when the op is
    already built, and waits without a deadline while that file exists. A build killed mid-way (a
    timed-out test, Ctrl-C, OOM) leaves the file behind, and every later NVMe run then hangs inside
    ``deepspeed.initialize``. Returns the problem when the lock is stale by
    :func:`ds_muon.integration.jit_ops.stale_lock` (no process is building in that directory, and the lock is
    older than a minute), else None (no lock, or a build in progress, e.g. by another rank, which DeepSpeed
    waits for)."""
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get("async_io"):
            return None
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from torch.utils.cpp_extension import _get_build_directory
        build_dir = _get_build_directory(AsyncIOBuilder.NAME, verbose=False)
    except Exception:  # noqa: BLE001 - an unusual DeepSpeed/torch layout: nothing to check
        return None
    from .jit_ops import stale_lock  # here: `python -m ds_muon.integration.jit_ops` must not find it imported
    lock = stale_lock(build_dir)
    if lock is None:
        return None
    return (f"zero_optimization.offload_optimizer.device: 'nvme' needs DeepSpeed's async_io op, whose JIT build "
            f"lock {lock} exists although no process is building in {build_dir}: a build that was killed leaves "
            f"it, and DeepSpeed {deepspeed_version()} (torch.utils.cpp_extension.load's FileBaton) then waits for it "
            f"forever. Run `python -m ds_muon.integration.jit_ops` (it removes the lock and builds the op), or "
            f"delete {lock}; or prebuild the op (DS_BUILD_AIO=1 pip install deepspeed)")


def _o_direct_problem(path: str) -> Optional[str]:
    """DeepSpeed's async_io opens swap files with O_DIRECT, which tmpfs and some overlay/FUSE
    filesystems refuse (EINVAL) at the first swap. Probe it with a small file; None when it works."""
    if not hasattr(os, "O_DIRECT"):
        return None
    probe = os.path.join(path, f".ds_muon_o_direct_probe_{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError as err:
        return f"cannot open files there with O_DIRECT ({err.strerror}), which DeepSpeed's async_io needs"
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return None


def _nvme_path_problems(section: str, nvme_path: Any) -> list[str]:
    """An NVMe swap directory must exist, be writable by this process and take O_DIRECT files (DeepSpeed only
    fails later, at the first swap, or silently creates a mistyped mount point on the root disk)."""
    key = f"zero_optimization.{section}.nvme_path"
    if nvme_path is None or (isinstance(nvme_path, str) and not nvme_path.strip()):
        return []  # a missing path is a config problem (ds_muon.config.sections), not a host one
    path = os.fspath(nvme_path)
    if not os.path.isdir(path):
        return [f"{key}: {path!r} does not exist or is not a directory: create it (mkdir -p {path}) on every node, "
                f"or point nvme_path at the mounted NVMe drive"]
    if not os.access(path, os.W_OK | os.X_OK):
        return [f"{key}: {path!r} is not writable by this process: DeepSpeed writes its swap files there; "
                f"fix its permissions, or choose a writable directory"]
    problem = _o_direct_problem(path)
    if problem:
        return [f"{key}: {path!r}: {problem} (tmpfs and some overlay filesystems do not support it); point "
                f"nvme_path at a directory on a local disk (ext4, xfs)"]
    return []


QUANTIZED_KEYS = {"zero_quantized_weights": "qwZ, quantized weight all-gather",
                  "zero_quantized_nontrainable_weights": "quantized frozen weights",
                  "zero_quantized_gradients": "qgZ, quantized gradient reduce-scatter"}


def _quantizer_missing() -> Optional[str]:
    """Why this accelerator cannot load DeepSpeed's ``QuantizerBuilder`` op (ZeRO++ qwZ/qgZ), in DeepSpeed's own
    words, or None when it can (prebuilt, or a builder for this accelerator that is compatible here).

    The CPU accelerator (DeepSpeed 0.19.8) maps it to ``NotImplementedBuilder``, whose ``load()`` raises at once
    (``ValueError: This op had not been implemented on CPU backend.``), building nothing; that message is returned.
    DeepSpeed itself only loads it inside ``deepspeed.initialize`` (qwZ: in ``zero.Init``, after the model is
    on the device) or at the first backward (qgZ: ``all_to_all_quant_reduce``)."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get("quantizer"):
            return None
        accelerator = get_accelerator()
        builder = accelerator.create_op_builder("QuantizerBuilder")
    except Exception:  # noqa: BLE001 - an unusual DeepSpeed build; let DeepSpeed report it later
        return None
    name = accelerator.device_name()
    if builder is None:
        return f"the {name} accelerator has no QuantizerBuilder"
    if type(builder).__name__ == "NotImplementedBuilder":
        try:
            builder.load(verbose=False)  # raises at once; it has no sources to build
        except Exception as err:  # noqa: BLE001 - DeepSpeed's reason, quoted
            return f"DeepSpeed {deepspeed_version()} on the {name} accelerator: \"{err}\""
        return None
    if not builder.is_compatible(verbose=False):
        return f"DeepSpeed {deepspeed_version()}'s QuantizerBuilder is not compatible with this {name} setup"
    return None


def _quantized_problems(zero: dict) -> list[str]:
    """ZeRO++ quantization keys that are on at stage 3 (DeepSpeed passes them to its ZeRO-3 optimizer only) while
    the quantizer op cannot load here: one line each, naming the key, DeepSpeed's reason and the fix."""
    stage = zero.get("stage")
    keys = [k for k in QUANTIZED_KEYS if zero.get(k) is True]
    if stage != 3 or not keys:
        return []
    reason = _quantizer_missing()
    if reason is None:
        return []
    return [f"zero_optimization.{key}: true (ZeRO++ {QUANTIZED_KEYS[key]}) needs DeepSpeed's QuantizerBuilder op, "
            f"which cannot load here ({reason}); ZeRO++ quantization runs on CUDA. Set {key} to false on this "
            f"machine (zero_hpz_partition_size, ZeRO++'s hierarchical partitioning, needs no quantizer)"
            for key in keys]


def host_problems(ds_config: dict) -> list[str]:
    """What this host lacks for ``ds_config`` (a dict ds_muon serves): one line per problem, naming the key and
    the fix. For an NVMe ``offload_optimizer``: the ``nvme_path`` directory (exists, writable, O_DIRECT), libaio
    for DeepSpeed's async_io op, and no stale JIT build lock of that op (:func:`_async_io_build_lock_problem`).
    Writes (and removes) one probe file in ``nvme_path``. At ZeRO stage 3, ZeRO++'s ``zero_quantized_weights``,
    ``zero_quantized_nontrainable_weights`` and ``zero_quantized_gradients`` need DeepSpeed's quantizer op
    (:func:`_quantizer_missing`), absent on the CPU accelerator."""
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    problems = _quantized_problems(zero)
    offload = zero.get("offload_optimizer")
    device = offload.get("device") if isinstance(offload, dict) else None
    if str(getattr(device, "value", device)).lower() != "nvme":
        return problems
    problems += _nvme_path_problems("offload_optimizer", offload.get("nvme_path"))
    if not _async_io_available():
        problems.append("zero_optimization.offload_optimizer.device: 'nvme' needs DeepSpeed's async_io op, which "
                        "cannot be built here: libaio is missing; install it (Debian/Ubuntu: apt-get install "
                        "libaio-dev; RHEL: yum install libaio-devel), or use device 'cpu'")
    lock_problem = _async_io_build_lock_problem()
    if lock_problem is not None:
        problems.append(lock_problem)
    return problems
