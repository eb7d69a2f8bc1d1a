"""The publish order of ds_muon's two-phase save (ds_muon/integration/atomic_save.py) on a real filesystem, W=2:
``latest`` must name a tag whose files are all complete at every instant, the previous tag whenever the new save
did not finish. Three faults: a rename that fails (on rank 1), both ranks killed (SIGKILL) right after their last
rename, rank 0 killed right after it wrote ``latest``. The checks read the files the killed ranks left.

(Fails with ``latest`` written before the tag's files are renamed into place: ``latest`` then names a tag with no
model-states file after the failed rename, and after the kill that follows the ``latest`` write.)
"""
from __future__ import annotations

import hashlib
import os

import pytest

from tests.support.harness import build_engine, ds_config
from tests.support.models import batch, use_extra
from tests.support.spawn import run_distributed


def _step(engine, rank: int, step: int) -> None:
    tokens, targets = batch(step, rank, 0)
    engine.backward(engine(tokens, targets, use_extra(step)))
    engine.step()


def _digests(folder: str) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _kill() -> None:
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def _faults(rank: int, world_size: int, ckpt: str, crash: str) -> dict:
    """Save t1 (``latest``); save t2 with rank 1's rename of its optimizer file failing (records the error and
    ``latest``); then save t3 and die at ``crash``: ``"after_renames"`` (every rank, right after renaming its
    files into place) or ``"after_latest"`` (rank 0, right after ``latest`` is replaced; rank 1 then dies in the
    collective that follows)."""
    from ds_muon.checkpoint import CheckpointError
    from ds_muon.integration import atomic_save
    engine, _ = build_engine(ds_config())
    _step(engine, rank, 0)
    engine.save_checkpoint(ckpt, tag="t1")
    out = {"t1": _digests(os.path.join(ckpt, "t1"))}
    _step(engine, rank, 1)
    real_replace = os.replace

    def failing_replace(src, dst):
        if rank == 1 and str(src).endswith("optim_states.pt.tmp"):
            raise PermissionError(13, "Permission denied (planted)", str(dst))
        return real_replace(src, dst)

    atomic_save.os.replace = failing_replace
    try:
        engine.save_checkpoint(ckpt, tag="t2")
        out["t2"] = None
    except CheckpointError as err:
        out["t2"] = str(err)
    finally:
        atomic_save.os.replace = real_replace
    with open(os.path.join(ckpt, "latest")) as f:
        out["latest_after_t2"] = f.read().strip()
    if crash == "after_renames":
        commit = atomic_save._SaveRecord.commit

        def commit_then_die(self):
            lines = commit(self)
            _kill()
            return lines

        atomic_save._SaveRecord.commit = commit_then_die
    else:
        def replace_then_die(src, dst):
            real_replace(src, dst)
            if os.path.basename(str(dst)) == "latest":
                _kill()

        atomic_save.os.replace = replace_then_die
    with open(os.path.join(ckpt, f"rank{rank}.out"), "w") as f:  # read by the parent after the kill
        f.write(repr(out))
    _step(engine, rank, 2)
    engine.save_checkpoint(ckpt, tag="t3")
    return out  # not reached: every rank is killed in the save (or in the collective after a peer's death)


def _complete(ckpt: str, tag: str) -> None:
    """Raise unless ``ckpt/tag`` has every file of a finished save, each intact, and no temporary file."""
    from ds_muon.checkpoint.files import verify_checkpoint_files
    folder = os.path.join(ckpt, tag)
    verify_checkpoint_files(folder)
    left = [p for p in _digests(folder) if p.endswith(".tmp") or ".tmp" + os.sep in p]
    assert not left, f"{folder} holds temporary files: {left}"


@pytest.mark.parametrize("crash", ["after_renames", "after_latest"])
def test_latest_names_a_complete_tag_after_a_failed_rename_and_a_crash(tmp_path, crash):
    """A failed rename on rank 1 raises on both ranks, ``latest`` still names t1 and t1 is byte-identical; a kill
    right after the renames leaves ``latest`` at t1 (t3 complete but not published); a kill right after ``latest``
    was written leaves it naming t3, complete."""
    import ast
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError):
        run_distributed(_faults, 2, ckpt, crash, timeout=180)
    with open(os.path.join(ckpt, "latest")) as f:
        latest = f.read().strip()
    for rank in range(2):
        with open(os.path.join(ckpt, f"rank{rank}.out")) as f:
            out = ast.literal_eval(f.read())
        assert out["t2"] and "renaming" in out["t2"] and "Permission denied (planted)" in out["t2"], out["t2"]
        assert out["latest_after_t2"] == "t1", out
    _complete(ckpt, "t1")
    assert _digests(os.path.join(ckpt, "t1")) == out["t1"], "the failed saves changed t1"
    assert latest == ("t1" if crash == "after_renames" else "t3"), latest
    _complete(ckpt, latest)
    if crash == "after_renames":
        _complete(ckpt, "t3")  # every rank had renamed its files: t3 is whole, only not published
