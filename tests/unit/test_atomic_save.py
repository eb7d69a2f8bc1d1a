"""The commit of ds_muon's two-phase save (ds_muon/integration/atomic_save.py), in one process: temporary files are
renamed into place only at the commit; a failed save discards them (final names untouched); a rename that fails
names what was replaced and what was not. The multi-rank, real-filesystem cases: tests/dist/test_faults.py."""
from __future__ import annotations

import os

from ds_muon.integration import atomic_save
from ds_muon.integration.atomic_save import _SaveRecord


def _pending(tmp_path, names) -> _SaveRecord:
    record = _SaveRecord()
    for name in names:
        (tmp_path / name).write_text("old")
        (tmp_path / f"{name}.tmp").write_text("new")
        record.pending[str(tmp_path / name)] = str(tmp_path / f"{name}.tmp")
    return record


def test_discard_leaves_the_previous_files(tmp_path):
    record = _pending(tmp_path, ["a.pt", "b.pt"])
    staging = tmp_path / atomic_save.SCRIPTS_STAGING
    staging.mkdir()
    record.staging.append(str(staging))
    record.discard()
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]
    assert (tmp_path / "a.pt").read_text() == (tmp_path / "b.pt").read_text() == "old"


def test_commit_replaces_every_file(tmp_path):
    record = _pending(tmp_path, ["a.pt", "b.pt"])
    assert record.commit() == [] and not record.pending
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]
    assert (tmp_path / "a.pt").read_text() == (tmp_path / "b.pt").read_text() == "new"


def test_failed_rename_names_what_was_replaced_and_what_was_not(tmp_path, monkeypatch):
    record = _pending(tmp_path, ["a.pt", "b.pt", "c.pt"])
    real = os.replace

    def replace(src, dst):
        if dst.endswith("b.pt"):
            raise PermissionError(13, "Permission denied")
        return real(src, dst)

    monkeypatch.setattr(atomic_save.os, "replace", replace)
    lines = record.commit()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"rank 0: renaming {tmp_path / 'b.pt.tmp'} to {tmp_path / 'b.pt'} failed (PermissionError"), line
    assert f"had replaced [{str(tmp_path / 'a.pt')!r}]" in line, line
    assert f"left [{str(tmp_path / 'b.pt')!r}, {str(tmp_path / 'c.pt')!r}] as they were" in line, line
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt", "c.pt"]  # no .tmp left
    assert [(tmp_path / n).read_text() for n in ("a.pt", "b.pt", "c.pt")] == ["new", "old", "old"]
