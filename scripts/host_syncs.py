"""Host-device syncs of one ZeRO-3 optimizer step, counted on the CPU (docs/design.md, "Host syncs of the step").

    python scripts/host_syncs.py [--world-size 1] [--arms ds_muon,builtin_muon,adamw] [--clip 1.0] [--stacks]

Runs each arm (``tests/support/host_reads.py: ARMS``) on the parity model at the given world size (gloo, CPU
accelerator), one warm-up step, then counts the calls of one ``engine.step()`` that would make the host wait for an
accelerator (:class:`tests.support.host_reads.HostReads`), and prints per arm the count on each rank and rank 0's
sources (``file:line (call)``, the innermost ds_muon or DeepSpeed frame); ``--stacks`` adds each call's last frames.
On a GPU, ``benchmarks/step_time.py --sync-debug`` counts the real ones.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    sys.path.insert(0, REPO)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from tests.support.host_reads import ARMS, count_steps
    from tests.support.spawn import run_distributed
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--arms", default="ds_muon,builtin_muon,adamw",
                    help=f"comma-separated, of {ARMS}; ds_muon's optimizer.params as ds_muon+key=json")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off)")
    ap.add_argument("--stacks", action="store_true")
    args = ap.parse_args()
    arms = args.arms.split(",")
    ranks = run_distributed(count_steps, args.world_size, arms, 1, args.clip)
    for arm in arms:
        r = ranks[0][arm]
        print(f"{arm} (W={args.world_size}, {r['optimizer']}, {r['sub_groups']} sub-groups): "
              f"{[x[arm]['count'] for x in ranks]} host syncs per rank")
        for where, n in sorted(r["sources"].items()):
            print(f"    {n} x {where}")
        if args.stacks:
            for (kind, where), stack in zip(r["events"], r["stacks"]):
                print(f"  -- {kind} at {where}:\n      " + "\n      ".join(stack[-10:]))


if __name__ == "__main__":
    main()
