"""NVMe optimizer offload, guarded: the checks DeepSpeed's swapper leaves out (layer ``integration``).

DeepSpeed 0.19.8's async I/O does not look at the result of a completed write: a write cut short by a full
filesystem (or a file size limit) completes silently, and the next swap-in reads a short file. The
:class:`SwapGuard` of a ds_muon ZeRO optimizer wraps every async_io handle of its swapper
(:class:`_CheckedAioHandle`: submissions and write sizes checked), makes every rank agree on the outcome after
each swapping phase (one all_reduce), and refuses to start when ``buffer_count`` or the filesystem is too small.
The DeepSpeed names it relies on are listed here (``NVME_*``) and checked at start-up: a renamed one raises
:class:`ds_muon.errors.DeepSpeedVersionError` instead of silently skipping a check.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..errors import SUPPORTED_DEEPSPEED, ConfigError, DeepSpeedVersionError, NvmeSwapError
from ..names import ADAM_MINI, MUON
from ..sharded.collectives import named_collective

__all__ = ["SwapGuard", "require_deepspeed_attrs", "NVME_STAGE3_METHODS", "NVME_STAGE3_ATTRS", "NVME_SWAPPER_ATTRS",
           "NVME_PIPELINED_SWAPPER_ATTRS", "NVME_GRADIENT_SWAPPER_ATTRS", "NVME_SWAP_CONFIG_ATTRS",
           "NVME_AIO_HANDLE_ATTRS"]


def _swap_write_cause(path: str, end: int, size: int) -> str:
    """The likely OS error of a swap write that left ``path`` at ``size`` of ``end`` bytes (DeepSpeed's
    async I/O drops the errno of a completed write, so it is inferred)."""
    import resource
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and end > limit:
        return f"[Errno 27] File too large: this process's file size limit (ulimit -f) is {limit} bytes"
    free = shutil.disk_usage(os.path.dirname(path)).free
    if free < end - size:
        return "[Errno 28] No space left on device (inferred: DeepSpeed's async I/O does not report it)"
    return "unknown (DeepSpeed's async I/O does not report it; an I/O error of the device?)"


def _swap_open_error(path: str, write: bool) -> str:
    """The OS error of opening ``path`` as DeepSpeed's async I/O does (O_DIRECT), or a note if it opens now."""
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | getattr(os, "O_DIRECT", 0)
    try:
        os.close(os.open(path, flags))
    except OSError as err:
        return str(err)
    if not write and os.path.exists(path):
        return f"the file holds {os.path.getsize(path)} bytes, fewer than the read needs"
    return "unknown (the file opens now)"


# DeepSpeed names the NVMe swap checks rely on (checked against deepspeed 0.19.8; pinned by
# tests/dist/test_offload.py::test_deepspeed_nvme_names_exist), by the object that holds them:
# DeepSpeedZeroOptimizer_Stage3's methods that ds_muon overrides or calls around the swapper (a renamed
# one would silently skip an override), and its attributes;
NVME_STAGE3_METHODS = ("_configure_tensor_swapping", "initialize_optimizer_states", "_swappable_optimizer_subgroup",
                       "_optimizer_states_and_gradient_swap_in", "_release_swap_buffers", "_prepare_sub_group",
                       "_release_sub_group", "_post_step", "_partition_all_parameters",
                       "_reassign_or_swap_out_partitioned_parameters")
NVME_STAGE3_ATTRS = ("optimizer_swapper", "swap_optimizer", "save_muon_momentum_buffer_in_memory")
# the optimizer swapper (Partitioned-/PipelinedOptimizerSwapper; the pipelined one also has a read and a
# write handle), its gradient swapper (AsyncTensorSwapper), its swap config
# (DeepSpeedZeroOffloadOptimizerConfig) and the async_io handles (aio_handle) that _CheckedAioHandle wraps.
NVME_SWAPPER_ATTRS = ("swap_config", "swap_folder", "gradient_swapper", "purge_state", "aio_handle")
NVME_PIPELINED_SWAPPER_ATTRS = ("read_aio_handle", "write_aio_handle")
NVME_GRADIENT_SWAPPER_ATTRS = ("aio_handle",)
NVME_SWAP_CONFIG_ATTRS = ("buffer_count", "pipeline_read", "pipeline_write")
NVME_AIO_HANDLE_ATTRS = ("async_pwrite", "async_pread", "wait")


def require_deepspeed_attrs(obj, names: tuple[str, ...], what: str) -> None:
    """Check that DeepSpeed's ``obj`` has every attribute in ``names``.

    Raises:
        DeepSpeedVersionError: naming the missing attributes, ``what`` ``obj`` is, the installed DeepSpeed
            version and :data:`SUPPORTED_DEEPSPEED` (instead of an AttributeError later, or a check that
            silently does nothing).
    """
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        import deepspeed
        owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise DeepSpeedVersionError(
            f"ds_muon: DeepSpeed {deepspeed.__version__}'s {what} ({owner}) has no {', '.join(missing)}, which "
            f"ds_muon's NVMe optimizer offload relies on. ds_muon supports deepspeed{SUPPORTED_DEEPSPEED} (tested "
            f"with 0.19.8): install one (pip install 'deepspeed{SUPPORTED_DEEPSPEED}'), or offload the optimizer to "
            "the CPU instead of NVMe")


class _CheckedAioHandle:
    """DeepSpeed's async_io handle (``aio_handle``) with the checks its optimizer swapper leaves out.

    ``async_pwrite``/``async_pread`` that cannot start (the file cannot be opened; a read of a file shorter
    than it needs is not submitted: the op's C++ assert would abort the process) and writes that leave the file shorter than ``offset + nbytes`` (checked with one
    ``os.stat`` per write at ``wait()``) are reported to ``on_error(path, write, nbytes, cause)``; the
    swapper is told they succeeded (``async_*`` return 0, ``wait()`` counts them as completed), so it
    finishes the step in step with the other ranks, and :class:`SwapGuard` raises
    :class:`NvmeSwapError` on every rank afterwards. Everything else is the wrapped handle's.
    """

    def __init__(self, handle, on_error: Callable[[str, bool, int, str], None]) -> None:
        self._handle = handle
        self._on_error = on_error
        self._pending = 0  # ops the wrapped handle holds
        self._failed = 0  # submissions that failed, reported to wait() as completed
        self._writes: list[tuple[str, int]] = []  # (path, end offset) submitted since the last wait()

    def __getattr__(self, name: str):
        return getattr(self._handle, name)

    def _submit(self, write: bool, buffer: torch.Tensor, path, args, kwargs) -> int:
        submit = self._handle.async_pwrite if write else self._handle.async_pread
        nbytes = buffer.numel() * buffer.element_size()
        offset = int(args[0] if args else kwargs.get("file_offset", 0))
        if not write and isinstance(path, str):  # a short file aborts the process in the op's C++ assert
            size = os.path.getsize(path) if os.path.exists(path) else -1
            if size < offset + nbytes:
                self._failed += 1
                self._on_error(path, False, nbytes, "the file does not exist" if size < 0 else
                               f"the file holds {size} bytes, fewer than the {offset + nbytes} the read needs")
                return 0
        if submit(buffer, path, *args, **kwargs) != 0:
            self._failed += 1
            self._on_error(str(path), write, nbytes, _swap_open_error(str(path), write))
        else:
            self._pending += 1
            if write and isinstance(path, str):
                self._writes.append((path, offset + nbytes))
        return 0

    def async_pwrite(self, buffer: torch.Tensor, path, *args, **kwargs) -> int:
        return self._submit(True, buffer, path, args, kwargs)

    def async_pread(self, buffer: torch.Tensor, path, *args, **kwargs) -> int:
        return self._submit(False, buffer, path, args, kwargs)

    def wait(self) -> int:
        done = self._handle.wait() if self._pending else 0  # its wait() asserts that ops are pending
        for path, end in self._writes:
            size = os.path.getsize(path) if os.path.exists(path) else 0
            if size < end:
                self._on_error(path, True, end, f"the file holds {size} of {end} bytes after the write: "
                               + _swap_write_cause(path, end, size))
        done += self._failed
        self._pending = self._failed = 0
        self._writes = []
        return done


class SwapGuard:
    """The NVMe swap checks of one ds_muon ZeRO optimizer ``opt`` (a ``DeepSpeedZeroOptimizer_Stage3`` with NVMe
    optimizer offload); created by its ``_configure_tensor_swapping`` override, which DeepSpeed calls inside its
    ``__init__``, before ds_muon's own ``__init__`` code runs.

    Args:
        opt: the optimizer; ``algorithm_of(i)`` gives sub-group ``i``'s algorithm.
        algorithm_of: ``sub-group -> "muon" | "adam_mini" | "adamw"`` (the param groups exist when it is called).
    """

    def __init__(self, opt, algorithm_of: Callable[[int], str]) -> None:
        self._opt = opt
        self._algorithm_of = algorithm_of
        self._errors: list[str] = []
        self.failure: Optional[str] = None

    def install(self) -> None:
        """Wrap the swapper's async_io handles in :class:`_CheckedAioHandle` (after DeepSpeed configured them).

        Raises:
            DeepSpeedVersionError: a DeepSpeed name the NVMe checks rely on is missing (:func:`require_deepspeed_attrs`).
        """
        opt = self._opt
        swapper, wrapped = opt.optimizer_swapper, {}
        require_deepspeed_attrs(opt, NVME_STAGE3_ATTRS, "ZeRO-3 optimizer")
        require_deepspeed_attrs(swapper, NVME_SWAPPER_ATTRS, "optimizer swapper")
        require_deepspeed_attrs(swapper.swap_config, NVME_SWAP_CONFIG_ATTRS, "offload_optimizer config")
        pipelined = swapper.swap_config.pipeline_read or swapper.swap_config.pipeline_write
        handles = {swapper: ("aio_handle",) + (NVME_PIPELINED_SWAPPER_ATTRS if pipelined else ()),
                   swapper.gradient_swapper: NVME_GRADIENT_SWAPPER_ATTRS}
        require_deepspeed_attrs(swapper, handles[swapper], "pipelined optimizer swapper" if pipelined
                                else "optimizer swapper")
        require_deepspeed_attrs(swapper.gradient_swapper, NVME_GRADIENT_SWAPPER_ATTRS, "gradient swapper")
        for owner, names in handles.items():
            for name in names:
                handle = getattr(owner, name)
                if not isinstance(handle, _CheckedAioHandle):
                    require_deepspeed_attrs(handle, NVME_AIO_HANDLE_ATTRS, f"async_io handle {name}")
                    if id(handle) not in wrapped:
                        wrapped[id(handle)] = _CheckedAioHandle(handle, self.record)
                    setattr(owner, name, wrapped[id(handle)])

    def check_names(self) -> None:
        """The DeepSpeed ZeRO-3 methods the NVMe checks override or call (:data:`NVME_STAGE3_METHODS`) exist, and
        the swapper's handles were wrapped (a renamed ``_configure_tensor_swapping`` would skip the override)."""
        require_deepspeed_attrs(DeepSpeedZeroOptimizer_Stage3, NVME_STAGE3_METHODS, "ZeRO-3 optimizer class")
        if getattr(self._opt, "swap_guard", None) is not self:
            raise DeepSpeedVersionError(
                "ds_muon: DeepSpeed's ZeRO-3 optimizer set up NVMe swapping without calling "
                f"_configure_tensor_swapping, so ds_muon's swap I/O checks are not installed. ds_muon supports "
                f"deepspeed{SUPPORTED_DEEPSPEED} (tested with 0.19.8): install one, or offload the optimizer to the CPU")

    def record(self, path: str, write: bool, nbytes: int, cause: str) -> None:
        """Called by :class:`_CheckedAioHandle`: note a failed swap write or read of ``path`` on this rank."""
        stem = os.path.basename(path).removesuffix(".tensor.swp")
        ds_id = stem.partition("_gradient_")[0].rpartition("-")[2]  # <state>-<id>, <id>_gradient_<off>_<len>
        groups = [i for i, fp32 in enumerate(getattr(self._opt, "fp32_partitioned_groups_flat", ()))
                  if str(getattr(fp32, "ds_id", "")) == ds_id]
        where = f"ZeRO sub-group {groups[0]}" if groups else "a swap file"
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._errors.append(f"rank {rank}, {where}: {'writing' if write else 'reading'} {nbytes} bytes of "
                            f"{path} failed: {cause}")

    def agree(self, what: str) -> None:
        """Collective over the data-parallel group (one all_reduce of one int32; with a failure also an
        all_gather of the messages), so that every rank raises the same :class:`NvmeSwapError` at the same
        point.

        Raises:
            NvmeSwapError: some rank's swap I/O failed since the last check, naming ``nvme_path``, the bytes
                that rank's swap files need, the failing file and the OS error where known.
        """
        opt = self._opt
        failed = torch.tensor([len(self._errors)], dtype=torch.int32,
                              device=get_accelerator().current_device_name())
        with named_collective(f"the NVMe swap error check after {what}"):
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=opt.dp_process_group)
            if int(failed.item()) == 0:
                return
            reports = [None] * dist.get_world_size(group=opt.dp_process_group)
            dist.all_gather_object(reports, self._errors[:3], group=opt.dp_process_group)
        lines = [line for report in reports for line in report]
        self.failure = (
            f"ds_muon: the NVMe optimizer swap failed during {what}:\n  " + "\n  ".join(lines)
            + f"\nzero_optimization.offload_optimizer.nvme_path: {self._space()[0]}. Free space there or point "
            "nvme_path at a larger drive (or fix what the OS error names), then resume from the last checkpoint: this run's "
            "optimizer state is no longer trustworthy, so it is not stepped or saved any more (checkpoints "
            "saved before are not affected)")
        self._errors.clear()
        raise NvmeSwapError(self.failure)

    def refuse_if_failed(self) -> None:
        """Raise the recorded :class:`NvmeSwapError` again (every rank recorded it at the same point)."""
        if self.failure:
            raise NvmeSwapError(self.failure)

    def buffers_needed(self) -> int:
        """Pinned swap buffers DeepSpeed's optimizer swapper needs for this model's sub-groups.

        A swapped sub-group holds one buffer per swapped tensor while resident: fp32 weights,
        gradient, and its state (AdamW: ``exp_avg``, ``exp_avg_sq`` = 4 in all; Muon: ``momentum_buffer``
        = 3, or 2 with ``save_muon_momentum_buffer_in_memory``; Adam-mini: ``exp_avg`` = 3). The
        partitioned swapper holds one sub-group at a time; the pipelined one also the next (``pipeline_read``) and/or the previous
        (``pipeline_write``), so the need is the largest sum over that many consecutive swapped
        sub-groups. (Measured on CPU with DeepSpeed 0.19.8: one Muon and one AdamW sub-group need
        4 without pipelining, 7 with it, 6 with momentum in memory; one fewer fails.)

        Returns:
            the number of buffers (count; each is the largest swapped sub-group's partition in fp32);
            0 when no sub-group is swapped.
        """
        counts = [self._swapped_tensors(i) for i in range(len(self._opt.fp16_groups))
                  if self._opt._swappable_optimizer_subgroup(i)]
        cfg = self._opt.optimizer_swapper.swap_config
        window = 1 + bool(cfg.pipeline_read) + bool(cfg.pipeline_write)
        return max((sum(counts[k:k + window]) for k in range(max(1, len(counts) - window + 1))), default=0)

    def check_buffer_count(self) -> None:
        """Raise ConfigError (naming ``offload_optimizer.buffer_count`` and the count needed) when
        ``buffer_count`` is below :meth:`buffers_needed`."""
        cfg = self._opt.optimizer_swapper.swap_config
        needed = self.buffers_needed()
        if cfg.buffer_count < needed:
            pipelined = [k for k in ("pipeline_read", "pipeline_write") if getattr(cfg, k)]
            how = (f"the pipelined swapper ({' and '.join(pipelined)}) keeps {1 + len(pipelined)} consecutive "
                   "sub-groups resident" if pipelined else "the swapper keeps one sub-group resident")
            raise ConfigError(
                f"zero_optimization.offload_optimizer.buffer_count: {cfg.buffer_count} is too small for this model: "
                f"{how}, each needing one pinned buffer per swapped tensor (fp32 weights, gradient, and "
                f"exp_avg + exp_avg_sq for AdamW, the Muon momentum or Adam-mini's exp_avg); set buffer_count to "
                f"at least {needed}")

    def bytes_needed(self) -> int:
        """Bytes of NVMe swap files this rank writes: per swapped sub-group, its fp32 partition, gradient and
        optimizer state (:meth:`_swapped_tensors` fp32 tensors of the partition's size). DeepSpeed's block
        alignment adds at most a few KiB per file."""
        opt = self._opt
        return sum(self._swapped_tensors(i) * 4 * int(opt.fp16_partitioned_groups_flat_numel[i])
                   for i in range(len(opt.fp16_groups)) if opt._swappable_optimizer_subgroup(i))

    def _swapped_tensors(self, i: int) -> int:
        """Tensors of the partition's size that a swapped sub-group ``i`` swaps: fp32 weights and gradient,
        plus AdamW's ``exp_avg`` and ``exp_avg_sq`` (4), Muon's ``momentum_buffer`` (3; 2 with
        ``save_muon_momentum_buffer_in_memory``) or Adam-mini's ``exp_avg`` (3: its per-block second
        moments stay in memory)."""
        algorithm = self._algorithm_of(i)
        if algorithm == MUON:
            return 2 if self._opt.save_muon_momentum_buffer_in_memory else 3
        return 3 if algorithm == ADAM_MINI else 4

    def check_space(self) -> None:
        """Refuse to start when the NVMe swap directory's filesystem cannot hold the swap files of this node's
        ranks (``LOCAL_WORLD_SIZE`` of them, which share it), before the first swap writes anything.

        Raises:
            ConfigError: naming ``nvme_path``, the bytes needed and the bytes free.
        """
        text, short = self._space()
        if short:
            raise ConfigError(f"zero_optimization.offload_optimizer.nvme_path: {text}; free space there or point "
                              "nvme_path at a larger drive")

    def _space(self) -> tuple[str, bool]:
        """``(what the swap filesystem has and the swap files need, whether it is too little)``: this node's
        ``LOCAL_WORLD_SIZE`` ranks share the filesystem of ``nvme_path``."""
        folder = self._opt.optimizer_swapper.swap_folder
        need = self.bytes_needed()
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        free = shutil.disk_usage(folder).free
        return (f"the filesystem of {folder} has {free} bytes free, and the optimizer swap files need {need} bytes per "
                f"rank ({need * local} for the {local} rank(s) of this node)", free < need * local)

    def check_before_first_swap(self) -> None:
        """Before DeepSpeed's ``initialize_optimizer_states`` (its first swap-in is in there): the DeepSpeed names,
        ``buffer_count`` (:meth:`buffers_needed`) and the free space (:meth:`bytes_needed`).

        Raises:
            DeepSpeedVersionError: a name is missing. ConfigError: ``buffer_count`` or the filesystem is too small.
        """
        self.check_names()
        self.check_buffer_count()
        self.check_space()
