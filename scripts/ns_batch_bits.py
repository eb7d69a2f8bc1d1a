"""Does Newton–Schulz of a matrix depend on which other matrices share its batched call? (GPU check.)

Why: on CUDA, ``scripts/overlap_nccl.py --suite zero12`` found overlap on and off 4.5e-7 apart (relative) in the
``bucket_across_partitions`` case (``exchange_bucket_mb`` 0.0105, bf16 wire: owner-plan buckets of 5505 elements),
and bit for bit equal in every other case. The overlapped step builds its owner plan in ``order="reverse"``, the
step after backward in ``order="cost"`` (:func:`ds_muon.sharded.ownership.build_bucketed_plan`), and with buckets
that small the two orders put ParityNet's three 24x24 matrices (q, o, extra) into different buckets: one batched
call of 3 against calls of 1 and 2. If cuBLAS picks its kernel by batch count, the same matrix gets other bits.

This script orthogonalizes the same matrices (ParityNet's 24x24, and 1024x1024 and 1024x4096 sets for contrast)
once as one batch and once split as the reverse plan splits them, in the compute dtype, with the eager
``orthogonalize`` and with ``compiled_orthogonalize`` (what the owner step runs by default, ``ns_compile``: static
shapes, so each batch count is its own inductor graph), and prints per kernel and shape whether every output is bit
for bit equal and the largest difference relative to the largest entry. On the CPU both print equal (what
tests/dist/test_overlap_zero12.py relies on).

Usage: ``python scripts/ns_batch_bits.py [--dtype bfloat16] [--no-compiled] [--out FILE.json]``.
"""
from __future__ import annotations

import argparse
import json

import torch

from ds_muon.core.newton_schulz import orthogonalize
from ds_muon.core.ns_compile import compiled_orthogonalize


def compare(shape: tuple[int, int], count: int, split: int, dtype: torch.dtype, device: torch.device,
            kernel=None) -> dict:
    """``count`` random matrices of ``shape`` (fp32, seed 0) orthogonalized as one batch and as two batches
    (``split`` and ``count - split`` matrices) by ``kernel(x)`` (default: eager ``orthogonalize`` in ``dtype``).
    Returns ``{"shape", "count", "split", "bit_equal", "max_rel_diff"}`` (the difference's max-norm over the batched
    output's)."""
    if kernel is None:
        def kernel(x):
            return orthogonalize(x, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(count, *shape, generator=gen).to(device)
    whole = kernel(x).float()
    parts = torch.cat([kernel(x[:split]), kernel(x[split:])]).float()
    diff = (whole - parts).abs().max().item() / max(whole.abs().max().item(), 1e-30)
    return {"shape": list(shape), "count": count, "split": split, "bit_equal": bool(torch.equal(whole, parts)),
            "max_rel_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--no-compiled", action="store_true", help="the eager kernel only")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    kernels = {"eager": None}
    if not args.no_compiled:
        kernels["compiled"] = compiled_orthogonalize("standard", 5, dtype)
    rows = [dict(compare(shape, count, split, dtype, device, kernel), kernel=name)
            for name, kernel in kernels.items()
            for shape, count, split in (((24, 24), 3, 1), ((24, 24), 2, 1), ((1024, 1024), 3, 1),
                                        ((1024, 4096), 4, 2))]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}, {args.dtype}")
    print("| kernel | shape | batch | split | bit equal | max relative difference |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['count']} | {r['split']} + {r['count'] - r['split']} "
              f"| {r['bit_equal']} | {r['max_rel_diff']:.3g} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "device_name": name, "torch": torch.__version__, "dtype": args.dtype,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
