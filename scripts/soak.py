"""Soak: the main job killed and restarted every ``--segment`` steps, alternating W=2 and W=1.

    python scripts/soak.py --steps 2000 --segment 500       # the full soak (CPU, 2 cores)
    python scripts/soak.py --steps 24 --segment 8 --train-args="--max-bytes 200000 --seq-len 64"   # CI's version

Runs the main job, ``examples/train.py`` (tiny model, ``examples/ds_config_cpu.json``, ZeRO-3 + ds_muon,
``--data-streams 2``: the same global batch and samples at W=2 and W=1), twice:

* **uninterrupted**, at W=2;
* **in segments**: segment k runs at W = ``worlds[k % len(worlds)]`` (2, 1, 2, 1, ...) with
  ``--save-every SEGMENT --resume``. As soon as the checkpoint of step (k+1)·SEGMENT is complete (``latest``
  names it) and the job has trained on past it, every rank is killed with SIGKILL in the middle of training,
  and the next segment resumes from ``latest`` (redoing the steps after the save): at another W through train.py's automatic universal conversion
  (``ds_muon.checkpoint.convert_to_universal``). The last segment runs to the end and exits normally.

The ranks are started by this script itself (``RANK``/``WORLD_SIZE``/``MASTER_*`` as torchrun sets them, one
process group each, ``OMP_NUM_THREADS=1``), so that each can be killed. Each runs train.py through
``tests/support/exit_after.py`` (no interpreter finalization once train.py returned: torch's intermittent gloo
abort there, docs/troubleshooting.md, is not what a soak measures). Checks:

* every step 1..steps has a training loss, and every segment but the last was killed (not exited) after its save;
* before the first resume, each step's loss equals the uninterrupted run's exactly (the same processes'
  arithmetic): ``first_segment_worst_rel_diff`` is 0;
* after it, the loss curves agree as curves: the mean loss of each window of ``--window`` steps within
  ``--window-rtol``. Single steps are not held to a rounding-level tolerance past the first resume, on purpose:
  a resume at another W reorders fp32 reductions, and even a same-W resume changes DeepSpeed's CPU Adam bias
  correction by one ulp (it recomputes ``beta^t`` with ``pow`` after a restart, docs/checkpointing.md);
  training amplifies any such 1-ulp difference into per-step differences of several percent;
* memory does not grow from step to step: within each segment, after its first ``--warmup`` steps, the largest
  rank's resident memory (``rss_mib``) and peak resident memory (``peak_rss_mib``, ``ru_maxrss``), as
  ``train.py --metrics`` logs them every step, grow by at most ``--rss-growth-mib``.

Prints one JSON line (the measured figures) and exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # for tests/support/spawn.py: the repository's one free-port helper
from tests.support.exit_after import PATH as EXIT_AFTER  # noqa: E402
from tests.support.spawn import free_port  # noqa: E402
TRAIN = os.path.join(ROOT, "examples", "train.py")
STREAMS = 2  # --data-streams of every run: W=2 and W=1 draw the same global batch



def launch(world: int, args: list[str], log_path: str) -> list[subprocess.Popen]:
    """Start ``world`` ranks of ``examples/train.py args`` on this machine, each in its own process group."""
    port, procs = free_port(), []
    log = open(log_path, "ab")
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, EXIT_AFTER, TRAIN, *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    log.close()
    return procs


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def run(world: int, args: list[str], log_path: str, timeout: float, kill_when=None) -> str:
    """Run the ranks until they exit (``"exited"``) or, with ``kill_when``, until ``kill_when()`` is true, then
    SIGKILL every rank (``"killed"``). Raises RuntimeError (with the log's tail) on a failed rank or a timeout."""
    procs = launch(world, args, log_path)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if kill_when is not None and kill_when():
                _kill(procs)
                return "killed"
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                _kill(procs)
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-4000:]
                why = "timed out" if all(c in (None, 0) for c in codes) else f"exit codes {codes}"
                raise RuntimeError(f"examples/train.py at W={world} {why}: {shlex.join(args)}\n{tail}")
            if all(c == 0 for c in codes):
                return "exited"
            time.sleep(0.2)
    finally:
        _kill(procs)


def read_metrics(path: str, start_line: int = 0) -> tuple[dict[int, dict], int, int]:
    """Per-step records of a ``--metrics`` file from line ``start_line`` on (a later line for a step wins: a resumed
    segment repeats the steps a killed one ran past its save); also the file's line count and the lines that
    are not JSON (a line cut by the kill)."""
    steps, bad, n = {}, 0, 0
    if os.path.exists(path):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if n <= start_line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    bad += 1
                    continue
                if "loss" in rec:
                    steps[rec["step"]] = rec
    return steps, n, bad


def _growth(records: list[dict], key: str, warmup: int) -> float:
    values = [r[key] for r in records[warmup:]]
    return max(values) - values[0] if len(values) >= 2 else 0.0


def soak(steps: int, seg: int, work: str, worlds: tuple[int, ...] = (2, 1), window: int = 100, warmup: int = 10,
         extra: tuple[str, ...] = ()) -> dict:
    """The soak described above, in ``work``; returns the measured figures (see :func:`main` for the checks)."""
    common = ["--steps", str(steps), "--eval-every", "0", "--eval-batches", "1", "--data-streams", str(STREAMS),
              *extra]
    per_step_s = 2.0  # generous: a shared 2-core machine runs the tiny model at ~0.3 s per step
    ref_metrics = os.path.join(work, "uninterrupted.jsonl")
    run(2, [*common, "--save-dir", "", "--metrics", ref_metrics], os.path.join(work, "uninterrupted.log"),
        timeout=120 + per_step_s * steps)
    ref, _, _ = read_metrics(ref_metrics)

    ckpt, metrics = os.path.join(work, "checkpoints"), os.path.join(work, "segments.jsonl")
    os.makedirs(ckpt, exist_ok=True)
    outcomes, rss_growth, peak_growth, cut_lines, line = [], [], [], 0, 0
    for k, begin in enumerate(range(0, steps, seg)):
        end, world = min(steps, begin + seg), worlds[k % len(worlds)]
        latest = os.path.join(ckpt, "latest")

        def saved(latest: str = latest, end: int = end, line: int = line) -> bool:
            """train.py has written a checkpoint of step >= `end` and trained on past it (kill mid-training);
            a later checkpoint than `end` (a poll that missed the moment) is fine: the next segment resumes
            from whatever `latest` names."""
            if not os.path.exists(latest):
                return False
            with open(latest) as f:
                tag = f.read().strip()
            step = int(tag.removeprefix("global_step")) if tag.removeprefix("global_step").isdigit() else 0
            return step >= end and step + 1 in read_metrics(metrics, line)[0]

        args = [*common, "--save-dir", ckpt, "--save-every", str(seg), "--metrics", metrics,
                *(["--resume", ckpt] if k else [])]
        outcomes.append(run(world, args, os.path.join(work, f"segment{k}-w{world}.log"),
                            timeout=120 + per_step_s * seg * (2 if world == 1 else 1),
                            kill_when=saved if end < steps else None))
        records, n_lines, bad = read_metrics(metrics, line)
        line, cut_lines = n_lines, cut_lines + bad
        own = [records[s] for s in sorted(records) if begin < s <= end]  # this segment's steps, before the kill
        rss_growth.append(_growth(own, "rss_mib", warmup))
        peak_growth.append(_growth(own, "peak_rss_mib", warmup))
    got, _, _ = read_metrics(metrics)

    missing = [s for s in range(1, steps + 1) if s not in got or s not in ref]
    if missing:
        raise RuntimeError(f"steps without a training loss: {missing[:10]}{'...' if len(missing) > 10 else ''}")
    a = [got[s]["loss"] for s in range(1, steps + 1)]
    b = [ref[s]["loss"] for s in range(1, steps + 1)]
    diffs = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    window = min(window, steps)
    windows = [abs(sum(a[i:i + window]) - sum(b[i:i + window])) / abs(sum(b[i:i + window]))
               for i in range(0, steps - window + 1, window)]
    worst = max(diffs)
    return {"steps": steps, "segment": seg, "worlds": [worlds[k % len(worlds)] for k in range(len(outcomes))],
            "outcomes": outcomes, "cut_metric_lines": cut_lines,
            "first_segment_worst_rel_diff": max(diffs[:seg]), "worst_loss_rel_diff": worst,
            "worst_step": diffs.index(worst) + 1, "window": window, "window_mean_rel_diffs": windows,
            "worst_window_mean_rel_diff": max(windows, default=0.0),
            "rel_diff_at_segment_ends": [diffs[min(steps, e) - 1] for e in range(seg, steps + seg, seg)],
            "rss_growth_mib": rss_growth, "peak_rss_growth_mib": peak_growth,
            "max_rss_growth_mib": max(rss_growth + peak_growth), "peak_rss_mib": max(r["peak_rss_mib"] for r in got.values()),
            "first_loss": b[0], "last_loss": b[-1], "last_loss_soak": a[-1], "n_compared": len(diffs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--segment", type=int, default=500, help="steps between a completed save and the kill")
    parser.add_argument("--worlds", default="2,1", help="world sizes of the segments, in turn (1 or 2 each)")
    parser.add_argument("--window", type=int, default=100, help="steps per window of the curve comparison")
    parser.add_argument("--window-rtol", type=float, default=2e-2, help="mean loss per window, relative")
    parser.add_argument("--warmup", type=int, default=10, help="steps of each segment before memory is compared")
    parser.add_argument("--rss-growth-mib", type=float, default=32.0, help="allowed growth within a segment")
    parser.add_argument("--train-args", default="", help="more arguments for examples/train.py (one string)")
    parser.add_argument("--workdir", default=None, help="keep checkpoints, metrics and logs here (default: a "
                                                        "temporary directory, deleted)")
    args = parser.parse_args(argv)
    worlds = tuple(int(w) for w in args.worlds.split(","))
    if any(w not in (1, 2) for w in worlds):
        parser.error("--worlds: each world size must be 1 or 2 (--data-streams 2)")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        result = soak(args.steps, args.segment, work, worlds, args.window, args.warmup,
                      tuple(shlex.split(args.train_args)))
    result["ok"] = (result["first_segment_worst_rel_diff"] == 0.0
                    and result["worst_window_mean_rel_diff"] <= args.window_rtol
                    and result["max_rss_growth_mib"] <= args.rss_growth_mib
                    and result["n_compared"] == args.steps
                    and result["outcomes"] == ["killed"] * (len(result["outcomes"]) - 1) + ["exited"])
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
