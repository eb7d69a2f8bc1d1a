"""DeepSpeed's leaked CPU shared-memory all-reduce segments (ds_muon.integration.shm_segments): a segment no live
process maps or holds open is removed; one mapped, one held open while its rank writes it, one written within the
last seconds (a new group reusing the name), another port's, and another user's name are kept."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

from ds_muon.integration.shm_segments import PREFIX, main, remove_leaked_segments, segments_in_use


def _segment(directory, port: int, rank: int, age_s: float = 60.0, uid: int | None = None):
    path = directory / f"{PREFIX}{os.getuid() if uid is None else uid}_127.0.0.1_{port}_{rank}"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def _holder(code: str, path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"import mmap, os, time\n{code}\nprint('ready', flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True, env={**os.environ, "P": str(path)})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_unused_segments_go_and_used_ones_stay(tmp_path, capsys):
    orphan, mapped, opened = (_segment(tmp_path, 29500, r) for r in range(3))
    fresh = _segment(tmp_path, 29500, 3, age_s=0)  # just written: a new group reusing the name
    other_port, other_user = _segment(tmp_path, 29501, 0), _segment(tmp_path, 29500, 4, uid=os.getuid() + 1)
    holders = [_holder("f = open(os.environ['P'], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()", mapped),
               _holder("fd = os.open(os.environ['P'], os.O_RDWR)", opened)]  # DeepSpeed's shared_create, mid-write
    try:
        assert segments_in_use({mapped.name, opened.name, orphan.name}) == {mapped.name, opened.name}
        removed = remove_leaked_segments(29500, str(tmp_path))
        assert removed == [(str(orphan), mmap.PAGESIZE)]
        assert all(p.exists() for p in (mapped, opened, fresh, other_port, other_user))
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
    # their processes gone: removed; the fresh one once older than min_age_s; other ports without a port filter
    assert {p for p, _ in remove_leaked_segments(29500, str(tmp_path), min_age_s=0)} == {
        str(mapped), str(opened), str(fresh)}
    assert remove_leaked_segments(None, str(tmp_path)) == [(str(other_port), mmap.PAGESIZE)]
    assert other_user.exists() and remove_leaked_segments(None, str(tmp_path / "missing")) == []
    assert main(["--port", "1"]) == 0  # the command line: nothing of port 1 here, no line
    assert capsys.readouterr().out == ""
