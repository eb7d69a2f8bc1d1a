"""Stale JIT build locks (ds_muon.integration.jit_ops): a lock is stale when no process builds in its directory."""
from __future__ import annotations

import os
import subprocess
import time

from ds_muon.integration.jit_ops import LOCK_GRACE_S, builder_alive, clear_stale_lock, stale_lock


def _old(path) -> None:
    t = time.time() - LOCK_GRACE_S - 5
    os.utime(path, (t, t))


def test_lock_without_builder_is_removed_with_a_line(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert stale_lock(str(tmp_path)) is None  # young: a build may be starting
    _old(lock)
    assert builder_alive(str(tmp_path)) is False
    lines = []
    assert clear_stale_lock(str(tmp_path), lines.append)
    assert not lock.exists() and len(lines) == 1 and str(lock) in lines[0] and "killed" in lines[0]
    assert not clear_stale_lock(str(tmp_path), lines.append)  # nothing left to remove


def test_lock_with_a_live_builder_is_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    _old(lock)
    builder = subprocess.Popen(["sleep", "30"], cwd=tmp_path)  # as ninja runs in the build directory
    try:
        assert builder_alive(str(tmp_path)) is True
        assert stale_lock(str(tmp_path)) is None and not clear_stale_lock(str(tmp_path), print)
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()
    assert stale_lock(str(tmp_path)) == str(lock)


def test_lock_held_open_by_a_live_process_is_kept_at_any_age(tmp_path):
    """torch's FileBaton keeps the descriptor it created ``lock`` with open until it removes the file, also in the
    milliseconds before ninja starts in the build directory (a live holder whose working directory is elsewhere):
    its lock is kept with no grace at all; once the holder is gone (killed: the file stays) it is stale."""
    import sys

    from ds_muon.integration.jit_ops import clear_stale_locks
    (tmp_path / "async_io").mkdir()
    lock = tmp_path / "async_io" / "lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\n"  # as FileBaton.try_acquire
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert holder.stdout.readline().strip() == "held"
        _old(lock)
        assert builder_alive(str(lock.parent)) is True
        assert stale_lock(str(lock.parent), grace_s=0) is None and clear_stale_locks(str(tmp_path), grace_s=0) == []
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    lines = []
    assert clear_stale_locks(str(tmp_path), lines.append, grace_s=0) == [str(lock.parent)] and not lock.exists()
    assert "taken " in lines[0] and " s ago" in lines[0]


def test_heartbeat_logs_while_a_build_runs_and_stops_after():
    """A build of many minutes prints a line every ``every`` seconds (issue 30: an 18-minute async_io build printed
    nothing and looked hung); after the body ends no more lines come."""
    import time

    from ds_muon.integration.jit_ops import heartbeat
    lines = []
    with heartbeat("async_io", lines.append, every=0.05):
        time.sleep(0.28)
    n = len(lines)
    time.sleep(0.15)
    assert 3 <= n == len(lines), lines
    assert lines[0].startswith(">> still building async_io: ") and lines[0].endswith(" s so far (compiling C++ on the CPU)")


def test_every_stale_lock_under_the_cache_is_removed_and_live_builds_are_kept(tmp_path):
    """clear_stale_locks scans every op folder of the cache (tests/conftest.py calls it before the session, and
    after each test with no grace): stale locks go, each with a line; a live build's lock and a young lock stay
    (``grace_s``), and grace 0 takes the young one too."""
    from ds_muon.integration.jit_ops import clear_stale_locks
    for name in ("async_io", "cpu_adam", "fused_adam", "pin_memory"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lock").touch()
    for name in ("async_io", "cpu_adam", "fused_adam"):
        _old(tmp_path / name / "lock")
    builder = subprocess.Popen(["sleep", "30"], cwd=tmp_path / "fused_adam")
    try:
        lines = []
        cleared = clear_stale_locks(str(tmp_path), lines.append)
        assert cleared == [str(tmp_path / "async_io"), str(tmp_path / "cpu_adam")], cleared
        assert len(lines) == 2 and all("killed" in line for line in lines)
        assert (tmp_path / "fused_adam" / "lock").exists() and (tmp_path / "pin_memory" / "lock").exists()
        assert clear_stale_locks(str(tmp_path), lines.append, grace_s=0) == [str(tmp_path / "pin_memory")]
        assert (tmp_path / "fused_adam" / "lock").exists()
    finally:
        builder.kill()
        builder.wait()
    assert clear_stale_locks(str(tmp_path / "missing"), lines.append) == []


def test_a_lock_taken_anew_while_proc_is_read_is_kept(tmp_path, monkeypatch):
    """Between the look at the lock and its removal another cleaner may remove it and a loader take a new one (a
    new file): that one is kept."""
    from ds_muon.integration import jit_ops
    lock = tmp_path / "lock"
    lock.touch()
    _old(lock)
    real = jit_ops.stale_lock

    def retaken(build_dir, now=None, grace_s=LOCK_GRACE_S):
        found = real(build_dir, now, grace_s)
        lock.unlink()  # another cleaner
        fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # a loader's FileBaton
        os.close(fd)
        return found

    monkeypatch.setattr(jit_ops, "stale_lock", retaken)
    assert real(str(tmp_path)) == str(lock)  # stale as it stands
    assert not clear_stale_lock(str(tmp_path), print) and lock.exists()
