"""A small real filesystem for disk-full tests: ext4 on a loop device (O_DIRECT works there, as DeepSpeed's async
I/O needs; tmpfs has no O_DIRECT), and a filler file that leaves a chosen number of bytes free.

Mounting needs root and a kernel that lends loop devices to this container; where either is missing the test
is skipped with the reason (:func:`small_filesystem`), never passed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

FILLER = "filler.bin"


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def small_filesystem(root: Path, size_mib: int) -> Iterator[Path]:
    """Mount a fresh ``size_mib`` MiB ext4 filesystem (no blocks reserved for root) at ``root/mnt``; unmount after.

    Skips the calling test (``pytest.skip``, with the reason) where mounting is not possible here.
    """
    if os.geteuid() != 0:
        pytest.skip("disk-full test: mounting a small filesystem (loop device) needs root")
    if not (shutil.which("mkfs.ext4") and shutil.which("mount")):
        pytest.skip("disk-full test: mkfs.ext4 or mount is not installed")
    image, mnt = root / "small_fs.img", root / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    try:
        _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        _run("mount", "-o", "loop", str(image), str(mnt))
    except (subprocess.CalledProcessError, OSError) as err:
        reason = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"disk-full test: cannot mount a loop-device filesystem in this container ({reason.strip()})")
    try:
        yield mnt
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("umount", str(mnt))
        image.unlink(missing_ok=True)


def fill(folder: str, leave: int) -> int:
    """Allocate ``folder``'s filesystem full but ``leave`` bytes (one filler file in ``folder``); returns the bytes
    free afterwards."""
    free = shutil.disk_usage(folder).free
    fd = os.open(os.path.join(folder, FILLER), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(free - leave, 1))
    finally:
        os.close(fd)
    return shutil.disk_usage(folder).free


def unfill(folder: str) -> None:
    """Remove :func:`fill`'s filler file."""
    os.remove(os.path.join(folder, FILLER))
