"""One spawn helper for every multi-rank test: W CPU processes on gloo, results back as objects.

A test passes a *module-level* function ``fn(rank, world_size, *args) -> picklable``; it runs in
``world_size`` new processes (forked from a forkserver that has imported torch, deepspeed and
transformers, or fresh interpreters: :func:`start_method`) with ``torch.distributed`` initialised
through DeepSpeed (gloo on the CPU accelerator). Batch several checks per call so a process group is spawned once per
world size. A worker that raises makes the whole call fail with its traceback; a hang is killed
after ``timeout`` seconds instead of blocking CI.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port that no DeepSpeed shared-memory segment is named after (one left by an earlier group
    that was killed would otherwise be shared with this group's all_reduce; any user's, named after the port)."""
    from ds_muon.integration.shm_segments import PREFIX, SHM_DIR
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not glob.glob(os.path.join(SHM_DIR, f"{PREFIX}*_127.0.0.1_{port}_*")):
            break
    return port


def _remove_shm_segments(port: int) -> None:
    """Delete the group's DeepSpeed shared-memory segments (DeepSpeed 0.19.8 never unlinks them) once its ranks are
    gone: :func:`ds_muon.integration.shm_segments.remove_leaked_segments` for the group's port, with no age
    margin (a free port: no other group reuses its names)."""
    from ds_muon.integration.shm_segments import remove_leaked_segments
    remove_leaked_segments(port, min_age_s=0)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), **env)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        import warnings
        # DeepSpeed 0.19.8 calls torch.distributed.all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13
        # deprecates with a FutureWarning per call (ds_muon calls neither): hundreds of lines in a failure's stderr
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
        import torch
        torch.set_num_threads(1)
        before = getattr(fn, "before_init", None)
        if before is not None:
            before()
        import deepspeed
        # File rendezvous: no TCP store port to race for (MASTER_PORT stays set: DeepSpeed's CPU
        # shared-memory comm names its segments after it).
        deepspeed.init_distributed(dist_backend="gloo", verbose=False, init_method=f"file://{out_dir}/rendezvous",
                                   rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(result, f)
    if result[0] == "error":
        os._exit(1)  # don't wait in a collective for peers that will never come
    try:  # leave together, then skip interpreter finalization: a gloo worker thread releasing a collective's tensors
        # then is ended by CPython with pthread_exit, and std::terminate aborts the rank (docs/troubleshooting.md)
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    finally:
        os._exit(0)


#: Modules a forkserver imports once for every rank it starts (``import torch, deepspeed, transformers`` is about
#: 3 s of CPU per rank when each rank is a fresh interpreter: 7 s of wall clock for a W=4 group on 2 cores), and
#: what a rank's first engine loads on top (torch.compile's modules, DeepSpeed's ops: another 5.7 s of CPU per rank):
#: :mod:`tests.support.rank_preload`.
PRELOAD = ["tests.support.rank_preload"]

#: Variables that change on their own during a run and do not make a forked rank differ from a fresh one: pytest
#: sets the first per test phase (no rank reads it); ``import deepspeed`` sets the second (``setdefault``, "1") in
#: the test process when a test first imports it, and in the forkserver, which imports it too.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK")


def _inductor_default_cache_dir() -> str | None:
    """The directory torch's inductor falls back to when ``TORCHINDUCTOR_CACHE_DIR`` is unset, absolute; None where
    torch has no such function."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return os.path.abspath(default_cache_dir())
    except Exception:  # noqa: BLE001 - another torch: the variable then counts as any other
        return None


def _environ() -> dict:
    """``os.environ`` less :data:`VOLATILE_ENV`, with ``TORCHINDUCTOR_CACHE_DIR`` made absolute and left out where
    it is inductor's default. Inductor writes the variable, absolute, into ``os.environ`` when its modules load
    (``torch/_inductor/runtime/cache_dir_utils.py``, ``cache_dir``; ``import torch._dynamo`` does it, which the
    first ``torch.optim`` optimizer of a process imports): in the test process as in a rank, so neither that nor
    the absolute form of a value set before the session is a change."""
    env = {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}
    if "TORCHINDUCTOR_CACHE_DIR" in env:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(env["TORCHINDUCTOR_CACHE_DIR"])
        if env["TORCHINDUCTOR_CACHE_DIR"] == _inductor_default_cache_dir():
            del env["TORCHINDUCTOR_CACHE_DIR"]
    return env


def changed_env() -> dict:
    """The variables that differ from :data:`_BASE_ENV` now, ``{name: (then, now)}`` (None: unset): any makes
    :func:`start_method` start fresh interpreters."""
    now = _environ()
    return {k: (_BASE_ENV.get(k), now.get(k)) for k in sorted(set(now) | set(_BASE_ENV)) if now.get(k) != _BASE_ENV.get(k)}


#: ``os.environ`` when this module was imported (at collection, before any test's ``monkeypatch.setenv``): the
#: forkserver starts, and its ranks run, only under this environment.
_BASE_ENV = _environ()


def start_method(fn: Callable, env: dict | None) -> str:
    """``"forkserver"`` (ranks forked from one process that imported :data:`PRELOAD`) when nothing the ranks import
    can differ from that process: no ``env`` for the ranks, and ``os.environ`` as it was when this module was
    imported (:data:`_BASE_ENV`), :data:`VOLATILE_ENV` aside (a variable set since, e.g. by ``monkeypatch.setenv``,
    would not reach forked ranks); else, or with ``DS_MUON_TEST_FORKSERVER=0``, ``"spawn"`` (fresh interpreters)."""
    # DS_MUON_TEST_FORKSERVER=0 makes every rank a fresh interpreter (to rule the forkserver out when a test fails).
    # fn.before_init (the byte counters' torch.distributed wrappers) runs in each rank before deepspeed.init_distributed:
    # DeepSpeed 0.19.8 binds all_gather_into_tensor / reduce_scatter_tensor there (comm/torch.py, TorchBackend) and
    # looks every other collective up per call, so a DeepSpeed imported beforehand is counted the same. The preload's
    # torch modules bind a few collectives by value (torch.distributed._functional_collectives, tensor._collective_utils):
    # neither ds_muon nor DeepSpeed's comm path calls them (checked by a review, 2026-12-05).
    if env or os.environ.get("DS_MUON_TEST_FORKSERVER") == "0" or changed_env():
        return "spawn"
    mp.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts, under _BASE_ENV
    return "forkserver"


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600,
                    env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (new processes, :func:`start_method`); return
    per-rank results.

    Raises:
        RuntimeError: a rank failed (with its traceback) or the group did not finish in ``timeout`` s.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir, contextlib.ExitStack() as cleanup:
        cleanup.callback(_remove_shm_segments, port)
        ctx = mp.start_processes(_worker, args=(world_size, port, out_dir, fn, args, env or {}),
                                 nprocs=world_size, join=False, start_method=start_method(fn, env))
        try:
            import time
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} at W={world_size} did not finish in {timeout} s")
        except Exception as exc:  # a rank died or timed out: collect what the ranks reported
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:  # gone, so that their shared-memory segments are unused when cleaned up
                p.join(10)
            reports = []
            for r in range(world_size):
                path = os.path.join(out_dir, f"rank{r}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        status, payload = pickle.load(f)
                    if status == "error":
                        reports.append(f"--- rank {r} ---\n{payload}")
            raise RuntimeError(f"{fn.__name__} failed at W={world_size}: {exc}\n" + "\n".join(reports)) from None
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                status, payload = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{payload}")
            results.append(payload)
        return results
