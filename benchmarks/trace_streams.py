"""Where does the overlapped Muon step run? Reads a Chrome trace of ``benchmarks/step_time.py --trace DIR`` (two whole
steps, rank 0) and prints, for the second step's fwd+bwd:

- the busy milliseconds of each CUDA stream in 10 ms bins from the start of forward (the main stream against the
  side stream the speculative Muon work runs on): whether the side stream fills backward's idle GPU time, or the
  main stream idles while the host launches speculative work;
- the side stream's work left after the main stream's last backward kernel (the spill into the step);
- the host milliseconds and calls of every ``ds_muon/...`` record_function range inside fwd+bwd (the speculation's
  launches run on backward's thread);
- the host's milliseconds in forward and in backward (``bench/forward``, where the trace has it), and in each the
  CUDA runtime and driver calls that took the most host time (``cudaEventSynchronize``, ``cudaStreamSynchronize``:
  the host waiting for a stream, such as DeepSpeed's back-pressure on its reduce and all-gather streams;
  ``cudaLaunchKernel``, ``cudaGraphLaunch``: launches), by total milliseconds;
- the GPU's idle milliseconds inside fwd+bwd (from forward's start to the later of the host's fwd+bwd range and
  the main stream's last fwd+bwd kernel; idle: no kernel, copy or memset on any stream, the union of their
  intervals, kernels running across the window's edges counted for their part inside it), and with
  ``--ns-floor-ms`` (``benchmarks/step_time.py``'s ``ns_floor_s`` × 1000, the Muon arm's Newton–Schulz at the
  measured matmul rate) the ratio idle / floor. Read on an AdamW or built-in trace, this estimates how much of
  the Muon step an overlap with that backward could hide: an estimate, not a bound (Newton–Schulz can also run
  beside kernels that leave SMs free, such as NCCL's, and slows the kernels it shares SMs with).

    python benchmarks/trace_streams.py TRACE.json[.gz] [--bin-ms 10] [--ns-floor-ms 54]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


#: the trace categories of work on a CUDA stream
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
#: the trace categories of the host's CUDA API calls
HOST_API = ("cuda_runtime", "cuda_driver")
#: how many API call names :func:`host_calls` lists per phase
TOP_CALLS = 6


def load(path: str) -> list[dict]:
    """The trace's complete events (``ph == "X"``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def busy_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Microseconds of ``[lo, hi]`` covered by the union of ``intervals`` (``(start, end)`` in microseconds, in any
    order, overlapping or not): the time some stream ran a kernel."""
    total, at = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, at), min(end, hi)
        if end > start:
            total += end - start
            at = end
    return total


def report(events: list[dict], bin_ms: float = 10.0, ns_floor_ms: float | None = None) -> str:
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("bench/")),
                   key=lambda e: e["ts"])
    fwd_bwd = [e for e in steps if e["name"] == "bench/forward_backward"][-1]
    t0, t1 = fwd_bwd["ts"], fwd_bwd["ts"] + fwd_bwd["dur"]
    # the step after it: a range ending after fwd+bwd's end (not ``bench/forward``, nested inside it; no epsilon needed)
    after = [e for e in steps if e["ts"] > t0 and e["ts"] + e["dur"] > t1]
    t_end = after[0]["ts"] + after[0]["dur"] if after else t1
    kernels = [e for e in events if e.get("cat") in DEVICE_WORK and t0 <= e["ts"] <= t_end]
    by_stream = collections.defaultdict(list)
    for k in kernels:
        by_stream[k["args"].get("stream")].append(k)
    main = max(by_stream, key=lambda s: sum(1 for k in by_stream[s] if k["ts"] <= t1))
    lines = [f"fwd+bwd host window {(t1 - t0) / 1e3:.1f} ms; streams (kernels): "
             + ", ".join(f"{s}{' (main)' if s == main else ''}: {len(v)}" for s, v in sorted(by_stream.items()))]
    main_end = max(k["ts"] + k["dur"] for k in by_stream[main] if k["ts"] <= t1)
    lines.append(f"main stream's last fwd+bwd kernel ends at {(main_end - t0) / 1e3:.1f} ms")
    hi = max(t1, main_end)
    device = [e for e in events if e.get("cat") in DEVICE_WORK
              and e["ts"] < hi and e["ts"] + e["dur"] > t0]  # also those running across the window's edges
    window = hi - t0
    gpu = busy_us([(k["ts"], k["ts"] + k["dur"]) for k in device], t0, hi)
    main_busy = busy_us([(k["ts"], k["ts"] + k["dur"]) for k in device if k["args"].get("stream") == main], t0, hi)
    idle = window - gpu
    lines.append(f"inside fwd+bwd ({window / 1e3:.1f} ms to the later of the host range and the main stream's "
                 f"last kernel): GPU busy {gpu / 1e3:.1f} ms (main stream {main_busy / 1e3:.1f} ms), idle "
                 f"{idle / 1e3:.1f} ms ({100 * idle / window if window > 0 else 0:.0f}% of the window)")
    if ns_floor_ms:
        lines.append(f"Newton-Schulz floor {ns_floor_ms:.1f} ms: idle / floor = {idle / 1e3 / ns_floor_ms:.2f} "
                     f"(an estimate of the share an overlap could hide: see the module docstring)")
    for s, v in sorted(by_stream.items()):
        if s == main:
            continue
        spill = sum(min(k["dur"], k["ts"] + k["dur"] - main_end) for k in v if k["ts"] + k["dur"] > main_end)
        lines.append(f"stream {s}: first kernel at {(min(k['ts'] for k in v) - t0) / 1e3:.1f} ms, busy "
                     f"{sum(k['dur'] for k in v) / 1e3:.1f} ms, of it {spill / 1e3:.1f} ms after the main stream's end")
    width = bin_ms * 1e3
    bins = {s: collections.Counter() for s in by_stream}
    for s, v in by_stream.items():
        for k in v:
            bins[s][int((k["ts"] - t0) // width)] += k["dur"]
    last = int((max(k["ts"] + k["dur"] for k in kernels) - t0) // width)
    order = [main] + sorted(s for s in by_stream if s != main)
    lines.append(f"busy ms per {bin_ms:g} ms bin from forward's start, streams {' / '.join(map(str, order))}:")
    lines.append(" ".join(f"{b}:" + "/".join(f"{bins[s][b] / 1e3:.1f}" for s in order) for b in range(last + 1)))
    host = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("ds_muon/") and t0 <= e["ts"] <= t1:
            host[e["name"]][0] += 1
            host[e["name"]][1] += e["dur"] / 1e3
    for name, (n, ms) in sorted(host.items()):
        lines.append(f"host {name}: {n} calls, {ms:.1f} ms")
    lines += host_calls(events, t0, t1)
    return "\n".join(lines)


def host_calls(events: list[dict], t0: float, t1: float) -> list[str]:
    """Lines on the host's side of fwd+bwd ``[t0, t1]`` (microseconds): where a ``bench/forward`` range lies inside
    it, forward's host milliseconds (``t0`` to that range's end) and backward's (from there to ``t1``); per phase
    (else for the whole fwd+bwd) the :data:`TOP_CALLS` CUDA API calls (:data:`HOST_API`) with the most host time,
    their milliseconds and count. A call is counted in the phase it starts in, for its time inside that phase (a
    call on another thread, such as NCCL's watchdog, may run across a phase's end)."""
    fwd = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == "bench/forward"
           and t0 <= e["ts"] <= t1]
    phases = [("fwd+bwd", t0, t1)]
    if fwd:
        mid = fwd[-1]["ts"] + fwd[-1]["dur"]
        phases = [("forward", t0, mid), ("backward", mid, t1)]
    lines = []
    if fwd:
        lines.append(f"host: forward {(mid - t0) / 1e3:.1f} ms, backward {(t1 - mid) / 1e3:.1f} ms")
    for phase, lo, hi in phases:
        calls = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            if e.get("cat") in HOST_API and lo <= e["ts"] < hi:
                calls[e["name"]][0] += 1
                calls[e["name"]][1] += (min(e["ts"] + e["dur"], hi) - e["ts"]) / 1e3
        top = sorted(calls.items(), key=lambda kv: -kv[1][1])[:TOP_CALLS]
        if top:
            lines.append(f"host API calls in {phase} (most time first): "
                         + ", ".join(f"{name} {ms:.2f} ms ({n}x)" for name, (n, ms) in top))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--bin-ms", type=float, default=10.0)
    ap.add_argument("--ns-floor-ms", type=float, default=None,
                    help="the Muon arm's Newton-Schulz floor in ms (step_time.py's ns_floor_s x 1000)")
    args = ap.parse_args()
    print(report(load(args.trace), args.bin_ms, args.ns_floor_ms))


if __name__ == "__main__":
    main()
