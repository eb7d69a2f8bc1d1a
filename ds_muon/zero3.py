"""DeepSpeed glue: the ZeRO-3 optimizer subclass that runs Muon on flattened fp32 partitions.

This is the only module (with :mod:`ds_muon.integration`) that touches DeepSpeed internals.
Checked against deepspeed 0.19.8 (``DeepSpeedZeroOptimizer_Stage3``); see design.md §2.

When the parent's ``step()`` calls ``_optimizer_step(sub_group_id)``, the sub-group's gradient
in ``fp32_partitioned_groups_flat[i].grad`` is final: accumulated over micro-batches, reduced
(reduce-scatter or all-reduce, whichever the config says), unscaled and clipped on the raw
global norm. Every rank calls it for every sub-group in the same order, so the owner exchange's
collectives are safe there. AdamW sub-groups go to the parent unchanged (FusedAdam, or
DeepSpeedCPUAdam when offloaded).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import time
import traceback

from typing import Callable, Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT
from torch.profiler import record_function
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import logger

from .adam_mini import BLOCK_ATTR, BLOCK_STATE_KEY, adam_mini_shard_update_, block_square_sums, shard_chunks
from .blocks import PADDING, BlockMap, build_block_map
from .checkpoint import (CheckpointError, add_metadata, check_zero_state_dict, load_universal_state,
                         restore_step_count, rigid_load_arguments)
from .config import ConfigError, resolve_exchange_dtype
from .exchange import BufferPool, OwnerExchange
from .matrix import SPLIT_ATTR, update_scale
from .momentum import apply_update_, fused_apply_update_, fused_momentum_update_, momentum_update_
from .newton_schulz import AUTOTUNE_COMPILE, COMPILE_GRAPH_LIMIT, compiled_orthogonalize, orthogonalize, resolve_ns_dtype
from .ownership import BucketedPlan, ParamInfo, build_bucketed_plan
from .qk_clip import check_recorded, factor_vector, find_clip_targets, partition_ranges, take_max_logits
from .reference import MOMENTUM_KEY


def cast_momentum_(state: dict, group: dict) -> None:
    """Store ``state``'s Muon momentum (if any) in the group's ``momentum_dtype`` (loads give fp32)."""
    momentum = state.get(MOMENTUM_KEY)
    dtype = getattr(torch, group.get("momentum_dtype", "float32"))
    if momentum is not None and momentum.dtype != dtype:
        state[MOMENTUM_KEY] = momentum.to(dtype)


class CollectiveError(RuntimeError):
    """A collective failed, most likely because a peer rank died; the message names the collective.

    Raised from the backend's own error (chained as ``__cause__``): gloo reports a dead peer at once
    ("Connection closed by peer"); NCCL reports it when its watchdog times out. A peer that hangs
    instead of dying is bounded by the process-group timeout: ``deepspeed.init_distributed(timeout=
    datetime.timedelta(minutes=N))`` (DeepSpeed's default: 30 minutes). See docs/troubleshooting.md.
    Only errors that come from a collective become this (:func:`_from_collective`); any other error
    raised inside a named block (a bug in an element-wise function, a shape error) propagates unchanged.
    """


# A communication backend's own error text: gloo's ("[.../third_party/gloo/...] Read error ...: Connection
# reset by peer", "Timed out waiting ..."), NCCL/RCCL/HCCL/oneCCL's, a watchdog timeout's.
_BACKEND_MESSAGE = re.compile(r"gloo|[nrhx]ccl|oneccl|connection (closed|reset) by peer|timed out|timeout|watchdog",
                              re.IGNORECASE)
# Frames of the communication layers: torch.distributed (c10d) and DeepSpeed's comm wrappers.
_COMM_FILES = (os.sep + os.path.join("torch", "distributed", ""), os.sep + os.path.join("deepspeed", "comm", ""))


def _from_collective(err: BaseException) -> bool:
    """Whether ``err`` (caught inside a :func:`_named_collective` block) came from a collective: a
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
def _named_collective(what: str):
    """Re-raise an error of a collective inside the block (:func:`_from_collective`) as a
    :class:`CollectiveError` naming ``what``; any other error propagates unchanged."""
    try:
        yield
    except (CollectiveError, torch.OutOfMemoryError, torch._dynamo.exc.TorchDynamoException):
        raise  # out of memory or a compile error inside Newton-Schulz is not a dead peer
    except RuntimeError as err:  # gloo: RuntimeError; NCCL: torch.distributed.DistBackendError (a subclass)
        if not _from_collective(err):
            raise  # not a collective's error (e.g. of an element-wise function inside DeepSpeed's step)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise CollectiveError(
            f"ds_muon: {what} failed on rank {rank}: {err}\nA peer rank probably exited or lost its connection: "
            "check the other ranks' logs for the first error. A rank that hangs instead is bounded by the "
            "process-group timeout (deepspeed.init_distributed(timeout=...), 30 minutes by default)") from err


def _elementwise(group: dict) -> bool:
    """Whether a param group is stepped by the element-wise AdamW (not Muon, not Adam-mini)."""
    return not group["use_muon"] and not group.get("adam_mini", False)


class NvmeSwapError(RuntimeError):
    """An NVMe optimizer swap file could not be written (or read back) during the run.

    DeepSpeed 0.19.8's async I/O does not look at the result of a completed write: a write cut short
    by a full filesystem (or a file size limit) completes silently, and the next swap-in reads a short
    file. ds_muon checks every swap write (:class:`_CheckedAioHandle`: the file must hold all the bytes
    written) and every submission, and all ranks agree on the outcome after each optimizer step (one
    all_reduce), so every rank raises this error together instead of one rank failing mid-step while the
    others wait in the next collective. The message names ``zero_optimization.offload_optimizer.nvme_path``,
    the failing rank, sub-group and file, the bytes written and needed, the OS error where known, and
    the fix. Afterwards the optimizer refuses to step or save (its state is no longer trustworthy);
    checkpoints saved before are untouched.
    """


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


# The DeepSpeed releases ds_muon supports: pyproject.toml's pin (tests/test_offload.py checks they agree).
SUPPORTED_DEEPSPEED = ">=0.18.9,<0.20"


class DeepSpeedVersionError(RuntimeError):
    """The installed DeepSpeed lacks an attribute ds_muon relies on (a release outside
    :data:`SUPPORTED_DEEPSPEED` renamed or removed it); the message names the attribute, its owner,
    the installed version and the supported range."""


# DeepSpeed names the NVMe swap checks rely on (checked against deepspeed 0.19.8; pinned by
# tests/test_offload.py::test_deepspeed_nvme_names_exist), by the object that holds them:
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
    finishes the step in step with the other ranks, and :class:`MuonZeroOptimizer` raises
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


class ZeroMuonInner(torch.optim.Optimizer):
    """The "basic" optimizer that DeepSpeed's ZeRO-3 wraps when the config says ``"Muon"``.

    It holds every param group (each flagged ``use_muon``) and one ``state`` dict. AdamW groups
    are stepped by an element-wise optimizer built by ``adamw_factory`` (DeepSpeed's FusedAdam, or
    DeepSpeedCPUAdam under optimizer offload) that shares these group dicts and this state, so
    checkpoints see a single optimizer. Muon groups are stepped by :class:`MuonZeroOptimizer`,
    which needs the owner exchange; calling :meth:`step` with a non-empty Muon group is an error.

    It is deliberately not DeepSpeed's ``MuonWithAuxAdam``: that class switches on the built-in
    ZeRO-3 Muon path, which must never run alongside ours.

    Args:
        param_groups: from :func:`ds_muon.param_groups.split_param_groups`.
        adamw_factory: ``groups -> torch.optim.Optimizer`` for the AdamW groups, or ``None``.
        config: the validated :class:`ds_muon.config.MuonOptimizerParams`.
    """

    def __init__(self, param_groups: list[dict], adamw_factory: Optional[Callable[[list[dict]], torch.optim.Optimizer]],
                 config) -> None:
        super().__init__(param_groups, {})
        self.config = config
        self.adamw = None
        adam_groups = [g for g in self.param_groups if _elementwise(g)]
        if adam_groups and adamw_factory is not None:
            self.adamw = adamw_factory(adam_groups)
        self._share_with_adamw()

    def _share_with_adamw(self) -> None:
        if self.adamw is None:
            return
        adam_groups = [g for g in self.param_groups if _elementwise(g)]
        for group in adam_groups:
            for key, value in self.adamw.defaults.items():
                group.setdefault(key, value)
        self.adamw.param_groups = adam_groups
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as ``torch.optim.Optimizer`` does (which casts state to the fp32 partitions' dtype and
        takes the saved groups' hyperparameters), keep this run's ``momentum_dtype`` (the config's, not
        the checkpoint's: a bf16 momentum must not reach an NVMe swapper the config checks assumed
        fp32 for), put each Muon momentum in it, then re-share groups and state with the AdamW."""
        live = [group.get("momentum_dtype") for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, dtype in zip(self.param_groups, live):
            if dtype is not None:
                group["momentum_dtype"] = dtype
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    cast_momentum_(self.state.get(p, {}), group)
        self._share_with_adamw()

    @torch.no_grad()
    def step(self, closure=None):
        """Step the AdamW groups that currently hold parameters.

        Raises:
            RuntimeError: a Muon group holds parameters (those are stepped by MuonZeroOptimizer).
        """
        for group in self.param_groups:
            if not _elementwise(group) and group["params"]:
                raise RuntimeError("Muon and Adam-mini param groups are stepped by ds_muon.zero3.MuonZeroOptimizer, "
                                   "not by the inner optimizer; was ZeRO stage 3 configured?")
        if self.adamw is None:
            return closure() if closure is not None else None
        return self.adamw.step(closure)


class ZeroAdamMiniInner(ZeroMuonInner):
    """The "basic" optimizer DeepSpeed's ZeRO-3 wraps when the config says ``"AdamMini"``.

    Its param groups come from :func:`ds_muon.adam_mini.adam_mini_param_groups`: groups flagged
    ``adam_mini`` (parameters tagged with their block size) are stepped by :class:`MuonZeroOptimizer`'s
    Adam-mini sub-group step; the per-element groups (embeddings, output heads, biases) by the
    element-wise AdamW built by ``adamw_factory`` (FusedAdam, or DeepSpeedCPUAdam when offloaded),
    which is Adam-mini with one-element blocks. ``config`` is the validated
    :class:`ds_muon.config.AdamMiniOptimizerParams`.
    """


class AdamMiniSlot:
    """One parameter of an Adam-mini sub-group as :func:`ds_muon.blocks.build_block_map` reads it (elements)."""

    def __init__(self, name: str, shape: tuple, numel: int, chunk: int, shard_offset: int, block: int) -> None:
        self.name, self.shape, self.numel, self.chunk, self.shard_offset, self.block = (
            name, shape, numel, chunk, shard_offset, block)


class MuonZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` with a distributed Muon step for Muon sub-groups.

    Per Muon sub-group and optimizer step (design.md §3), on the local fp32 shard ``(n,)``:

    1. ``m <- beta*m + (1-beta)*g`` and ``u <- lerp(g, m, beta)`` (Nesterov) or ``u <- m``,
       element-wise; the momentum ``m`` (fp32, or bf16 with ``momentum_dtype``) never leaves its rank.
    2. :class:`~ds_muon.exchange.OwnerExchange`: all_to_all ``u``'s chunks to each matrix's owner
       rank, Newton–Schulz batched by shape there, scale, all_to_all back.
    3. ``p <- p*(1 - lr*wd) - lr*o`` on the shard (decoupled weight decay).

    On CUDA with ``ns_compile`` (the default), steps 1 and 3 each run as one compiled pass over the
    shard (:func:`ds_muon.momentum.fused_momentum_update_`, :func:`ds_muon.momentum.fused_apply_update_`);
    on CPU (and under CPU offload) they run eagerly.

    No gradient, no step (as the oracle :class:`ds_muon.MuonAdamW`): a matrix of a parameter's
    Newton–Schulz view (one expert of a stacked parameter) whose gradient is zero on every rank keeps
    its momentum and weights (:meth:`_blocks_with_gradient`: one byte per matrix, all_reduce MAX over
    the partition group, for every Muon sub-group whose gradient is in memory at once: one collective
    and one host sync per step, plus one per NVMe-swapped sub-group); a sub-group with no gradient at
    all skips the exchange.

    The owner plan (:func:`ds_muon.ownership.build_bucketed_plan`: LPT by Newton–Schulz FLOPs, cut
    into ``exchange_bucket_mb`` buckets that are pipelined so the all_to_all of one bucket overlaps
    Newton–Schulz on another) is built once per sub-group at construction, identically on every rank.

    ``__init__`` passes ``*args, **kwargs`` through unchanged (the keyword set changes between
    DeepSpeed releases).

    Attributes:
        muon_plans: ``{sub_group_id: BucketedPlan}`` for the Muon sub-groups.
        muon_step_count: optimizer steps that ran the Muon update (overflow-skipped ones excluded).
        skipped_step_count: optimizer steps skipped because the global gradient norm was NaN/Inf (this process).
        consecutive_skipped_steps: skipped steps since the last applied one; ``optimizer.params.
            max_consecutive_skipped_steps`` of them in a row stop the run (RuntimeError).
        last_non_finite_param: name of the first parameter with a non-finite gradient in the last skipped step.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.swap_optimizer:  # in case DeepSpeed's step that runs initialize_optimizer_states was renamed
            self._check_nvme_names()
        if not isinstance(self.optimizer, ZeroMuonInner):
            raise TypeError("MuonZeroOptimizer needs a ds_muon ZeroMuonInner optimizer; "
                            "build the engine through ds_muon.initialize or ds_muon.enable()")
        self.muon_step_count = 0
        self.skipped_step_count = 0
        self.consecutive_skipped_steps = 0
        self.last_non_finite_param: Optional[str] = None
        self._stepping = False
        self._offloaded_grad_ids: set[int] = set()  # ds_ids whose gradient DeepSpeed offloaded this window
        # zero_optimization.save_muon_momentum_buffer_in_memory: keep Muon momentum out of the NVMe swap.
        self._momentum_in_memory = bool(self.swap_optimizer and self.save_muon_momentum_buffer_in_memory)
        self._monitor = None
        self._monitor_step: Optional[Callable[[], int]] = None
        self._muon_seconds = 0.0
        self._adam_mini_seconds = 0.0
        self.muon_plans: dict[int, BucketedPlan] = {}
        self._muon_pool = BufferPool()
        self._muon_exchanges: dict[int, OwnerExchange] = {}
        self._muon_block_maps: dict[int, BlockMap] = {}
        self._block_index: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._step_flags: dict[int, torch.Tensor] = {}  # this step's no-gradient flags, computed ahead
        self._build_muon_plans()
        self.adam_mini_maps: dict[int, BlockMap] = {}
        self._adam_mini_block_numel: dict[int, list[int]] = {}  # global elements of each block
        self._adam_mini_index: dict[int, tuple[torch.Tensor, ...]] = {}
        self._build_adam_mini_maps()
        self._check_trainable_set()  # records the trainable set
        self.qk_clip_stats: Optional[dict] = None
        self._qk_factors: Optional[list[float]] = None
        self._build_qk_clip()

    # ---- setup ---------------------------------------------------------------------------
    def initialize_optimizer_states(self) -> None:
        """DeepSpeed's, after checking the NVMe swapper's ``buffer_count`` (its first swap-in is in there);
        then every rank agrees that the initial swap writes succeeded.

        Raises:
            ConfigError: ``offload_optimizer.buffer_count`` is below :meth:`swap_buffers_needed`.
            NvmeSwapError: a swap file could not be written (on every rank).
        """
        if self.swap_optimizer:
            self._check_nvme_names()  # before the first swap (also: was _configure_tensor_swapping called?)
            self._check_swap_buffer_count()
            self._check_swap_space()
        super().initialize_optimizer_states()
        self._agree_on_swap_errors("the initial swap-out of the optimizer state")

    # ---- NVMe swap I/O errors ------------------------------------------------------------
    def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
        """DeepSpeed's, then its swapper's async_io handles are wrapped in :class:`_CheckedAioHandle`.

        Raises:
            DeepSpeedVersionError: a DeepSpeed name the NVMe checks rely on is missing (:func:`require_deepspeed_attrs`).
        """
        super()._configure_tensor_swapping(offload_optimizer_config, aio_config)
        self._swap_errors: list[str] = []
        self._swap_failure: Optional[str] = None
        swapper, wrapped = self.optimizer_swapper, {}
        require_deepspeed_attrs(self, NVME_STAGE3_ATTRS, "ZeRO-3 optimizer")
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
                        wrapped[id(handle)] = _CheckedAioHandle(handle, self._record_swap_error)
                    setattr(owner, name, wrapped[id(handle)])

    def _check_nvme_names(self) -> None:
        """The DeepSpeed ZeRO-3 methods the NVMe checks override or call (:data:`NVME_STAGE3_METHODS`) exist, and
        the swapper's handles were wrapped (a renamed ``_configure_tensor_swapping`` would skip the override)."""
        require_deepspeed_attrs(DeepSpeedZeroOptimizer_Stage3, NVME_STAGE3_METHODS, "ZeRO-3 optimizer class")
        if not hasattr(self, "_swap_errors"):
            raise DeepSpeedVersionError(
                "ds_muon: DeepSpeed's ZeRO-3 optimizer set up NVMe swapping without calling "
                f"_configure_tensor_swapping, so ds_muon's swap I/O checks are not installed. ds_muon supports "
                f"deepspeed{SUPPORTED_DEEPSPEED} (tested with 0.19.8): install one, or offload the optimizer to the CPU")

    def _record_swap_error(self, path: str, write: bool, nbytes: int, cause: str) -> None:
        """Called by :class:`_CheckedAioHandle`: note a failed swap write or read of ``path`` on this rank."""
        stem = os.path.basename(path).removesuffix(".tensor.swp")
        ds_id = stem.partition("_gradient_")[0].rpartition("-")[2]  # <state>-<id>, <id>_gradient_<off>_<len>
        groups = [i for i, fp32 in enumerate(getattr(self, "fp32_partitioned_groups_flat", ()))
                  if str(getattr(fp32, "ds_id", "")) == ds_id]
        where = f"ZeRO sub-group {groups[0]}" if groups else "a swap file"
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._swap_errors.append(f"rank {rank}, {where}: {'writing' if write else 'reading'} {nbytes} bytes of "
                                 f"{path} failed: {cause}")

    def _agree_on_swap_errors(self, what: str) -> None:
        """Collective over the data-parallel group (one all_reduce of one int32; with a failure also an
        all_gather of the messages), so that every rank raises the same :class:`NvmeSwapError` at the same
        point. No-op without NVMe swap.

        Raises:
            NvmeSwapError: some rank's swap I/O failed since the last check, naming ``nvme_path``, the bytes
                that rank's swap files need, the failing file and the OS error where known.
        """
        if not self.swap_optimizer:
            return
        failed = torch.tensor([len(self._swap_errors)], dtype=torch.int32,
                              device=get_accelerator().current_device_name())
        with _named_collective(f"the NVMe swap error check after {what}"):
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.dp_process_group)
            if int(failed.item()) == 0:
                return
            reports = [None] * dist.get_world_size(group=self.dp_process_group)
            dist.all_gather_object(reports, self._swap_errors[:3], group=self.dp_process_group)
        folder = self.optimizer_swapper.swap_folder
        need, local = self.swap_bytes_needed(), max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        lines = [line for report in reports for line in report]
        self._swap_failure = (
            f"ds_muon: the NVMe optimizer swap failed during {what}:\n  " + "\n  ".join(lines)
            + f"\nzero_optimization.offload_optimizer.nvme_path: the swap directory {folder} has "
            f"{shutil.disk_usage(folder).free} bytes free; the optimizer swap files need {need} bytes per rank "
            f"({need * local} for the {local} rank(s) of this node). Free space there or point nvme_path at a "
            "larger drive (or fix what the OS error names), then resume from the last checkpoint: this run's "
            "optimizer state is no longer trustworthy, so it is not stepped or saved any more (checkpoints "
            "saved before are not affected)")
        self._swap_errors.clear()
        raise NvmeSwapError(self._swap_failure)

    def _refuse_after_swap_failure(self) -> None:
        """Raise the recorded :class:`NvmeSwapError` again (every rank recorded it at the same point)."""
        if getattr(self, "_swap_failure", None):
            raise NvmeSwapError(self._swap_failure)

    def swap_buffers_needed(self) -> int:
        """Pinned swap buffers DeepSpeed's optimizer swapper needs for this model's sub-groups.

        A swapped sub-group holds one buffer per swapped tensor while resident: fp32 weights,
        gradient, and its state (AdamW: ``exp_avg``, ``exp_avg_sq`` = 4 in all; Muon: ``momentum_buffer``
        = 3, or 2 with ``save_muon_momentum_buffer_in_memory``; Adam-mini: ``exp_avg`` = 3). The
        partitioned swapper holds one
        sub-group at a time; the pipelined one also the next (``pipeline_read``) and/or the previous
        (``pipeline_write``), so the need is the largest sum over that many consecutive swapped
        sub-groups. (Measured on CPU with DeepSpeed 0.19.8: one Muon and one AdamW sub-group need
        4 without pipelining, 7 with it, 6 with momentum in memory; one fewer fails.)

        Returns:
            the number of buffers (count; each is the largest swapped sub-group's partition in fp32);
            0 when no sub-group is swapped.
        """
        counts = [self._swapped_tensors(i) for i in range(len(self.fp16_groups))
                  if self._swappable_optimizer_subgroup(i)]
        cfg = self.optimizer_swapper.swap_config
        window = 1 + bool(cfg.pipeline_read) + bool(cfg.pipeline_write)
        return max((sum(counts[k:k + window]) for k in range(max(1, len(counts) - window + 1))), default=0)

    def _check_swap_buffer_count(self) -> None:
        cfg = self.optimizer_swapper.swap_config
        needed = self.swap_buffers_needed()
        if cfg.buffer_count < needed:
            pipelined = [k for k in ("pipeline_read", "pipeline_write") if getattr(cfg, k)]
            how = (f"the pipelined swapper ({' and '.join(pipelined)}) keeps {1 + len(pipelined)} consecutive "
                   "sub-groups resident" if pipelined else "the swapper keeps one sub-group resident")
            raise ConfigError(
                f"zero_optimization.offload_optimizer.buffer_count: {cfg.buffer_count} is too small for this model: "
                f"{how}, each needing one pinned buffer per swapped tensor (fp32 weights, gradient, and "
                f"exp_avg + exp_avg_sq for AdamW, the Muon momentum or Adam-mini's exp_avg); set buffer_count to "
                f"at least {needed}")

    def swap_bytes_needed(self) -> int:
        """Bytes of NVMe swap files this rank writes: per swapped sub-group, its fp32 partition, gradient and
        optimizer state (:meth:`_swapped_tensors` fp32 tensors of the partition's size). DeepSpeed's block
        alignment adds at most a few KiB per file."""
        return sum(self._swapped_tensors(i) * 4 * int(self.fp16_partitioned_groups_flat_numel[i])
                   for i in range(len(self.fp16_groups)) if self._swappable_optimizer_subgroup(i))

    def _swapped_tensors(self, i: int) -> int:
        """Tensors of the partition's size that a swapped sub-group ``i`` swaps: fp32 weights and gradient,
        plus AdamW's ``exp_avg`` and ``exp_avg_sq`` (4), Muon's ``momentum_buffer`` (3; 2 with
        ``save_muon_momentum_buffer_in_memory``) or Adam-mini's ``exp_avg`` (3: its per-block second
        moments stay in memory)."""
        group = self._muon_group(i)
        if group["use_muon"]:
            return 2 if self.save_muon_momentum_buffer_in_memory else 3
        return 3 if group.get("adam_mini") else 4

    def _check_swap_space(self) -> None:
        """Refuse to start when the NVMe swap directory's filesystem cannot hold the swap files of this node's
        ranks (``LOCAL_WORLD_SIZE`` of them, which share it), before the first swap writes anything.

        Raises:
            ConfigError: naming ``nvme_path``, the bytes needed and the bytes free.
        """
        folder = self.optimizer_swapper.swap_folder
        need = self.swap_bytes_needed()
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        free = shutil.disk_usage(folder).free
        if free < need * local:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.nvme_path: the filesystem of {folder} has {free} bytes free, "
                f"but the optimizer swap files need {need} bytes per rank ({need * local} for the {local} rank(s) of "
                "this node); free space there or point nvme_path at a larger drive")

    def _muon_group(self, sub_group_id: int) -> dict:
        return self.optimizer.param_groups[self.sub_group_to_group_id[sub_group_id]]

    def _build_muon_plans(self) -> None:
        device = torch.device(get_accelerator().current_device_name())
        for i, params in enumerate(self.fp16_groups):
            group = self._muon_group(i)
            if not group["use_muon"]:
                continue
            infos = [ParamInfo(self.param_names.get(p, f"ds_id={p.ds_id}"), tuple(p.ds_shape), int(p.ds_numel),
                               getattr(p, SPLIT_ATTR, None)) for p in params]
            compute = resolve_ns_dtype(group["ns_dtype"], group["ns_method"], device)
            wire = getattr(torch, resolve_exchange_dtype(group["exchange_dtype"], compute))
            bucket_elements = max(1, int(self.optimizer.config.exchange_bucket_mb * 2**20) // wire.itemsize)
            plan = build_bucketed_plan(infos, self._get_sub_group_partition_count(i), bucket_elements,
                                       group["ns_steps"], group["ns_method"])
            if plan.shard_numel != self.fp16_partitioned_groups_flat_numel[i]:
                raise RuntimeError(f"ds_muon: sub-group {i} holds {self.fp16_partitioned_groups_flat_numel[i]} "
                                   f"elements but its owner plan covers {plan.shard_numel}; this DeepSpeed "
                                   "version lays out ZeRO-3 partitions differently than ds_muon expects")
            self.muon_plans[i] = plan
            self._muon_block_maps[i] = build_block_map(plan.slots, self._get_sub_group_partition_rank(i),
                                                       plan.shard_numel)
            self._muon_exchanges[i] = OwnerExchange(self._get_sub_group_process_group(i), wire, compute, device,
                                                    self._muon_pool)
            if self._get_sub_group_partition_rank(i) == 0:
                logger.info("ds_muon sub-group %d: %s", i, plan.describe())
        self._check_autotune_graphs(device)

    def _check_autotune_graphs(self, device: torch.device) -> None:
        """With ``ns_autotune`` on CUDA: every distinct Newton–Schulz call shape of a rank is a static graph;
        refuse more than ``COMPILE_GRAPH_LIMIT`` of them (past it torch.compile would run the rest eagerly).
        Every rank has every plan, so all ranks see the same count and raise together.

        Raises:
            ConfigError: naming ``optimizer.params.ns_autotune`` and the count.
        """
        cfg = self.optimizer.config
        if not (self.muon_plans and cfg.ns_autotune and cfg.ns_compile and device.type == "cuda"):
            return
        plans = list(self.muon_plans.values())
        worst = max(len(set().union(*(p.ns_call_shapes(r) for p in plans)))
                    for r in range(max(p.world_size for p in plans)))
        if worst > COMPILE_GRAPH_LIMIT:
            raise ConfigError(f"optimizer.params.ns_autotune: this model's owner plan makes {worst} distinct "
                              f"Newton-Schulz call shapes on one rank, more than the {COMPILE_GRAPH_LIMIT} static "
                              "graphs ds_muon lets torch.compile build (the rest would silently run eagerly); "
                              "set ns_autotune: false (dynamic shapes, few graphs)")

    def _build_adam_mini_maps(self) -> None:
        """The :class:`~ds_muon.blocks.BlockMap` of every Adam-mini sub-group on this rank, from the parameters'
        global numel and block size (``param.ds_adam_mini_block``) and DeepSpeed's ``grad_position``."""
        for i, params in enumerate(self.fp16_groups):
            if not self._muon_group(i).get("adam_mini"):
                continue
            slots = []
            for p in params:
                _, offset, chunk = self.grad_position[self.get_param_id(p)]
                name = self.param_names.get(p, f"ds_id={p.ds_id}")
                block, numel = getattr(p, BLOCK_ATTR, None), int(p.ds_numel)
                if not block or numel % block or chunk != -(-numel // self._get_sub_group_partition_count(i)):
                    raise RuntimeError(f"ds_muon: Adam-mini parameter {name!r} ({numel} elements, block {block}, "
                                       f"chunk {chunk}) does not fit the ZeRO-3 layout ds_muon expects")
                slots.append(AdamMiniSlot(name, tuple(p.ds_shape), numel, int(chunk), int(offset), int(block)))
            shard = int(self.fp16_partitioned_groups_flat_numel[i])
            self.adam_mini_maps[i] = build_block_map(slots, self._get_sub_group_partition_rank(i), shard,
                                                     block_numel=lambda s: s.block)
            self._adam_mini_block_numel[i] = [s.block for s in sorted(slots, key=lambda s: s.shard_offset)
                                              for _ in range(s.numel // s.block)]

    def _build_qk_clip(self) -> None:
        """QK-clip's plan (``optimizer.params.qk_clip``): the attention modules and, per sub-group, the flat
        ranges of this rank's fp32 partition that hold each query/key head's rows (:mod:`ds_muon.qk_clip`)."""
        self._qk_targets, self._qk_ranges = [], {}
        qk_clip = getattr(self.optimizer.config, "qk_clip", None)  # Muon's option; AdamMini has none
        if qk_clip is None or not qk_clip.enabled:
            return
        self._qk_targets = find_clip_targets(self.module)
        trained = {id(p) for group in self.fp16_groups for p in group}

        def locate(p):
            if id(p) not in trained:
                return None
            i, offset, chunk = self.grad_position[self.get_param_id(p)]
            return i, offset, int(p.ds_numel), chunk, self._get_sub_group_partition_rank(i)

        self._qk_ranges = partition_ranges(self._qk_targets, locate)

    def attach_monitor(self, monitor, step_fn: Callable[[], int]) -> None:
        """Report per-step Muon figures to DeepSpeed's monitor (tensorboard / csv_monitor / wandb / comet).

        Events, written by rank 0 (its own figures) after each step not skipped for overflow, at
        ``step_fn()`` (the engine's global sample count after this step, DeepSpeed's own x axis): ``Train/ds_muon/muon_seconds`` (wall time of this rank's Muon sub-group steps:
        momentum, exchange, Newton–Schulz; the accelerator is synchronized around them only while a
        monitor is attached; the first step includes torch.compile time), ``Train/ds_muon/exchange_bytes``
        (bytes this rank sends in the owner all_to_all, from the plan), ``Train/ds_muon/owner_imbalance`` (max/mean Newton–Schulz FLOPs over ranks),
        and ``Train/ds_muon/muon_lr`` / ``Train/ds_muon/adam_lr`` (the lr this step used in the first Muon /
        element-wise AdamW param group; DeepSpeed's own ``Train/Samples/lr`` shows only the first group's).
        With ``"optimizer": {"type": "AdamMini"}`` (no Muon: the three Muon events are not written):
        ``Train/ds_muon/adam_mini_seconds`` (wall time of this rank's Adam-mini sub-group steps: block sums,
        their all_reduce, the update; timed as Muon's), ``Train/ds_muon/adam_mini_lr`` (the first Adam-mini
        group's lr) and ``Train/ds_muon/adam_lr`` (the first element-wise AdamW group's: per-element blocks).
        With ``qk_clip`` enabled: ``Train/ds_muon/qk_clip/heads_clipped`` (query heads whose max logit of the
        step exceeded the threshold, a count over all layers), ``Train/ds_muon/qk_clip/max_logit`` (the largest
        pre-softmax logit of the step, all layers and ranks), ``Train/ds_muon/qk_clip/max_logit/<module>``
        per attention module (the global max over its heads) and, unless ``qk_clip.monitor_per_head`` is off,
        ``Train/ds_muon/qk_clip/max_logit/<module>/head_<h>`` per query head ``h`` (the head's max over the
        step's micro-batches and ranks, ``S_h``; ``-inf`` for a head that saw no allowed key).
        After each step skipped for a non-finite gradient norm: ``Train/ds_muon/skipped_steps`` (skipped steps
        so far in this process, a count).
        """
        self._monitor, self._monitor_step = monitor, step_fn

    def exchange_bytes(self) -> int:
        """Bytes this rank sends per optimizer step in the owner exchange (both directions)."""
        return sum(plan.sent_elements(self._get_sub_group_partition_rank(i))
                   * self._muon_exchanges[i].exchange_dtype.itemsize for i, plan in self.muon_plans.items())

    def _report(self) -> None:
        imbalance = max((p.imbalance() for p in self.muon_plans.values()), default=1.0)
        step = self._monitor_step()
        if step is None:  # the engine is gone
            return
        lrs: dict[str, float] = {}  # the first Muon, Adam-mini and element-wise AdamW group's lr this step used
        for group in self.optimizer.param_groups:
            kind = "muon" if group["use_muon"] else "adam_mini" if group.get("adam_mini") else "adam"
            lrs.setdefault(f"Train/ds_muon/{kind}_lr", group["lr"])
        if any(group.get("adam_mini") for group in self.optimizer.param_groups):  # AdamMini: no Muon sub-group
            events = [("Train/ds_muon/adam_mini_seconds", self._adam_mini_seconds, step)]
        else:
            events = [("Train/ds_muon/muon_seconds", self._muon_seconds, step),
                      ("Train/ds_muon/exchange_bytes", self.exchange_bytes(), step),
                      ("Train/ds_muon/owner_imbalance", imbalance, step)]
        self._monitor.write_events(events + [(name, float(lr), step) for name, lr in lrs.items()]
                                   + self._qk_clip_events(step))

    def _qk_clip_events(self, step: int) -> list[tuple]:
        stats = self.qk_clip_stats
        if not self._qk_targets or stats is None:
            return []
        return ([("Train/ds_muon/qk_clip/heads_clipped", stats["heads_clipped"], step),
                 ("Train/ds_muon/qk_clip/max_logit", stats["max_logit"], step)]
                + [(f"Train/ds_muon/qk_clip/max_logit/{name}", value, step)
                   for name, value in stats["max_logit_per_layer"].items()]
                + ([(f"Train/ds_muon/qk_clip/max_logit/{name}/head_{h}", value, step)
                    for name, values in stats["max_logit_per_head"].items() for h, value in enumerate(values)]
                   if self.optimizer.config.qk_clip.monitor_per_head else []))

    # ---- step ----------------------------------------------------------------------------
    def step(self, closure=None):
        """DeepSpeed's ZeRO-3 step; counts the steps that were not skipped for overflow.

        Afterwards the exchange's buffer pool is released to the caching allocator (see
        :class:`~ds_muon.exchange.BufferPool`) and the gradient partitions are zeroed. DeepSpeed copies a parameter's gradient
        into its partition on the window's first micro-step and adds on later ones, so a parameter
        that gets no gradient in a step (or in the first micro-step) would otherwise be stepped
        with last step's gradient again. Zeroed, such a parameter sees a zero gradient, the
        oracle's semantics.

        Raises:
            NvmeSwapError: on every rank, after a step in which some rank's NVMe swap write or read failed
                (and at every later step).
        """
        self._muon_seconds = self._adam_mini_seconds = 0.0
        self._refuse_after_swap_failure()
        self._check_trainable_set()
        self._step_flags = {}
        stats = self._qk_clip_prepare()
        self._stepping = True
        try:
            with _named_collective("a collective of DeepSpeed's ZeRO-3 optimizer step (overflow/gradient-norm "
                                   "all_reduce, parameter all_gather)"):
                super().step(closure)
        finally:
            self._stepping = False
            self._step_flags = {}
            self._qk_factors = None
            self._offloaded_grad_ids.clear()
            self._zero_grad_partitions()
            self._muon_pool.clear()
        self._agree_on_swap_errors("an optimizer step")
        if not self.overflow:
            self.qk_clip_stats = stats
            self.muon_step_count += 1
            self.consecutive_skipped_steps = 0
            if self._monitor is not None:
                self._report()
        else:
            self._count_skipped_step()

    def _qk_clip_prepare(self) -> Optional[dict]:
        """The step's QK-clip factors (``optimizer.params.qk_clip``), before DeepSpeed's step runs: the recorded
        per-head max logits of every attention module, reduced over the data-parallel group by one
        all_reduce(MAX) of all heads concatenated (whatever the step does after: an overflow-skipped step
        never reaches :meth:`_optimizer_step`, so it clips nothing). Returns the step's figures, or None."""
        if not self._qk_targets:
            return None
        s = take_max_logits(self._qk_targets, torch.device(get_accelerator().current_device_name()))
        with _named_collective("the QK-clip max-logit all_reduce"):
            dist.all_reduce(s, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        s = s.cpu()
        check_recorded(s)
        clip = self.optimizer.config.qk_clip
        factors, stats = factor_vector(self._qk_targets, s, clip.threshold, clip.alpha)
        self._qk_factors = factors.tolist()
        return stats

    def _qk_clip_sub_group(self, i: int) -> None:
        """Scale the query/key head rows of sub-group ``i``'s local fp32 partition by this step's factors,
        element-wise on the flat ranges of the plan (no gather); DeepSpeed then copies fp32 to bf16/fp16."""
        factors = self._qk_factors
        if factors is None:
            return
        fp32 = self.fp32_partitioned_groups_flat[i]
        for offset, n, k in self._qk_ranges.get(i, ()):
            if factors[k] != 1.0:
                fp32.data.narrow(0, offset, n).mul_(factors[k])

    def _check_trainable_set(self) -> None:
        """Raise if a parameter's ``requires_grad`` changed since the engine was built.

        ZeRO-3 fixes the trainable set at initialize: a weight frozen later keeps being stepped (Muon's
        momentum keeps it moving at full step size), and one unfrozen later is never stepped. The
        check is local (no collective); switch ``requires_grad`` on every rank alike.

        Raises:
            RuntimeError: naming each parameter whose ``requires_grad`` changed, and the fix.
        """
        if not hasattr(self, "_trainable_at_init"):
            self._trainable_at_init = {p: p.requires_grad for p in self.module.parameters()}
            return
        changed = [(self.param_names.get(p, f"ds_id={getattr(p, 'ds_id', '?')}"), was)
                   for p, was in self._trainable_at_init.items() if p.requires_grad != was]
        if changed:
            lines = [f"'{name}' was {'trainable' if was else 'frozen'} at initialize and is now "
                     f"{'frozen' if was else 'trainable'}" for name, was in changed]
            raise RuntimeError(
                "ds_muon: requires_grad changed after the engine was built, which ZeRO-3 does not follow (a frozen "
                "weight would keep moving, an unfrozen one would never train):\n  " + "\n  ".join(lines)
                + "\nSet requires_grad before ds_muon.initialize (save a checkpoint and build a new engine to "
                "change it mid-run), or keep the parameter trainable with lr 0 in its own param group")

    # ---- skipped steps (non-finite gradients) ----------------------------------------------
    def _loss_scale_update_and_overflow_cleanup(self):
        """DeepSpeed's; on a skipped step first finds the parameter to name (the gradients are
        still there: DeepSpeed's clean-up drops them)."""
        if self.overflow and self._stepping:
            self.last_non_finite_param = self._first_non_finite_grad()
        return super()._loss_scale_update_and_overflow_cleanup()

    def _local_grad_partitions(self):
        """Yield ``(param, local fp32/bf16/fp16 gradient partition or None)`` in sub-group order, wherever
        DeepSpeed keeps it at the overflow check: ``averaged_gradients`` without offload, the fp32
        partition's ``grad`` with CPU offload, swapped in (and released) under NVMe."""
        for i, params in enumerate(self.fp16_groups):
            swapped = self.offload_optimizer and self._swappable_optimizer_subgroup(i)
            if swapped:
                self._optimizer_states_and_gradient_swap_in(i)
            try:
                flat = self.fp32_partitioned_groups_flat[i].grad if self.offload_optimizer else None
                grads = None if self.offload_optimizer else (self.averaged_gradients or {}).get(i)
                for j, param in enumerate(params):
                    if grads is not None:
                        yield param, grads[j]
                    elif flat is not None and (not swapped or param.ds_id in self._offloaded_grad_ids):
                        _, offset, numel = self.grad_position[self.get_param_id(param)]
                        yield param, flat.narrow(0, offset, numel)
                    else:
                        yield param, None
            finally:
                if swapped:
                    self._release_swap_buffers(i)

    def _first_non_finite_grad(self) -> Optional[str]:
        """Name of the first parameter (sub-group order, over all ranks of the data-parallel group) whose
        gradient holds a NaN or Inf, or None if none does (e.g. only the norm overflowed). Collective: one
        all_reduce(MIN) of one int64."""
        import torch.distributed as dist
        params = [p for group in self.fp16_groups for p in group]
        first = len(params)
        for k, (param, grad) in enumerate(self._local_grad_partitions()):
            if first == len(params) and grad is not None and grad.numel() and not torch.isfinite(grad).all():
                first = k
        found = torch.tensor([first], dtype=torch.int64, device=get_accelerator().current_device_name())
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=self.dp_process_group)
        k = int(found.item())
        if k == len(params):
            return None
        return self.param_names.get(params[k], f"ds_id={params[k].ds_id}")

    def _count_skipped_step(self) -> None:
        """Count, log and report a step skipped for a non-finite gradient norm; stop the run after
        ``max_consecutive_skipped_steps`` in a row (design.md §3: the step leaves state untouched).

        Raises:
            RuntimeError: on every rank (the overflow flag is global), naming the first parameter with a
                non-finite gradient and the config key.
        """
        self.skipped_step_count += 1
        self.consecutive_skipped_steps += 1
        limit = self.optimizer.config.max_consecutive_skipped_steps
        where = (f"first parameter with a non-finite gradient: {self.last_non_finite_param}"
                 if self.last_non_finite_param else "no gradient element is non-finite; the norm overflowed")
        if self.dp_process_group is None or torch.distributed.get_rank(group=self.dp_process_group) == 0:
            logger.warning("ds_muon: optimizer step skipped, the global gradient norm is not finite (%s); "
                           "%d consecutive, %d skipped in all, loss scale %s", where, self.consecutive_skipped_steps,
                           self.skipped_step_count, self.loss_scale)
        if self._monitor is not None:
            step = self._monitor_step()
            if step is not None:
                self._monitor.write_events([("Train/ds_muon/skipped_steps", self.skipped_step_count, step)])
        if limit and self.consecutive_skipped_steps >= limit:
            raise RuntimeError(
                f"ds_muon: {self.consecutive_skipped_steps} consecutive optimizer steps skipped because the gradient "
                f"norm was NaN or Inf ({where}); stopping. Check the data and the loss for NaN/Inf, lower the "
                "learning rate or enable gradient_clipping, or raise optimizer.params.max_consecutive_skipped_steps "
                "(0 never stops)")

    def _zero_grad_partitions(self) -> None:
        if getattr(self, "grad_partitions_flat_buffer", None) is not None:
            self.grad_partitions_flat_buffer.zero_()
        if self.offload_optimizer:
            for i, fp32 in enumerate(self.fp32_partitioned_groups_flat):
                if fp32.grad is not None and not self._swappable_optimizer_subgroup(i):
                    fp32.grad.zero_()

    def reduce_ready_partitions_and_remove_grads(self, param):
        """DeepSpeed's (the gradient hook); a failed gradient reduce-scatter names itself."""
        with _named_collective("DeepSpeed's gradient reduce-scatter (ZeRO-3, in backward)"):
            return super().reduce_ready_partitions_and_remove_grads(param)

    def independent_gradient_partition_epilogue(self):
        """DeepSpeed's (reduces the last gradient bucket after backward); a failure names the collective."""
        with _named_collective("DeepSpeed's gradient reduce-scatter (ZeRO-3, end of backward)"):
            return super().independent_gradient_partition_epilogue()

    def _offload_grad_partition_at_boundary(self, param, *args, **kwargs):
        """DeepSpeed's; also records that ``param``'s gradient was offloaded in this window."""
        self._offloaded_grad_ids.add(param.ds_id)
        return super()._offload_grad_partition_at_boundary(param, *args, **kwargs)

    def _prepare_sub_group(self, sub_group_id: int, timer_names) -> None:
        """DeepSpeed's (swap-in under NVMe), then, inside a step, :meth:`_fix_swapped_grad`: before
        DeepSpeed unscales and clips the gradient, which needs it to exist."""
        super()._prepare_sub_group(sub_group_id, timer_names)
        if getattr(self, "_stepping", False) and self._swappable_optimizer_subgroup(sub_group_id):
            self._fix_swapped_grad(sub_group_id)

    def _fix_swapped_grad(self, i: int) -> None:
        """Make a swapped (NVMe) sub-group's gradient this step's, with zeros where there was none.

        The swapper swaps in the gradient fragments DeepSpeed offloaded at the end of this
        accumulation window into a pinned buffer that still holds older data elsewhere, and leaves
        ``grad`` None when no fragment of the sub-group was ever swapped out. A parameter whose
        gradient was not offloaded in this window would therefore read stale values; the oracle
        reads zeros. No extra I/O: the fix is in memory, on the swapped-in buffer.
        """
        fp32 = self.fp32_partitioned_groups_flat[i]
        if fp32.grad is None:
            fp32.grad = torch.zeros_like(fp32)
            return
        offloaded = self._offloaded_grad_ids
        for param in self.fp16_groups[i]:
            if param.ds_id not in offloaded:
                _, offset, numel = self.grad_position[self.get_param_id(param)]
                fp32.grad.narrow(0, offset, numel).zero_()

    def _optimizer_step(self, sub_group_id: int) -> None:
        """The sub-group's update (Muon, or DeepSpeed's AdamW), then QK-clip on it (fp32 resident, also under
        NVMe; DeepSpeed copies fp32 to the bf16/fp16 partition right after)."""
        plan = self.muon_plans.get(sub_group_id)
        if plan is None and sub_group_id not in self.adam_mini_maps:
            super()._optimizer_step(sub_group_id)
        else:
            timed = self._monitor is not None
            if timed:
                get_accelerator().synchronize()
                start = time.perf_counter()
            if plan is None:
                self._adam_mini_sub_group_step(sub_group_id)
            else:
                self._muon_sub_group_step(sub_group_id, plan)
            if timed:
                get_accelerator().synchronize()
                if plan is None:
                    self._adam_mini_seconds += time.perf_counter() - start
                else:
                    self._muon_seconds += time.perf_counter() - start
        self._qk_clip_sub_group(sub_group_id)

    @torch.no_grad()
    def _muon_sub_group_step(self, i: int, plan: BucketedPlan) -> None:
        group = self._muon_group(i)
        fp32 = self.fp32_partitioned_groups_flat[i]
        grad = fp32.grad
        state = self.optimizer.state[fp32]
        momentum = state.get(MOMENTUM_KEY)
        if momentum is None:
            # Created in the first step with the fp32 shard's length and dtype: the NVMe swapper
            # latches a sub-group's state keys on its first swap-out.
            momentum = state[MOMENTUM_KEY] = torch.zeros_like(fp32, dtype=getattr(torch, group["momentum_dtype"]))
            if self._momentum_in_memory:
                momentum.swappable = False  # the swapper leaves tensors marked so in memory
        with record_function("ds_muon/blocks_with_gradient"):
            had = self._blocks_with_gradient(i, grad)
        kept = None
        if not bool(had.all()):  # every rank holds the same flags, so all take the same branch
            if not bool(had.any()):
                return  # no gradient anywhere in the sub-group: no exchange, nothing changes
            ranges = self._muon_block_maps[i].local_ranges(torch.nonzero(~had).flatten().tolist())
            kept = [(o, n, momentum.narrow(0, o, n).clone(), fp32.narrow(0, o, n).clone()) for o, n in ranges]
        exchange = self._muon_exchanges[i]
        # one compiled pass each for the momentum step and the apply, where Newton-Schulz is compiled too
        fused = self.optimizer.config.ns_compile and grad.device.type == "cuda"
        with record_function("ds_muon/momentum"):
            update = (fused_momentum_update_ if fused else momentum_update_)(momentum, grad, group["momentum"],
                                                                             group["nesterov"])
        method, steps, mode = group["ns_method"], group["ns_steps"], group["update_scale"]
        if self.optimizer.config.ns_compile and exchange.device.type == "cuda":
            ns = compiled_orthogonalize(method, steps, exchange.compute_dtype,
                                        **(AUTOTUNE_COMPILE if self.optimizer.config.ns_autotune else {}))
        else:
            ns = functools.partial(orthogonalize, method=method, steps=steps, dtype=exchange.compute_dtype)

        def owner_update(mats: torch.Tensor) -> torch.Tensor:
            rows, cols = mats.shape[-2:]
            return ns(mats).mul_(update_scale(rows, cols, mode))

        with record_function("ds_muon/exchange_and_newton_schulz"), \
                _named_collective(f"the Muon owner exchange (all_to_all) of ZeRO sub-group {i}"):
            exchange.run(plan, update, grad, owner_update)
        with record_function("ds_muon/apply_update"):
            (fused_apply_update_ if fused else apply_update_)(fp32, grad, group["lr"], group["weight_decay"])
            for offset, n, m_old, w_old in kept or ():  # blocks with no gradient: as they were
                momentum.narrow(0, offset, n).copy_(m_old)
                fp32.narrow(0, offset, n).copy_(w_old)

    @torch.no_grad()
    def _adam_mini_sub_group_step(self, i: int) -> None:
        """Adam-mini on Adam-mini sub-group ``i`` (:mod:`ds_muon.adam_mini`), on the local fp32 shard ``(n,)``:

        1. per-block partial sums of ``g**2`` over this rank's elements (a ``segment_reduce`` over the
           :class:`~ds_muon.blocks.BlockMap`'s segments, one window of at most
           :data:`ds_muon.adam_mini.CHUNK_ELEMENTS` at a time; a block may start on one rank and end on
           another, and padding belongs to no block);
        2. one all_reduce(SUM) of ``n_blocks`` fp32 over the sub-group's partition group;
        3. ``v_B <- beta2*v_B + (1-beta2) * sum_B / |B|`` with ``|B|`` the block's global numel, then the
           element-wise first moment and update on the shard, window by window
           (:func:`ds_muon.adam_mini.adam_mini_shard_update_`): no temporary of the shard's size.

        State of the fp32 partition: ``step`` (int), ``exp_avg`` (the shard's length) and
        ``block_exp_avg_sq`` (``(n_blocks,)``, the same on every rank).
        """
        group = self._muon_group(i)
        fp32 = self.fp32_partitioned_groups_flat[i]
        grad = fp32.grad
        bm = self.adam_mini_maps[i]
        index = self._adam_mini_index.get(i)
        if index is None or index[1].device != grad.device:
            dev = grad.device
            index = self._adam_mini_index[i] = (
                shard_chunks(bm.lengths, bm.block_of_segment, bm.n_blocks, dev),
                torch.tensor(self._adam_mini_block_numel[i], dtype=torch.float32, device=dev))
        chunks, block_numel = index
        state = self.optimizer.state[fp32]
        if "exp_avg" not in state:
            # Created in the first step: under NVMe the swapper latches exp_avg (the shard's length) on the
            # first swap-out; the per-block second moments (4 bytes per block) always stay in memory.
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(fp32)
            state[BLOCK_STATE_KEY] = torch.zeros(bm.n_blocks, dtype=torch.float32, device=fp32.device)
            state[BLOCK_STATE_KEY].swappable = False
        with record_function("ds_muon/adam_mini_block_sums"):
            sums = block_square_sums(grad, chunks, bm.n_blocks)
            device = torch.device(get_accelerator().current_device_name())
            wire = sums.to(device)
            with _named_collective(f"the Adam-mini block all_reduce of ZeRO sub-group {i}"):
                dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self._get_sub_group_process_group(i))
            sums = wire.to(grad.device)
        state["step"] += 1
        with record_function("ds_muon/adam_mini_update"):
            adam_mini_shard_update_(fp32, grad, state["exp_avg"], state[BLOCK_STATE_KEY], sums, block_numel, chunks,
                                    state["step"], group["lr"], tuple(group["betas"]), group["eps"],
                                    group["weight_decay"])

    def _blocks_with_gradient(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Which Newton–Schulz blocks of Muon sub-group ``i`` had a gradient this step, on any rank.

        A block (one matrix of a parameter's view, e.g. one expert) has none when its gradient is
        exactly zero in every element on every rank; DeepSpeed leaves zeros where no gradient
        arrived. Per sub-group, one ``segment_reduce`` over its local gradient shard and one byte per
        block. At sub-group ``i`` (``grad``: its ``(shard numel,)`` gradient) the flags of every later
        Muon sub-group whose gradient is already in memory (:meth:`_resident_grad`: not NVMe-swapped)
        and that shares ``i``'s process group are computed too, and all of them go through one
        all_reduce(MAX) and one copy to the host; the later sub-groups then take theirs from
        ``_step_flags``. The set is the same on every rank (it depends on the layout only), so every
        rank calls the same collectives. Unscaling and clipping, which DeepSpeed applies to a
        sub-group's gradient after this point for later sub-groups, multiply by a positive factor
        and keep zeros zero.

        Returns:
            ``(n_blocks,)`` bool on the CPU, the same on every rank of the group.
        """
        if i in self._step_flags:
            return self._step_flags.pop(i)
        group = self._get_sub_group_process_group(i)
        grads = {i: grad}
        for j in self.muon_plans:
            if j > i and j not in self._step_flags and self._get_sub_group_process_group(j) is group \
                    and self._grad_resident(j):
                grads[j] = self._resident_grad(j)
        local = [self._local_block_flags(j, g) for j, g in grads.items()]
        flags = torch.cat(local).to(self._muon_exchanges[i].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        flags = flags.bool().cpu()
        split = dict(zip(grads, flags.split([t.numel() for t in local])))
        self._step_flags.update((j, f) for j, f in split.items() if j != i)
        return split[i]

    def _grad_resident(self, j: int) -> bool:
        """Whether Muon sub-group ``j``'s gradient is in memory before its turn in the step: not
        NVMe-swapped, and (without offload) its parameters' gradient partitions tile its shard in
        DeepSpeed's ``grad_partitions_flat_buffer``. Depends on the layout only: the same on every rank."""
        if self._swappable_optimizer_subgroup(j):
            return False
        if self.offload_optimizer:
            return True
        return (getattr(self, "grad_partitions_flat_buffer", None) is not None
                and sum(p.partition_numel() for p in self.fp16_groups[j]) == self.muon_plans[j].shard_numel)

    def _resident_grad(self, j: int) -> Optional[torch.Tensor]:
        """Muon sub-group ``j``'s local gradient shard ``(shard numel,)`` as it is before its own turn in
        the step (any float dtype; zeros where no gradient arrived; None: no gradient at all on this
        rank), for a sub-group where :meth:`_grad_resident` holds. Without optimizer offload it is
        sub-group ``j``'s slice of DeepSpeed's ``grad_partitions_flat_buffer`` (every parameter's
        gradient partition, in sub-group order: what DeepSpeed flattens into the fp32 gradient at
        ``j``'s turn); with CPU offload, the fp32 partition's ``grad``."""
        if self.offload_optimizer:
            return self.fp32_partitioned_groups_flat[j].grad
        offset = sum(p.partition_numel() for k in range(j) for p in self.fp16_groups[k])
        return self.grad_partitions_flat_buffer.narrow(0, offset, self.muon_plans[j].shard_numel)

    def _local_block_flags(self, i: int, grad: Optional[torch.Tensor]) -> torch.Tensor:
        """``(n_blocks,)`` uint8 on ``grad``'s device: 1 where this rank's shard of the block holds a
        non-zero gradient element (one ``segment_reduce`` over ``grad``, ``(shard numel,)``); all 0
        for ``grad=None``."""
        bm = self._muon_block_maps[i]
        if grad is None:
            return torch.zeros(bm.n_blocks, dtype=torch.uint8, device=self._muon_exchanges[i].device)
        index = self._block_index.get(i)
        if index is None or index[0].device != grad.device:
            real = [k for k, b in enumerate(bm.block_of_segment) if b != PADDING]
            index = self._block_index[i] = (
                torch.tensor(bm.lengths, dtype=torch.int64, device=grad.device),
                torch.tensor(real, dtype=torch.int64, device=grad.device),
                torch.tensor([bm.block_of_segment[k] for k in real], dtype=torch.int64, device=grad.device))
        lengths, real, ids = index
        largest = torch.segment_reduce(grad.abs(), "max", lengths=lengths, unsafe=True, initial=0)
        flags = torch.zeros(bm.n_blocks, dtype=torch.uint8, device=grad.device)
        return flags.scatter_reduce_(0, ids, largest[real].ne(0).to(torch.uint8), "amax")

    # ---- checkpoints of NVMe-swapped sub-groups ---------------------------------------------
    # DeepSpeed 0.19.8 saves a swapped sub-group's fp32 partition and optimizer state as the empty
    # placeholders they are between steps (so zero_to_fp32 fails on them), copies its raw swap files
    # next to the checkpoint instead, and on load skips the optimizer state entirely (the state keys
    # the swapper latched in the saving process are unknown to a fresh one, so momentum and Adam
    # moments are lost, and so is the Adam step). ds_muon puts the real tensors into the ZeRO
    # checkpoint and loads them through the swapper; integration.py turns the raw-file copy off.

    def _state_index(self) -> dict[int, int]:
        """``{sub_group: index}`` of each fp32 partition in the inner optimizer's ``state_dict()``:
        torch numbers state entries param group by param group, and DeepSpeed appends each sub-group's
        fp32 partition to its param group in sub-group order (``_set_fp32_optimizer_param_groups``)."""
        order = sorted(range(len(self.fp16_groups)), key=lambda i: (self.sub_group_to_group_id[i], i))
        return {i: k for k, i in enumerate(order)}

    def _rigid_state_dict(self) -> dict:
        """DeepSpeed's ZeRO-3 state dict, with the real fp32 partition and state tensors of swapped
        sub-groups (swapped in one at a time and copied to CPU memory, without writing back)."""
        self._refuse_after_swap_failure()
        sd = super()._rigid_state_dict()
        if not self.swap_optimizer:
            return sd
        index = self._state_index()
        fp32_groups = list(sd[FP32_FLAT_GROUPS])
        opt_state = sd[OPTIMIZER_STATE_DICT]["state"]
        for i in range(len(self.fp16_groups)):
            if not self._swappable_optimizer_subgroup(i):
                continue
            self._optimizer_states_and_gradient_swap_in(i)
            fp32 = self.fp32_partitioned_groups_flat[i]
            fp32_groups[i] = fp32.detach().to("cpu", copy=True)
            saved = dict(opt_state.get(index[i], {}))  # a new dict: the old one is the live state's
            for key, value in self.optimizer.state.get(fp32, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    saved[key] = value.detach().to("cpu", copy=True)
            opt_state[index[i]] = saved
            self._release_swap_buffers(i)
        self._agree_on_swap_errors("reading the optimizer state for a checkpoint")
        sd[FP32_FLAT_GROUPS] = fp32_groups
        return sd

    def _install_partitions(self, load: Callable[[int], tuple], replace_state: bool, refresh_lp: bool = True) -> None:
        """Write every sub-group's fp32 partition (and, with ``replace_state``, its optimizer state)
        from ``load``; swapped (NVMe) sub-groups go through one swap-in and one swap-out each.

        With ``replace_state`` the live state is dropped and the swapper's swapped state purged
        first: the swapper latches a sub-group's state keys whenever it looks the sub-group up and
        finds state (and would then read state files this process never wrote), so the new state is
        installed only once the sub-group's fp32 partition is resident, and the swap-out latches and
        writes it. A Muon momentum stays out of the swap with ``save_muon_momentum_buffer_in_memory``.

        Args:
            load: ``i -> (fp32, state)``, called once per sub-group in order, after its swap-in:
                ``fp32`` of shape ``(partition numel,)``; ``state`` the sub-group's new optimizer state
                dict (ignored unless ``replace_state``; empty or None installs none).
            replace_state: install the loaded state instead of keeping the live one.
            refresh_lp: also refresh the bf16/fp16 partitions (and the model's partitioned
                parameters) from fp32, as DeepSpeed's loads do.
        """
        n = len(self.fp16_groups)
        swapped = [bool(self._swappable_optimizer_subgroup(i)) for i in range(n)]
        if replace_state:
            for i in range(n):
                self.optimizer.state.pop(self.fp32_partitioned_groups_flat[i], None)
            if self.swap_optimizer:
                self.optimizer_swapper.purge_state()
        refresh_swapper = self.swap_optimizer and refresh_lp
        timer_names: set = set()
        if refresh_swapper:
            self._partition_all_parameters()
        for i in range(n):
            fp32 = self.fp32_partitioned_groups_flat[i]
            if swapped[i]:
                self._prepare_sub_group(i, timer_names)  # with replace_state: only the fp32 partition
            flat, state = load(i)
            if replace_state and state:
                if i in self.muon_plans:
                    cast_momentum_(state, self._muon_group(i))
                if self._momentum_in_memory and MOMENTUM_KEY in state:
                    state[MOMENTUM_KEY].swappable = False
                if BLOCK_STATE_KEY in state:  # Adam-mini's per-block second moments: never swapped
                    state[BLOCK_STATE_KEY].swappable = False
                self.optimizer.state[fp32] = state
            fp32.data.copy_(flat)
            if refresh_lp:
                self._reassign_or_swap_out_partitioned_parameters(i)  # bf16/fp16 partition <- fp32
            if swapped[i]:
                self._release_sub_group(i, timer_names)  # writes fp32 (+ state) to NVMe
        if refresh_swapper:
            self._post_step(timer_names)
        self._agree_on_swap_errors("installing loaded optimizer partitions")

    def _rigid_load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """DeepSpeed's load without NVMe; with it, the checkpoint's fp32 partitions and state go
        through the swapper (:meth:`_install_partitions`). The fp32 partition sizes were checked by
        :func:`ds_muon.checkpoint.check_zero_state_dict` before (an NVMe checkpoint written by
        DeepSpeed alone holds empty ones)."""
        if not self.swap_optimizer:
            return super()._rigid_load_state_dict(state_dict, load_optimizer_states)
        self.loss_scaler = state_dict[LOSS_SCALER]
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        states = None
        if load_optimizer_states:
            self._set_fp32_optimizer_param_groups()
            self.optimizer.load_state_dict(state_dict[OPTIMIZER_STATE_DICT])
            self._clear_fp32_optimizer_param_groups()
            states = [self.optimizer.state.get(fp32, {}) for fp32 in self.fp32_partitioned_groups_flat]
        saved_fp32 = state_dict[FP32_FLAT_GROUPS]
        self._install_partitions(lambda i: (saved_fp32[i], states[i] if states else None),
                                 replace_state=load_optimizer_states)

    def _restore_from_bit16_weights(self) -> None:
        """fp32 partitions <- bf16/fp16 ones (DeepSpeed's), through the swapper for swapped sub-groups."""
        if not self.swap_optimizer:
            return super()._restore_from_bit16_weights()
        self._install_partitions(lambda i: (self.fp16_partitioned_groups_flat[i], None), replace_state=False,
                                 refresh_lp=False)

    # ---- checkpoints (the logic lives in ds_muon.checkpoint) ------------------------------
    def state_dict(self):
        """DeepSpeed's ZeRO-3 optimizer state dict plus ds_muon's metadata under ``"ds_muon"``
        (:func:`ds_muon.checkpoint.zero_metadata`: parameter names, shapes, Muon/AdamW flags, sub-group
        layout, world size, ``muon_step_count``)."""
        return add_metadata(self, super().state_dict())

    def load_state_dict(self, *args, **kwargs):
        """DeepSpeed's ZeRO-3 load (arguments passed through unchanged). At the same world size,
        ds_muon's fit checks run first (``CheckpointError`` on every rank before anything is
        restored) and ``muon_step_count`` is restored after; universal checkpoints go to
        :meth:`_load_universal_checkpoint`."""
        state_dict, load_optimizer_states = rigid_load_arguments(self, super().load_state_dict, args, kwargs)
        if state_dict is not None:
            check_zero_state_dict(self, state_dict, load_optimizer_states)
        super().load_state_dict(*args, **kwargs)
        if state_dict is not None and load_optimizer_states:
            restore_step_count(self, state_dict)

    def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
        """Universal checkpoint (``"checkpoint": {"load_universal": true}``): ds_muon's loader, which
        knows Muon's ``momentum_buffer`` and Adam-mini's ``block_exp_avg_sq``
        (:func:`ds_muon.checkpoint.load_universal_state`); weights
        only (``load_optimizer_states=False``): DeepSpeed's, after ds_muon's checks."""
        if self.swap_optimizer and not load_optimizer_states:
            raise CheckpointError("loading only the weights of a universal checkpoint (load_module_only / "
                                  "load_optimizer_states=False) is not supported with NVMe optimizer offload: "
                                  "DeepSpeed's weights-only loader writes into swapped-out partitions; load the "
                                  "optimizer states too, or load without NVMe offload")
        load_universal_state(self, checkpoint_folder, load_optimizer_states)
        if not load_optimizer_states:
            super()._load_universal_checkpoint(checkpoint_folder, load_optimizer_states, load_from_fp32_weights)
