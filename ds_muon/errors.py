"""The errors ds_muon raises on purpose, one module for all layers (standard library only).

Each message names what is wrong and the fix; the multi-problem ones keep their lines in
``err.problems``. Raised where the problem is found: configuration (:class:`ConfigError`) before
anything is allocated, checkpoints (:class:`CheckpointError`) on every rank together, collectives
(:class:`CollectiveError`) naming the collective, NVMe swap I/O (:class:`NvmeSwapError`) on every
rank after the step, and an unsupported DeepSpeed (:class:`DeepSpeedVersionError`).
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

#: ds_muon's supported DeepSpeed releases: pyproject.toml's pin (a test checks they agree); outside it the
#: integration layer raises DeepSpeedVersionError (ds_muon.integration.deepspeed_version says what was measured).
SUPPORTED_DEEPSPEED = ">=0.19.8,<0.20"
_MAX_CHECKPOINT_LINES = 25


class ConfigError(ValueError):
    """A ds_muon configuration problem.

    ``str(err)`` names each offending key path, its value, and what is allowed / the fix, one line
    per problem. ``err.problems`` holds those lines as a list.
    """

    def __init__(self, problems: Union[str, list[str]], header: Optional[str] = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if header is None and len(self.problems) > 1:
            header = f"invalid ds_muon configuration ({len(self.problems)} problems):"
        lines = ([header] if header else []) + [("  " if header else "") + p for p in self.problems]
        super().__init__("\n".join(lines))


class CheckpointError(RuntimeError):
    """A checkpoint that ds_muon cannot load into this engine, or cannot convert.

    ``str(err)`` is a header and one line per problem (each naming the parameter, the file or the
    fix), at most 25 of them; ``err.problems`` holds all the lines.
    """

    def __init__(self, problems: Union[Iterable[str], str], header: Optional[str] = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        shown = self.problems[:_MAX_CHECKPOINT_LINES]
        if len(self.problems) > _MAX_CHECKPOINT_LINES:
            shown.append(f"... and {len(self.problems) - _MAX_CHECKPOINT_LINES} more")
        lines = ([header] if header else []) + [("  " if header else "") + p for p in shown]
        super().__init__("\n".join(lines))


class CollectiveError(RuntimeError):
    """A collective failed, most likely because a peer rank died; the message names the collective.

    Raised from the backend's own error (chained as ``__cause__``): gloo reports a dead peer at once
    ("Connection closed by peer"); NCCL reports it when its watchdog times out. A peer that hangs
    instead of dying is bounded by the process-group timeout: ``deepspeed.init_distributed(timeout=
    datetime.timedelta(minutes=N))`` (DeepSpeed's default: 30 minutes). See docs/troubleshooting.md.
    Only errors that come from a collective become this (:func:`ds_muon.sharded.collectives.named_collective`);
    any other error raised inside a named block (a bug in an element-wise function, a shape error)
    propagates unchanged.
    """


class NvmeSwapError(RuntimeError):
    """An NVMe optimizer swap file could not be written (or read back) during the run.

    DeepSpeed 0.19.8's async I/O does not look at the result of a completed write: a write cut short
    by a full filesystem (or a file size limit) completes silently, and the next swap-in reads a short
    file. ds_muon checks every swap write and every submission (:mod:`ds_muon.integration.nvme`), and all
    ranks agree on the outcome after each optimizer step (one all_reduce), so every rank raises this
    error together instead of one rank failing mid-step while the others wait in the next collective.
    The message names ``zero_optimization.offload_optimizer.nvme_path``, the failing rank, sub-group and
    file, the bytes written and needed, the OS error where known, and the fix. Afterwards the optimizer
    refuses to step or save (its state is no longer trustworthy); checkpoints saved before are untouched.
    """


class DeepSpeedVersionError(RuntimeError):
    """The installed DeepSpeed is outside :data:`SUPPORTED_DEEPSPEED` (raised when the integration layer is
    imported, and by ``ds_muon.enable``/``ds_muon.initialize``), or lacks an attribute ds_muon relies on (a
    release that renamed or removed it); the message names the installed version, the supported range and the
    fix (and the attribute and its owner where one is missing)."""
