"""Does Newton–Schulz of a matrix depend on which other matrices share its batched call? (GPU check.)

Why: on CUDA, ``scripts/overlap_nccl.py --suite zero12`` found overlap on and off 4.5e-7 apart (relative) in the
``bucket_across_partitions`` case (``exchange_bucket_mb`` 0.0105, bf16 wire: owner-plan buckets of 5505 elements),
and bit for bit equal in every other case. The overlapped step builds its owner plan in ``order="reverse"``, the
step after backward in ``order="cost"`` (:func:`ds_muon.sharded.ownership.build_bucketed_plan`), and with buckets
that small the two orders put ParityNet's three 24x24 matrices (q, o, extra) into different buckets: one batched
call of 3 against calls of 1 and 2. If cuBLAS picks its kernel by batch count, the same matrix gets other bits.

This script orthogonalizes the same matrices (ParityNet's 24x24 and a 1024x1024 set for contrast) once as one
batch and once split as the reverse plan splits them, in the compute dtype, and prints per shape whether every
output is bit for bit equal and the largest relative difference. On the CPU the batched fp32 product is
per-matrix, so both print equal there (what tests/dist/test_overlap_zero12.py relies on).

Usage: ``python scripts/ns_batch_bits.py [--dtype bfloat16] [--out FILE.json]``.
"""
from __future__ import annotations

import argparse
import json

import torch

from ds_muon.core.newton_schulz import orthogonalize


def compare(shape: tuple[int, int], count: int, split: int, dtype: torch.dtype, device: torch.device) -> dict:
    """``count`` random matrices of ``shape`` (fp32, seed 0) orthogonalized as one batch and as two batches
    (``split`` and ``count - split`` matrices). Returns ``{"shape", "count", "split", "bit_equal",
    "max_rel_diff"}`` (the difference's max-norm over the batched output's)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(count, *shape, generator=gen).to(device)
    whole = orthogonalize(x, dtype=dtype).float()
    parts = torch.cat([orthogonalize(x[:split], dtype=dtype), orthogonalize(x[split:], dtype=dtype)]).float()
    diff = (whole - parts).abs().max().item() / max(whole.abs().max().item(), 1e-30)
    return {"shape": list(shape), "count": count, "split": split, "bit_equal": bool(torch.equal(whole, parts)),
            "max_rel_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    rows = [compare(shape, count, split, dtype, device)
            for shape, count, split in (((24, 24), 3, 1), ((24, 24), 2, 1), ((1024, 1024), 3, 1),
                                        ((1024, 4096), 4, 2))]
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), {args.dtype}")
    print("| shape | batch | split | bit equal | max relative difference |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['count']} | {r['split']} + {r['count'] - r['split']} | {r['bit_equal']} "
              f"| {r['max_rel_diff']:.3g} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
