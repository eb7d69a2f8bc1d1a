"""Stress: the fp16 overflow case of tests/dist/test_zero3_parity.py, repeated N times in one process group.

    python scripts/stress_fp16_overflow.py --runs 200            # W=2, the test's case, 200 times
    python scripts/stress_fp16_overflow.py --runs 50 --burn 2    # with 2 CPU-burning processes beside it

Each run builds a fresh ds_muon ZeRO-3 engine (fp16, dynamic loss scale 2^8, hysteresis 1), trains
``FP16_STEPS`` steps with step ``FP16_POISONED``'s loss multiplied by NaN, and checks exactly what the test
checks (``check_fp16_overflow``: that step, only it, skipped on every rank; fp32 weights and Muon momentum
bit-identical across it; the loss scale halved once; parity with the fp32 oracle that leaves the step out).
The engine and the oracle are the test's own functions, so a failure here is the test's failure.

Printed as each run ends: its number and verdict; for a failing run also each rank's evidence (which steps each rank skipped, its loss scales,
the sub-groups the skipped step changed with the number of elements and the largest change, the Muon step
counts across it) and the assertion's message. At the end one JSON line: runs, failures, seconds. ``--minutes M`` stops after the
run that ends past M minutes.

``--burn K`` starts K busy-looping processes for the duration (the full suite's load on a small machine:
timing-dependent faults show up under load, not alone). Where the CPU accelerator reports no fp16 support
(``get_accelerator().is_fp16_supported()`` False, as on CPUs without AVX-512 FP16/AMX-FP16), the test is
skipped; ``--force-fp16`` (default on) tells DeepSpeed's CPU accelerator it has fp16 so that the case runs on
torch's CPU fp16 kernels anyway (slower; the arithmetic is IEEE fp16 either way).

Exits 1 if any run failed.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout (tests.*), as pytest's rootdir does


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def stress_worker(rank: int, world_size: int, runs: int, minutes: float, force_fp16: bool) -> dict:
    """Repeat the test's fp16 overflow case up to ``runs`` times (or ``minutes``); rank 0 checks each run with the
    test's ``check_fp16_overflow`` on every rank's evidence (all-gathered) and prints a line per run at once."""
    import torch.distributed as dist
    from tests.dist.test_zero3_parity import CASES, _fp16_overflow_case, check_fp16_overflow
    if force_fp16:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        CPU_Accelerator.is_fp16_supported = lambda self: True
    case = next(c for c in CASES[world_size] if c.get("fp16_overflow"))
    start, failures, done = time.perf_counter(), [], 0
    for run in range(runs):
        t0 = time.perf_counter()
        res = _fp16_overflow_case(rank, world_size, case)
        res["seconds"] = time.perf_counter() - t0
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, res)
        done = run + 1
        if rank == 0:
            try:
                check_fp16_overflow(case, per_rank)
                verdict = "ok"
            except AssertionError as err:
                failures.append(run)
                verdict = f"FAILED: {err}"
            print(f"run {run}: {verdict} ({res['seconds']:.1f} s)", flush=True)
            if verdict != "ok":
                for r, ev in enumerate(per_rank):
                    print(f"    rank {r}: skipped={ev['skipped']} scales={ev['scales']} changed={ev.get('changed')} "
                          f"muon_steps_across={ev.get('muon_steps_across')} named={ev.get('named')}", flush=True)
        stop = [time.perf_counter() - start > 60 * minutes]
        dist.broadcast_object_list(stop, src=0)
        if stop[0]:
            break
    return {"runs": done, "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--burn", type=int, default=0, help="CPU-burning processes beside the ranks")
    ap.add_argument("--no-force-fp16", dest="force_fp16", action="store_false")
    ap.add_argument("--minutes", type=float, default=600, help="stop after the run that ends past this time")
    args = ap.parse_args()

    from tests.support.spawn import run_distributed
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.burn)]
    for p in burners:
        p.start()
    start = time.perf_counter()
    try:
        out = run_distributed(stress_worker, args.world_size, args.runs, args.minutes, args.force_fp16,
                              timeout=60 * args.minutes + 900, env={"OMP_NUM_THREADS": "1"})[0]
    finally:
        stop.set()
        for p in burners:
            p.join(5)
    seconds = time.perf_counter() - start
    print(json.dumps({"runs": out["runs"], "world_size": args.world_size, "burn": args.burn,
                      "failures": out["failures"], "seconds": round(seconds, 1),
                      "seconds_per_run": round(seconds / max(out["runs"], 1), 2)}), flush=True)
    return 1 if out["failures"] else 0

if __name__ == "__main__":
    sys.exit(main())
