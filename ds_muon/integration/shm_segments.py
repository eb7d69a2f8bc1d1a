"""DeepSpeed's CPU shared-memory all-reduce segments that no process uses any more: find them and remove them.

Layer ``integration`` (about DeepSpeed's behaviour; imports nothing of it). On the CPU accelerator DeepSpeed 0.19.8
runs all-reduce through shared memory (``deepspeed/ops/csrc/cpu/comm/shm.cpp``, ``shm_initialize``): each rank
creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (66 MiB: ``shm_open`` with
``O_CREAT``, a ``write`` of the whole workspace, then ``mmap``), and the other ranks open it by name, retrying
until it exists. Nothing unlinks it, also when the run ends normally, so each CPU run leaves one segment per rank in
RAM (tmpfs) until reboot. A segment is in use while a live process maps it or holds it open (its rank holds the
descriptor from creation on, through the ``write`` before the ``mmap``, and never closes it); anything else is
left over and removed here.

Races: a name is reused by the next group on the same port (``O_CREAT`` without ``O_EXCL``), so a segment found
unused can be opened again between the scan of ``/proc`` and the removal; a segment written within the last
``min_age_s`` seconds (its ``mtime``: the rank's ``write`` sets it) is therefore kept.

``python -m ds_muon.integration.shm_segments [--port P]`` removes them (``scripts/train.sh`` and ``scripts/test.sh``
call it).
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import sys
import time
from typing import Optional

__all__ = ["SHM_DIR", "PREFIX", "segments_in_use", "remove_leaked_segments", "describe", "main"]

#: Where POSIX shared memory lives on Linux (``shm_open``'s names).
SHM_DIR = "/dev/shm"
#: DeepSpeed 0.19.8's segment name prefix (``SHM_BUFFER_NAME`` in shm.cpp).
PREFIX = "deepspeed_allreduce_buffer_"


def segments_in_use(names: set[str]) -> set[str]:
    """The ``names`` (file names under a shared-memory directory) that some live process maps (``/proc/<pid>/maps``)
    or holds open (``/proc/<pid>/fd``); processes of other users that ``/proc`` hides are not seen."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(os.path.basename(line.split(None, 5)[-1].strip()) for line in f if PREFIX in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed meanwhile
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if PREFIX in target:
                        used.add(os.path.basename(target))
        except OSError:  # gone, or another user's process
            continue
    return used & names


def remove_leaked_segments(port: Optional[int] = None, directory: str = SHM_DIR,
                           min_age_s: float = 5.0) -> list[tuple[str, int]]:
    """Remove this user's DeepSpeed all-reduce segments in ``directory`` that no live process maps or holds open
    and that were last written more than ``min_age_s`` seconds ago; only those of rendezvous port ``port`` where
    given. Returns ``[(path, bytes)]`` of those removed (66 MiB each at DeepSpeed 0.19.8); ``[]`` where there are
    none or ``/proc`` is missing (not Linux). Errors on single files (another user's, removed meanwhile) are
    skipped."""
    if not os.path.isdir("/proc/self"):
        return []
    pattern = f"{PREFIX}{os.getuid()}_*_{port}_*" if port is not None else f"{PREFIX}{os.getuid()}_*"
    try:
        names = {n for n in os.listdir(directory) if fnmatch.fnmatchcase(n, pattern)}
    except OSError:
        return []
    if not names:
        return []
    used = segments_in_use(names)
    removed = []
    for name in sorted(names - used):
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if time.time() - st.st_mtime < min_age_s:  # being written: a new group reusing the name
                continue
            os.remove(path)
            removed.append((path, st.st_size))
    return removed


def describe(removed: list[tuple[str, int]]) -> str:
    """``remove_leaked_segments``'s result in words: ``"<n> DeepSpeed shared-memory segments no process maps or
    holds open (<MiB> MiB of RAM)"``, for the lines that report a clean-up."""
    return (f"{len(removed)} DeepSpeed shared-memory segments no process maps or holds open "
            f"({sum(n for _, n in removed) / 2**20:.0f} MiB of RAM)")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ds_muon.integration.shm_segments [--port P]``: remove leaked segments, one line if any."""
    parser = argparse.ArgumentParser(prog="python -m ds_muon.integration.shm_segments",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=None, help="only segments of this MASTER_PORT")
    args = parser.parse_args(argv)
    removed = remove_leaked_segments(args.port)
    if removed:
        print(f">> removed {describe(removed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
