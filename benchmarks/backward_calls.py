"""Python calls in one backward (or forward), by optimizer arm: is the host time ds_muon's backward takes over
AdamW's its own work (issue 40)? A CPU diagnostic.

    python benchmarks/backward_calls.py [--arms "adamw:bench.clip=0,ds_muon_overlap:bench.clip=0:bench.pause=true"]
                                        [--layers 16] [--reduce-bucket 100000] [--steps 3] [--phase forward]
                                        [--persistence-threshold 1000]
                                        [--out calls.json]

On one H100, MoE-1.5B's backward took 0.038 s more host time in ds_muon's steps with the overlapped Muon step
paused than in AdamW's (docs/benchmarks.md, "Issue 40: the reduce bucket in three rounds"), a share that the
reduce bucket and the overlap do not explain. This script counts what runs in Python on backward's host thread
on the CPU; ds_muon's own additions to a paused backward (``integration/overlap.py: partition_grads``,
``integration/zero3.py``'s hook wrappers) take the same path on any device, DeepSpeed's device-specific paths are
the same for every arm. Each arm in a fresh single-rank process (gloo on the CPU, ZeRO-3, fp32, arms as
``benchmarks/step_time.py`` builds them, :func:`step_time.ds_config`), the ``moe-1.5b`` preset's structure
(``--layers`` layers, 8 experts of which 2 per token; 2 key-value heads where the preset has 16, which changes no
hook) at d=64 and a 256-token vocab, and ``zero_optimization.reduce_bucket_size`` set to ``--reduce-bucket``
elements in every arm (1.4e6 parameters in 17 reduce buckets at the defaults, as MoE-1.5B's 1.5e9 make about 15
with ds_muon's 1e8). After two warm-up steps, ``cProfile``
records each of ``--steps`` backwards (``engine.backward``; with ``--phase forward`` the forwards, ``engine(...)``,
instead): the Python function calls per phase (the same in every step: the script checks it) and the phase's
seconds on the CPU (median; kernels included, so only a rough guide). A ``builtin_muon`` arm runs DeepSpeed's own
Muon where ds_muon is installed (its worker starts with ``DS_MUON=0``; every worker checks its engine's optimizer:
``step_time.check_engine_optimizer``), and ``bench.split_groups=true`` builds an adamw arm with the Muon engines'
two parameter groups (``step_time.model_parameters``). The extra arm option ``bench.pause=true`` runs every step of
a ds_muon arm inside ``OverlapHooks.overlap_paused`` (as ``bench.alternate_overlap`` pauses every second step on the
GPU).

Prints a table (arm, reduce bucket, calls per backward, calls over the first arm, backward seconds) and, for
every other arm, the functions whose call count differs from the first arm's and the engine settings the forward
reads that differ from its (:func:`engine_settings`: the resolved ZeRO config, the parameter coordinator's limits,
the persistent parameters, hook counts, the parameters' attributes). Measured on this repository's
2-core CPU machine: docs/benchmarks.md, "Issue 40: the reduce bucket in three rounds" (the paused ds_muon
backward makes 1.5% more Python calls than AdamW's: one error-naming wrapper per gradient hook and one
``partition_grads`` override per reduce bucket); section "The defaults beside AdamW and the built-in" (the forward
makes 162,433 calls in AdamW's, the built-in's and ds_muon's arm alike; the built-in's backward 2.5% fewer than
AdamW's). **Target** (for the hypothesis it tests): ds_muon's calls over
AdamW's under 5% with the overlap paused; if so, the GPU's 0.038 s is not ds_muon's Python work. Counts, not
times: a call's cost is not measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)  # tests.support
from step_time import bench_options, build_engine, ds_config, parse_arm, worker_env  # noqa: E402

DEFAULT_ARMS = ("adamw:bench.clip=0,ds_muon_nooverlap:bench.clip=0,ds_muon_overlap:bench.clip=0:bench.pause=true,"
                "ds_muon_overlap:bench.clip=0")
WARMUP = 2
VOCAB = 256
SEQ = 32


def _model(layers: int):
    """The ``moe-1.5b`` preset's structure, small: ``layers`` layers, d=64, 8 experts (top 2) of hidden 48."""
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from model import CausalLM, ModelConfig
    return CausalLM(ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                                max_seq_len=SEQ, n_experts=8, top_k=2, expert_hidden=48))


def worker(arm: str, layers: int, bucket: int, steps: int, out: str, phase: str = "backward",
           persistence: int | None = None) -> None:
    """One arm in this process (rank 0 of 1): writes ``{"arm", "phase", "reduce_bucket_size", "calls": [per step],
    "seconds": [per step], "functions": {"file:line name": calls of the last profiled phase}}`` to ``out``; the
    profiled phase is ``phase``, ``"backward"`` (``engine.backward``) or ``"forward"`` (``engine(...)``)."""
    import cProfile
    import pstats

    import deepspeed
    import torch
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = _model(layers)
    cfg = ds_config(arm, 2, 3)
    cfg["bf16"] = {"enabled": False}
    cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    if persistence is not None:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    options = bench_options(arm)
    engine = build_engine(parse_arm(arm)[0], model, cfg, options)
    if options.get("pause") and not getattr(engine.optimizer, "overlap_running", False):
        raise SystemExit(f"{arm}: bench.pause needs the overlapped Muon step running (ds_muon_overlap)")
    g = torch.Generator().manual_seed(0)
    calls, seconds, functions = [], [], {}
    for i in range(WARMUP + steps):
        x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        with engine.optimizer.overlap_paused() if options.get("pause") else contextlib.nullcontext():
            prof = cProfile.Profile() if i >= WARMUP else None
            with _profiled(prof if phase == "forward" else None) as t_forward:
                loss = engine(x[:, :-1], x[:, 1:])
            with _profiled(prof if phase == "backward" else None) as t_backward:
                engine.backward(loss)
            dt = (t_forward if phase == "forward" else t_backward)[0]
            engine.step()
        if prof:
            stats = pstats.Stats(prof).stats
            calls.append(sum(v[1] for v in stats.values()))
            seconds.append(dt)
            functions = {}
            for (f, line, name), v in stats.items():  # two files of one basename, line and name add up
                key = f"{os.path.basename(f)}:{line} {name}"
                functions[key] = functions.get(key, 0) + v[1]
    with open(out, "w") as f:
        json.dump({"arm": arm, "phase": phase, "reduce_bucket_size": int(engine.zero_reduce_bucket_size()),
                   "param_groups": len(engine.optimizer.param_groups), "settings": engine_settings(engine, model),
                   "calls": calls, "seconds": seconds, "functions": functions}, f)


def engine_settings(engine, model) -> dict:
    """What the forward of a ZeRO-3 engine reads besides the model, as text, for comparing arms: the resolved
    ``zero_optimization`` config (``zero.<key>``), the ZeRO-3 parameter coordinator's prefetch and fetch limits
    (``coordinator.<name>``: elements, or a count of fetch events), which parameters are persistent
    (``persistent``: not gathered per forward; with DeepSpeed's default threshold every parameter of this script's
    d=64 model is, see ``--persistence-threshold``), the modules' forward and backward hook counts
    (``module_hooks``), and the attribute names that any parameter carries (``param_attrs``: the union over the
    parameters, names only: the engines' tags)."""
    out = {f"zero.{k}": str(v) for k, v in engine._config.zero_config.model_dump().items()}
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is not None:
        coord = offload.get_param_coordinator()
        for name in sorted(vars(coord)):
            short = name.rsplit("__", 1)[-1]
            if short.startswith(("prefetch", "max_", "reuse")):
                out[f"coordinator.{short}"] = str(getattr(coord, name))
    out["persistent"] = ",".join(sorted(n for n, p in model.named_parameters() if getattr(p, "ds_persist", False)))
    out["module_hooks"] = str(sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
                                  + len(m._backward_pre_hooks) for m in model.modules()))
    out["param_attrs"] = ",".join(sorted({a for p in model.parameters() for a in vars(p)}))
    return out


def settings_differences(base: dict, other: dict) -> list[tuple[str, str, str]]:
    """``[(setting, base value, other value)]`` of :func:`engine_settings` where two arms differ, by name
    (``param_attrs``: the attribute names one arm's parameters carry and the other's do not)."""
    a, b = base.get("settings", {}), other.get("settings", {})
    rows = []
    for key in sorted(set(a) | set(b)):
        if key == "param_attrs":
            left, right = set(a.get(key, "").split(",")), set(b.get(key, "").split(","))
            if left != right:
                rows.append((key, ",".join(sorted(left - right - {""})), ",".join(sorted(right - left - {""}))))
        elif a.get(key) != b.get(key):
            rows.append((key, a.get(key, "-"), b.get(key, "-")))
    return rows


@contextlib.contextmanager
def _profiled(prof):
    """Time the ``with`` body (seconds, into the yielded one-element list on exit) under ``prof`` (a
    ``cProfile.Profile``) when given; None: time only."""
    import time
    took = [0.0]
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    try:
        yield took
    finally:
        if prof is not None:
            prof.disable()
        took[0] = time.perf_counter() - t0


def run_arm(arm: str, layers: int, bucket: int, steps: int, timeout: float = 600, phase: str = "backward",
            persistence: int | None = None) -> dict:
    """:func:`worker` for ``arm`` in a fresh process; its result. Afterwards the DeepSpeed shared-memory segment
    of the worker's rendezvous port is removed (DeepSpeed 0.19.8's CPU all-reduce never unlinks it: 66 MiB of RAM).
    Raises RuntimeError (with the worker's output's tail) if it fails, ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds."""
    from ds_muon.integration.shm_segments import remove_leaked_segments
    from tests.support.spawn import free_port  # a port no leftover shared-memory segment is named after
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "arm.json")
        env = dict(worker_env(parse_arm(arm)[0]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--layers", str(layers),
               "--reduce-bucket", str(bucket), "--steps", str(steps), "--phase", phase, "--worker-out", out]
        if persistence is not None:
            cmd += ["--persistence-threshold", str(persistence)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        finally:
            remove_leaked_segments(port, min_age_s=0)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"arm {arm!r} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        with open(out) as f:
            return json.load(f)


def call_differences(base: dict, other: dict) -> list[tuple[str, int, int]]:
    """``[(function, base calls, other calls)]`` where the counts differ, largest difference first (functions
    keyed by file, line and name; built-ins by name only, as their addresses differ between processes)."""
    def norm(functions):
        out: dict = {}
        for key, n in functions.items():
            key = key.split(" at 0x")[0]
            out[key] = out.get(key, 0) + n
        return out
    a, b = norm(base["functions"]), norm(other["functions"])
    rows = [(k, a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), r[0]))


def print_report(results: list[dict], top: int = 15) -> None:
    """The table and each arm's differing functions against the first arm."""
    base = results[0]
    phase = base["phase"]
    print(f"| arm | reduce bucket | Python calls per {phase} | over the first arm | {phase} s (CPU, median) |")
    print("|---|---|---|---|---|")
    for r in results:
        n = r["calls"][0]
        print(f"| {r['arm']} | {r['reduce_bucket_size']:.0e} | {n} | {n - base['calls'][0]:+d} "
              f"({(n / base['calls'][0] - 1) * 100:+.1f}%) | {statistics.median(r['seconds']):.3f} |")
    for r in results[1:]:
        print(f"\n{r['arm']}: functions called a different number of times than in {base['arm']} (per {phase})")
        for name, a, b in call_differences(base, r)[:top]:
            print(f"  {b - a:+6d}  {name}  ({a} -> {b})")
        differ = settings_differences(base, r)
        print(f"{r['arm']}: engine settings that differ from {base['arm']}'s (param_attrs: only in the first, only "
              "in this arm)" if differ else f"{r['arm']}: engine settings as {base['arm']}'s")
        for name, a, b in differ:
            print(f"  {name}: {a} -> {b}")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="step_time.py arms, comma-separated; the first is the base")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reduce-bucket", type=int, default=100_000, help="ZeRO reduce bucket, elements, every arm")
    ap.add_argument("--persistence-threshold", type=int, default=None,
                    help="ZeRO-3 stage3_param_persistence_threshold, elements, every arm (default DeepSpeed's 1e5, "
                         "which at d=64 keeps every parameter persistent: no gather in the forward; 1000 gathers "
                         "the matrices, experts and embedding as at full size and keeps the norms and routers)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per arm (after 2 warm-up steps)")
    ap.add_argument("--phase", choices=("backward", "forward"), default="backward",
                    help="the phase of each step that cProfile records")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.arm, args.layers, args.reduce_bucket, args.steps, args.worker_out, args.phase,
               args.persistence_threshold)
        return []
    results = [run_arm(a.strip(), args.layers, args.reduce_bucket, args.steps, phase=args.phase,
                       persistence=args.persistence_threshold)
               for a in args.arms.split(",") if a.strip()]
    for r in results:
        if len(set(r["calls"])) != 1:
            raise SystemExit(f"{r['arm']}: the calls per {args.phase} changed between steps {r['calls']}: raise "
                             "--steps or the warm-up")
    print_report(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
