"""DeepSpeed's JIT-built ops: build them once, up front, and clear build locks that a killed build left.

Layer ``integration``. DeepSpeed builds its C++ ops (CPU Adam, FusedAdam, async_io for NVMe, pinned memory, the
CPU accelerator's shared-memory all-reduce) on first use through ``torch.utils.cpp_extension.load``, which
takes a ``FileBaton``: the file ``<TORCH_EXTENSIONS_DIR>/<op>/lock``, created at the start of a build and
removed at its end. Every other process that needs the op waits, without a deadline, while the file exists. A
build killed halfway (a test's time-out, Ctrl-C, OOM) leaves the file, and from then on every run that needs
the op hangs. Two remedies here:

* :func:`stale_lock`: a lock is stale when no process holds it or builds in that directory any more (no process
  has the lock file open, as ``FileBaton`` keeps it from taking it to releasing it, nor the directory as its
  working directory, as ninja and the compilers it runs do) and the lock is older than :data:`LOCK_GRACE_S`;
* :func:`build_ops` (``python -m ds_muon.integration.jit_ops``, run by ``scripts/test.sh`` and
  ``scripts/train.sh``): removes stale locks with a log line, then builds or loads each op with a progress
  line, outside any test's time-out.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

__all__ = ["OPS", "LOCK_GRACE_S", "HEARTBEAT_S", "builder_alive", "stale_lock", "clear_stale_lock",
           "clear_stale_locks", "heartbeat", "build_ops", "main"]

#: DeepSpeed op builders ds_muon's runs use, by accelerator name ("cpu" adds the shared-memory all-reduce).
OPS: dict[str, tuple[str, ...]] = {
    "cpu": ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder"),
    "cuda": ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder"),
}
#: How long one op's build takes, as measured (said in the progress line): 2 CPU cores (AMD EPYC), deepspeed 0.19.8,
#: torch 2.13: deepspeed_shm_comm 48 s idle and 284 s with the cores shared with a test run (load average 8-14);
#: async_io 165 s loaded; in another run, with the cores shared by three other jobs (load average 6-13), fused_adam
#: 363 s and async_io 1099 s (a fresh clone's scripts/train.sh and scripts/test.sh).
BUILD_TIME = ("measured on 2 CPU cores: about 50 s per op on an idle machine; on a loaded one up to 6 min, and up to "
              "18 min for async_io")
#: Seconds between the "still building" lines while one op compiles (a long silent build looks like a hang).
HEARTBEAT_S = 60.0
#: A lock younger than this (s) is left alone even with no builder in sight.
LOCK_GRACE_S = 60.0


def builder_alive(build_dir: str) -> Optional[bool]:
    """Whether some process holds ``build_dir``'s lock or builds there, read from ``/proc``: it has the ``lock``
    file open (torch's ``FileBaton`` keeps the descriptor it created the file with open until it removes the file,
    also in the milliseconds before ninja starts) or ``build_dir`` as its working directory (ninja and the
    compilers it starts do); None where ``/proc`` cannot tell (not Linux)."""
    if not os.path.isdir("/proc/self"):
        return None
    target = os.path.realpath(build_dir)
    lock = os.path.join(target, "lock")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == target:
                return True
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed meanwhile
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == lock:
                        return True
        except OSError:  # gone, or another user's process
            continue
    return False


def stale_lock(build_dir: str, now: Optional[float] = None, grace_s: float = LOCK_GRACE_S) -> Optional[str]:
    """The path of ``build_dir``'s ``lock`` if it is stale (no process holds it or builds there,
    :func:`builder_alive`; older than ``grace_s`` seconds), else None (no lock, a build in progress, or no way to
    tell). The grace is a margin for systems where ``/proc`` shows another user's descriptors only partly."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = (time.time() if now is None else now) - os.stat(lock).st_mtime
    except OSError:
        return None
    if age < grace_s or builder_alive(build_dir) is not False:
        return None
    return lock


def clear_stale_lock(build_dir: str, log: Callable[[str], None] = print, grace_s: float = LOCK_GRACE_S) -> bool:
    """Remove ``build_dir``'s stale lock (:func:`stale_lock` with ``grace_s``), saying so through ``log``; whether
    it did."""
    try:
        seen = os.stat(os.path.join(build_dir, "lock"))
    except OSError:
        return False
    lock = stale_lock(build_dir, grace_s=grace_s)
    if lock is None:
        return False
    try:
        now = os.stat(lock)
        if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
            return False  # removed and taken anew while /proc was read (another cleaner, then a loader)
        age = time.time() - now.st_mtime
        os.remove(lock)
    except FileNotFoundError:
        return False
    log(f">> removed {lock}, taken {age:.0f} s ago: a build or load of this op was killed before it finished (no "
        f"process holds the lock or builds in {build_dir}); the next load builds or loads it again")
    return True


def clear_stale_locks(root: Optional[str] = None, log: Callable[[str], None] = print,
                      grace_s: float = LOCK_GRACE_S) -> list[str]:
    """Remove the stale lock (:func:`clear_stale_lock`) of every op's build directory under ``root`` (default: the
    extension cache torch uses now: ``TORCH_EXTENSIONS_DIR``, or torch's default with its per-Python, per-device
    folder); the directories cleared. Whatever killed a build (a test's time-out, Ctrl-C) leaves the lock, and every
    later load of that op waits on it."""
    root = os.path.dirname(_build_dir("async_io")) if root is None else os.path.abspath(root)  # torch's rule
    try:
        names = sorted(os.listdir(root))
    except OSError:  # no cache yet
        return []
    return [os.path.join(root, name) for name in names
            if os.path.isdir(os.path.join(root, name)) and clear_stale_lock(os.path.join(root, name), log, grace_s)]


@contextlib.contextmanager
def heartbeat(label: str, log: Callable[[str], None] = print, every: float = HEARTBEAT_S) -> Iterator[None]:
    """While the body runs, log ``>> still building <label>: <s> s so far`` every ``every`` seconds (from a daemon
    thread), so a build of many minutes on a loaded machine prints progress instead of looking hung."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            log(f">> still building {label}: {time.monotonic() - start:.0f} s so far (compiling C++ on the CPU)")

    thread = threading.Thread(target=beat, name=f"ds_muon-heartbeat-{label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _build_dir(name: str) -> str:
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(name, verbose=False)


def build_ops(builders: Optional[Sequence[str]] = None, log: Callable[[str], None] = print) -> dict[str, str]:
    """Build (or load from the cache) each DeepSpeed op ds_muon's runs use on this accelerator, one after
    another, with a progress line each; stale locks first removed (:func:`clear_stale_lock`).

    Args:
        builders: DeepSpeed op-builder class names (default: :data:`OPS` for the current accelerator).
        log: where progress lines go.

    Returns:
        ``{builder: "built" | "cached" | "prebuilt" | "skipped: <why>"}``; an op whose build fails is reported
        there (``"failed: <error>"``) and the others still build (DeepSpeed reports the failure again, with its
        compiler output, where the op is used).
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    accel = get_accelerator()
    names = builders or OPS.get(accel.device_name(), OPS["cuda"])
    out: dict[str, str] = {}
    for cls in names:
        builder = accel.create_op_builder(cls)
        if builder is None:
            out[cls] = "skipped: this accelerator has no such op"
            continue
        if installed_ops.get(builder.name):
            out[cls] = "prebuilt"
            continue
        if not builder.is_compatible(verbose=False):
            out[cls] = "skipped: not buildable here (e.g. libaio missing for async_io)"
            log(f">> {builder.name}: {out[cls]}")
            continue
        build_dir = _build_dir(builder.name)
        clear_stale_lock(build_dir, log)
        cached = any(f.endswith(".so") for f in os.listdir(build_dir)) if os.path.isdir(build_dir) else False
        if not cached:
            log(f">> building DeepSpeed's {builder.name} op (once per environment; {BUILD_TIME}) in {build_dir}")
        start = time.monotonic()
        try:
            with heartbeat(builder.name, log) if not cached else contextlib.nullcontext():
                builder.load(verbose=False)
        except Exception as err:  # noqa: BLE001 - report it and go on; the run that needs the op reports it too
            out[cls] = f"failed: {type(err).__name__}: {err}"
            log(f">> {builder.name}: build failed ({type(err).__name__}: {err})")
            continue
        out[cls] = "cached" if cached else "built"
        if not cached:
            log(f">> {builder.name} built in {time.monotonic() - start:.0f} s")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ds_muon.integration.jit_ops [BUILDER ...]``: build the ops; exit code 1 if one failed."""
    parser = argparse.ArgumentParser(prog="python -m ds_muon.integration.jit_ops", description=__doc__.split("\n")[0])
    parser.add_argument("builders", nargs="*", help="DeepSpeed op-builder class names (default: all ds_muon uses)")
    args = parser.parse_args(argv)
    result = build_ops(args.builders or None, log=lambda line: print(line, flush=True))
    failed = [k for k, v in result.items() if v.startswith("failed")]
    print(">> DeepSpeed ops: " + ", ".join(f"{k} {v.split(':')[0]}" for k, v in result.items()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
