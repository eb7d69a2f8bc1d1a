"""Crash-safe, disk-full-safe ``save_checkpoint`` on a ds_muon engine (layer ``integration``).

DeepSpeed 0.19.8 writes each checkpoint file in place, and rank 0 writes ``latest`` as soon as its own files are
written, without waiting for the other ranks. A rank killed in the middle of a write leaves a short file under the
final name, and ``latest`` may already name the broken tag. A write that fails (a full disk: ``torch.save`` raises)
raises on that rank only, while the other ranks wait in DeepSpeed's next barrier until the process-group time-out
(30 minutes by default). Saving again to an existing tag overwrites its files one by one, so a failure half-way
leaves neither the old save nor the new one. :func:`install_atomic_save` changes all three, on one engine, with a
two-phase save:

* write: every file is written to ``<name>.tmp`` (DeepSpeed's recovery scripts to a ``.ds_muon_scripts.tmp``
  folder of the tag), and no file under its final name is touched. A failed write (``OSError``, or the
  ``RuntimeError`` torch's zip writer raises for one) is recorded instead of raised, its temporary file removed,
  and the rank's later writes of that save skipped, so every rank runs the rest of DeepSpeed's save (its
  collectives and barriers) in step;
* if any rank failed: every rank removes its temporary files and all ranks raise the same
  :class:`~ds_muon.errors.CheckpointError` together, naming each failed file, the bytes it needed (its tensors)
  and the bytes free there. Nothing under a final name changed: a new tag has no file (which
  :func:`ds_muon.checkpoint.files.verify_checkpoint_files` refuses to load), an existing tag keeps its previous,
  complete files;
* otherwise, commit: every rank renames its temporary files into place (``os.replace``, atomic per file on POSIX,
  and it needs no free space), then ``latest`` is written (also through a temporary name), only after every
  rank's files are in place: it keeps naming the last complete tag. A rename that fails raises on every rank,
  naming the files of the tag already replaced and those not.

Saving over an existing tag needs room for the new files while the old ones are still there. A rank killed
during the commit (a few renames) can leave an existing tag with some files of each save. The training state in
memory is untouched by a failed save: free space (or pick another ``save_dir``) and save again. Decoupled
(asynchronous) checkpoint engines keep DeepSpeed's own commit protocol.
"""
from __future__ import annotations

import functools
import inspect
import os
import shutil
import weakref

import torch
import torch.distributed as dist

from ..checkpoint.files import LATEST, read_tag
from ..checkpoint.metadata import raise_on_every_rank

__all__ = ["install_atomic_save", "tensor_bytes", "SCRIPTS_STAGING"]

#: The folder of a tag that DeepSpeed's recovery scripts (``zero_to_fp32.py``, ...) are copied into during a
#: save, before they are renamed into the tag.
SCRIPTS_STAGING = ".ds_muon_scripts.tmp"


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists, tuples): a lower bound of its ``torch.save`` size."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _free_bytes(path: str) -> int | None:
    """Bytes free on the filesystem of ``path`` (its nearest existing folder), or None if that cannot be read."""
    folder = path
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder or ".").free
    except OSError:
        return None


def _failure(rank: int, what: str, path: str, err: BaseException, nbytes: int) -> str:
    """One line naming a failed write: the file, the error, the bytes it needed and those free.

    torch.save's zip writer drops the OS error of a failed write (``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``): where fewer bytes are free than the file needs, the line names ENOSPC as
    the inferred cause."""
    free = _free_bytes(path)
    cause = f"{type(err).__name__}: {str(err).strip()}"
    if not isinstance(err, OSError) and free is not None and free < nbytes:
        cause += "; [Errno 28] No space left on device (inferred: torch.save does not report the OS error)"
    need = f"the file needs at least {nbytes} bytes (its tensors) and " if nbytes else ""
    return (f"rank {rank}: {what} {path} failed ({cause}); {need}its filesystem has "
            f"{'an unknown number of' if free is None else free} bytes free")


class _SaveRecord:
    """One rank's account of one ``save_checkpoint``: files written under temporary names, waiting to be renamed
    into place, and failures (message lines)."""

    def __init__(self) -> None:
        self.pending: dict[str, str] = {}  # final path -> temporary path, in write order
        self.staging: list[str] = []  # temporary folders (recovery scripts), removed after the commit or discard
        self.failed: list[str] = []

    def fail(self, path: str, nbytes: int, err: BaseException) -> None:
        self.failed.append(_failure(dist.get_rank() if dist.is_initialized() else 0, "writing", path, err, nbytes))

    def discard(self) -> None:
        """Remove every temporary file and folder of this save; no file under a final name is touched."""
        for tmp in self.pending.values():
            try:
                os.remove(tmp)
            except OSError:
                pass
        self.pending.clear()
        self._remove_staging()

    def _remove_staging(self) -> None:
        for folder in self.staging:
            shutil.rmtree(folder, ignore_errors=True)
        self.staging.clear()

    def commit(self) -> list[str]:
        """Rename every temporary file into place; one line (naming what was and was not replaced) if one
        rename failed, else none."""
        done: list[str] = []
        for path, tmp in list(self.pending.items()):
            try:
                os.replace(tmp, path)
            except OSError as err:
                rank = dist.get_rank() if dist.is_initialized() else 0
                left = [p for p in self.pending if p not in done]
                self.discard()
                return [f"rank {rank}: renaming {tmp} to {path} failed ({type(err).__name__}: {err}); this rank "
                        f"had replaced {done or 'no file'} with this save's and left {left} as they were (a previous "
                        "save's, or missing)"]
            done.append(path)
        self.pending.clear()
        self._remove_staging()
        return []


def _guard_writes(engine, record: "list[_SaveRecord | None]") -> None:
    """Route the engine's checkpoint-engine writes and its recovery-script copy through ``record[0]`` (set while
    a save runs): written under temporary names, renamed by :meth:`_SaveRecord.commit`, failures recorded instead
    of raised."""
    ckpt_engine = engine.checkpoint_engine
    if not getattr(ckpt_engine, "_ds_muon_atomic", False):
        write = ckpt_engine.save

        def atomic_write(state_dict, path: str):
            current = record[0]
            tmp = f"{path}.tmp"
            if current is None:  # outside save_checkpoint (DeepSpeed's save_16bit_model, ...): atomic only
                result = write(state_dict, tmp)
                os.replace(tmp, path)
                return result
            if current.failed:
                return None  # this rank's save has failed already: write nothing more
            try:
                result = write(state_dict, tmp)
            except (OSError, RuntimeError) as err:
                if os.path.exists(tmp):
                    os.remove(tmp)
                current.fail(path, tensor_bytes(state_dict), err)
                return None
            current.pending[path] = tmp
            return result

        ckpt_engine.save, ckpt_engine._ds_muon_atomic = atomic_write, True
    if not getattr(engine, "_ds_muon_guarded_scripts", False) and hasattr(engine, "_copy_recovery_script"):
        copy = engine._copy_recovery_script

        def copy_recovery_script(save_path):
            current = record[0]
            if current is None:
                return copy(save_path)
            if current.failed:
                return None
            staging = os.path.join(save_path, SCRIPTS_STAGING)
            try:
                shutil.rmtree(staging, ignore_errors=True)  # left by a killed save
                os.makedirs(staging)
                current.staging.append(staging)
                result = copy(staging)  # DeepSpeed copies its scripts into the folder it is given
            except OSError as err:
                current.fail(os.path.join(save_path, 'zero_to_fp32.py'), 0, err)
                return None
            for name in sorted(os.listdir(staging)):
                current.pending[os.path.join(save_path, name)] = os.path.join(staging, name)
            return result

        engine._copy_recovery_script, engine._ds_muon_guarded_scripts = copy_recovery_script, True


def _make_dirs(save_dir: str, tag: str, rank: int) -> list[str]:
    """Rank 0 creates ``save_dir/tag`` (DeepSpeed's own ``makedirs`` of ``save_dir`` raises on rank 0 alone)."""
    if rank != 0:
        return []
    try:
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
    except OSError as err:
        return [_failure(0, "creating", os.path.join(save_dir, tag), err, 0)]
    return []


def install_atomic_save(engine) -> None:
    """Make ``engine.save_checkpoint`` crash-safe and disk-full-safe (this module's docstring); on this engine only,
    holding it weakly.

    Raises (from the wrapped ``save_checkpoint``):
        CheckpointError: on every rank together, when creating the tag folder or writing a file failed on some
            rank; names each failed file, the bytes it needed, the bytes free on its filesystem, the tag and what
            ``latest`` still names (no file under a final name was changed). Also when renaming the written files
            into place failed on some rank, naming per rank the files replaced and those left as they were.
    """
    engine_ref = weakref.ref(engine)
    save = type(engine).save_checkpoint
    signature = inspect.signature(save)
    record: list[_SaveRecord | None] = [None]

    @functools.wraps(save)
    def save_checkpoint(*args, **kwargs):
        this = engine_ref()
        if this.checkpoint_engine is None or this.checkpoint_engine.is_decoupled():
            return save(this, *args, **kwargs)
        _guard_writes(this, record)
        bound = signature.bind(this, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        save_latest, a["save_latest"] = a["save_latest"], False
        tag = str(a["tag"]) if a["tag"] is not None else f"global_step{this.global_steps}"  # DeepSpeed's default
        save_dir = a["save_dir"]
        header = (f"ds_muon: save_checkpoint({save_dir!r}, tag={tag!r}) failed, on every rank; this save left no file "
                  f"in place (a previous save of tag {tag!r}, if any, keeps all its files) and `{LATEST}` still names "
                  f"{read_tag(save_dir, LATEST)!r}. Free space there (or save to another save_dir) and save again: the "
                  "training state in memory is intact.")
        raise_on_every_rank(_make_dirs(save_dir, tag, this.global_rank), None, header)
        record[0] = current = _SaveRecord()
        try:
            result = save(*bound.args, **bound.kwargs)
        except BaseException:
            current.discard()
            raise
        finally:
            record[0] = None
        if current.failed:
            current.discard()
        raise_on_every_rank(current.failed, None, header)
        # commit: every rank's files were written; rename them into place (collective: every rank is done after it)
        raise_on_every_rank(current.commit(), None,
                            f"ds_muon: save_checkpoint({save_dir!r}, tag={tag!r}): every file was written, but renaming "
                            f"them into place failed on some rank, so tag {tag!r} may hold files of this save and of a "
                            f"previous one (below, per rank); `{LATEST}` still names {read_tag(save_dir, LATEST)!r}. "
                            "Do not load that tag; save again (to another tag).")
        if save_latest:
            problems = []
            if this.global_rank == 0:
                tmp = os.path.join(save_dir, f"{LATEST}.tmp")
                try:
                    with open(tmp, "w", encoding="utf-8") as f:
                        f.write(tag)
                    os.replace(tmp, os.path.join(save_dir, LATEST))
                except OSError as err:
                    if os.path.exists(tmp):
                        os.remove(tmp)
                    problems.append(_failure(0, "writing", os.path.join(save_dir, LATEST), err, 0))
            raise_on_every_rank(problems, None, f"ds_muon: save_checkpoint({save_dir!r}, tag={tag!r}): the tag's "
                                f"files are complete, but `{LATEST}` could not be updated to name it; load it with "
                                f"tag={tag!r}, or free space and save again.")
        return result

    engine.save_checkpoint = save_checkpoint
