"""A byte-level text corpus and a seeded random-window batch sampler.

Token ids are raw bytes (0..255), so the model's vocab is 256 and there is no tokenizer.

Default corpus: the Python standard library's own ``.py`` sources (the directory from
``sysconfig.get_paths()["stdlib"]``, walked in sorted order, ``site-packages`` skipped, then shuffled with a
fixed seed), concatenated up to ``max_bytes``. Every machine with Python has it, so the example needs no
download. Any text file can be used instead (``path=``). The last ``val_fraction`` of the bytes is held out
for validation.
"""
from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES, order_seed: int = 0) -> bytes:
    """The stdlib's .py files, concatenated and capped at max_bytes.

    The file list is walked in sorted order and then shuffled with a fixed seed, so the result is deterministic
    while the capped sample (and the held-out tail) is drawn from the whole library rather than from the first
    packages alphabetically (whose tail would be ``encodings/``' codec tables).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        paths += [Path(dirpath) / name for name in sorted(filenames) if name.endswith(".py")]
    random.Random(order_seed).shuffle(paths)
    chunks, total = [], 0
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no .py files found under {root}")
    return b"".join(chunks)[:max_bytes]


class ByteCorpus:
    """A byte string split into ``train`` and ``val`` uint8 tensors (val = the last ``val_fraction``)."""

    def __init__(self, path: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.02):
        if path is None:
            raw, self.source = stdlib_sources(max_bytes), f"Python stdlib sources ({sysconfig.get_paths()['stdlib']})"
        else:
            raw, self.source = Path(path).read_bytes()[:max_bytes], str(path)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = max(1, int(len(data) * val_fraction))
        self.train, self.val = data[:-n_val], data[-n_val:]

    def __repr__(self) -> str:
        return f"ByteCorpus({self.source}: {len(self.train):,} train / {len(self.val):,} val bytes)"

    def batches(self, split: str, batch_size: int, seq_len: int, seed: int,
                device: torch.device | str = "cpu", skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless (input_ids, targets) batches, each (batch_size, seq_len) int64, from random offsets.

        targets = input_ids shifted by one byte. The sampler's torch.Generator is seeded with ``seed``;
        pass ``seed + rank`` so that each data-parallel rank draws different windows. ``skip`` batches are
        drawn and dropped first (only their offsets), so a resumed run continues the sequence where the
        saved run stopped.
        """
        data = self.train if split == "train" else self.val
        if len(data) < seq_len + 1:
            raise ValueError(f"{split} split has {len(data)} bytes, fewer than seq_len + 1 = {seq_len + 1}")
        gen = torch.Generator().manual_seed(seed)
        span = torch.arange(seq_len + 1)
        for _ in range(skip):
            torch.randint(0, len(data) - seq_len, (batch_size, 1), generator=gen)
        while True:
            starts = torch.randint(0, len(data) - seq_len, (batch_size, 1), generator=gen)
            window = data[starts + span].long()                       # (B, T + 1)
            yield window[:, :-1].to(device), window[:, 1:].to(device)
