"""Why is fwd+bwd slower under ds_muon than under AdamW with the same kernels (issue 40, item 1)? A diagnostic.

    python benchmarks/host_overhead.py [--model tiny] [--arms adamw,ds_muon,adam_mini,ds_muon_eager] [--rounds 3]

One fresh single-rank process per arm, arms interleaved in rounds (``A B C A B C ...``). Each worker builds the
engine exactly as ``benchmarks/step_time.py`` does (same configs: :func:`step_time.ds_config`), and reports:

- ``fwd+bwd`` seconds per step (median of the timed steps; wall clock with a device sync around the phase);
- an **op probe** at six points of the process's life (``start`` after CUDA/dist init, ``init`` after
  ``initialize``, ``fwdbwd1`` after the first fwd+bwd, ``step1`` after the first optimizer step, ``warm`` after the
  warm-up steps, ``end`` after the timed steps): host microseconds per call of small ops (``mul``, ``mm`` of
  64 x 64, ``copy_``, ``add_``; each timed over 200 calls without a sync, median of 7 repetitions). A slowdown of
  every aten op that is global to the process (a thread competing for the core or the driver lock, a mode or
  callback left active) shows here at the point where it starts, without the model;
- the process's **threads** and the CPU seconds each spent during the timed fwd+bwd (``/proc/self/task``);
- **facts** that could make ops slower: torch/OMP thread counts, CPU affinity, function/dispatch modes, the
  thread-local dispatch key sets, anomaly mode, sync-debug mode, profiler, ``sys.getprofile``/``gettrace``,
  dynamo's eval-frame callback, gc counts, allocator statistics, deterministic mode, the engine's ZeRO config.

The summary prints the fwd+bwd ratio of every arm to AdamW, the op probe per arm and point, the threads that ran
during fwd+bwd, and every fact that differs between arms. Arms are those of ``step_time.py``
(``name:key=value``), plus diagnostic ``bench.*`` options: ``bench.import_ds_muon=true`` (AdamW in a process that
imported ds_muon), ``bench.compile_probe=true`` (also run ds_muon's compiled kernels once on the device before
``initialize``, :func:`compile_probe`: does torch.compile's use slow later ops?), ``bench.dynamo_reset=true``
(``torch._dynamo.reset()`` after the warm-up: does dropping dynamo's state remove the slowdown?),
``bench.gc_freeze=true`` (``gc.collect(); gc.freeze()`` after the warm-up), ``bench.malloc_trim=true`` (glibc's
``malloc_trim(0)`` after the warm-up: is it the C heap left fragmented by the compiles?).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from step_time import bench_options, ds_config, parse_arm  # noqa: E402

PROBE_POINTS = ("start", "init", "fwdbwd1", "step1", "warm", "end")
PROBE_OPS = ("mul", "mm", "copy_", "add_")


def op_probe(device, calls: int = 200, reps: int = 7) -> dict:
    """Host microseconds per call of small torch ops on ``device`` (``{op: us}``): ``calls`` calls timed without a
    device sync in between (the host's launch cost, not the kernel's), median of ``reps`` repetitions."""
    import torch
    x = torch.randn(64, 64, device=device)
    y = torch.randn(64, 64, device=device)
    out = torch.empty_like(x)
    fns = {"mul": lambda: torch.mul(x, 2.0), "mm": lambda: torch.mm(x, y), "copy_": lambda: out.copy_(y),
           "add_": lambda: out.add_(y)}
    result = {}
    for name in PROBE_OPS:
        fn, times = fns[name], []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
            _sync(device)
        result[name] = statistics.median(times) * 1e6
    return result


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def thread_times() -> dict:
    """``{tid: (name, CPU seconds)}`` of this process's threads, from ``/proc/self/task/*/stat`` (utime + stime)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def system_busy_s() -> float:
    """CPU seconds every processor of the machine has been busy (not idle, not iowait) since boot, from
    ``/proc/stat``: its delta over a phase minus this process's shows other processes (e.g. compile workers)
    competing for the cores."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's live child processes (``/proc/self/task/*/children``), e.g. inductor's
    compile workers."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def thread_deltas(before: dict, after: dict) -> dict:
    """CPU seconds per thread name (threads of one name summed, with their count) between two
    :func:`thread_times`: ``{name: [seconds, threads]}``."""
    out: dict = {}
    for tid, (name, cpu) in after.items():
        d = cpu - before.get(tid, (name, 0.0))[1]
        acc = out.setdefault(name, [0.0, 0])
        acc[0] += d
        acc[1] += 1
    return out


def _try(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - a fact this torch does not have
        return f"n/a ({type(err).__name__})"


def facts(engine, device) -> dict:
    """The process state that could make every op slower (module docstring), as JSON-able values."""
    import threading
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    f = {
        "python_threads": sorted(t.name for t in threading.enumerate()),
        "os_threads": sorted(name for name, _ in thread_times().values()),
        "torch.get_num_threads": torch.get_num_threads(),
        "torch.get_num_interop_threads": torch.get_num_interop_threads(),
        "sched_getaffinity": len(os.sched_getaffinity(0)),
        "torch_function_mode": _try(lambda: torch._C._is_torch_function_mode_enabled()),
        "dispatch_mode_stack": [type(m).__name__ for m in _get_current_dispatch_mode_stack()],
        "tls_include": _try(lambda: str(torch._C._dispatch_tls_local_include_set())),
        "tls_exclude": _try(lambda: str(torch._C._dispatch_tls_local_exclude_set())),
        "anomaly": torch.is_anomaly_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "profiler_enabled": _try(lambda: torch.autograd.profiler._is_profiler_enabled),
        "sys.getprofile": repr(sys.getprofile()), "sys.gettrace": repr(sys.gettrace()),
        "dynamo_eval_frame_callback": _try(lambda: repr(torch._C._dynamo.eval_frame.get_eval_frame_callback())),
        "dynamo_imported": "torch._dynamo" in sys.modules, "inductor_imported": "torch._inductor" in sys.modules,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "gc_count": list(gc.get_count()), "gc_frozen": gc.get_freeze_count(),
        "gc_objects": len(gc.get_objects()),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "MKL_", "TORCH", "PYTORCH", "CUDA_",
                                                                     "NCCL_", "GOMP"))},
        "zero_config": _try(lambda: engine._config.zero_config.model_dump(exclude_defaults=True)),
        "zero_class": type(engine.optimizer).__name__,
        "param_groups": _try(lambda: len(engine.optimizer.optimizer.param_groups)),
        "sub_groups": _try(lambda: len(engine.optimizer.fp16_groups)),
        "module_hooks": _try(lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
                                         + len(getattr(m, "_backward_pre_hooks", {}))
                                         for m in engine.module.modules())),
        "param_dispatch_keys": _try(lambda: str(torch._C._dispatch_keys(next(engine.module.parameters())))),
        "shared_libs": _try(lambda: sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps")
                                            if ".so" in line})),
    }
    if torch.device(device).type == "cuda":
        stats = torch.cuda.memory_stats(device)
        f["cuda_sync_debug_mode"] = torch.cuda.get_sync_debug_mode()
        f["cuda_alloc"] = {k: stats.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                                     "segment.all.current", "active.all.current")}
        f["cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return f


def compile_probe(device) -> None:
    """Run ds_muon's compiled kernels once, as its optimizer step does (the compiled momentum step and update
    apply, and Newton-Schulz on two 934M shapes), in a process that otherwise trains without ds_muon."""
    import torch
    from ds_muon.core.muon_update import fused_apply_update_, fused_momentum_update_
    from ds_muon.core.ns_compile import compiled_orthogonalize
    m, g, p = (torch.randn(1 << 20, device=device) for _ in range(3))
    u = fused_momentum_update_(m, g, 0.95, True)
    fused_apply_update_(p, u, 0.02, 0.1)
    ns = compiled_orthogonalize("standard", 5, torch.bfloat16 if torch.device(device).type == "cuda" else None)
    for shape in ((2, 256, 256), (2, 256, 680)):
        ns(torch.randn(*shape, device=device))
    _sync(device)


def malloc_trim() -> int:
    """glibc's ``malloc_trim(0)``: give the C heap's free memory back to the OS (1 if any was released)."""
    import ctypes
    return ctypes.CDLL("libc.so.6").malloc_trim(0)


def worker(args) -> None:
    import torch
    opts = bench_options(args.arm)
    kind, _ = parse_arm(args.arm)
    if opts.get("import_ds_muon"):
        import ds_muon  # noqa: F401
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from model import CausalLM, ModelConfig
    probes = {"start": op_probe(device)}
    if opts.get("compile_probe"):
        compile_probe(device)
    cfg = ds_config(args.arm, args.micro_batch, 3)
    if not cuda:
        cfg.pop("bf16")
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.preset(args.model, max_seq_len=args.seq_len, record_max_logits=False))
    if kind.startswith("ds_muon") or kind == "adam_mini":
        import ds_muon
        engine, *_ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    probes["init"] = op_probe(device)
    vocab = model.cfg.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    fwd_bwd, cpu_s, others_s, children_s, threads = [], [], [], [], {}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            if opts.get("dynamo_reset"):
                torch._dynamo.reset()
            if opts.get("gc_freeze"):
                gc.collect()
                gc.freeze()
            if opts.get("malloc_trim"):
                malloc_trim()
            probes["warm"] = op_probe(device)
        x = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
        _sync(device)
        before, k0, s0 = thread_times(), children_cpu_s(), system_busy_s()
        c0, t0 = time.process_time(), time.perf_counter()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        _sync(device)
        t1, c1 = time.perf_counter(), time.process_time()
        after, k1, s1 = thread_times(), children_cpu_s(), system_busy_s()
        if i == 0:
            probes["fwdbwd1"] = op_probe(device)
        if i >= args.warmup:
            fwd_bwd.append(t1 - t0)
            cpu_s.append(c1 - c0)
            others_s.append((s1 - s0) - (c1 - c0))
            children_s.append(k1 - k0)
            for name, (d, n) in thread_deltas(before, after).items():
                acc = threads.setdefault(name, [0.0, n])
                acc[0] += d
        engine.step()
        _sync(device)
        if i == 0:
            probes["step1"] = op_probe(device)
    probes["end"] = op_probe(device)
    result = {"arm": args.arm, "fwd_bwd_s": fwd_bwd, "process_cpu_s": cpu_s,
              "other_processes_cpu_s": others_s, "children_cpu_s": children_s,
              "children": _try(lambda: sum(len(open(f"/proc/self/task/{t}/children").read().split())
                                           for t in os.listdir("/proc/self/task"))), "probes": probes,
              "threads": {k: [v[0] / args.steps, v[1]] for k, v in threads.items()},
              "facts": facts(engine, device)}
    with open(args.out, "w") as f:
        json.dump(result, f, default=str)
    # every rank done, then the process group torn down while Python is fully alive (docs/troubleshooting.md: a gloo
    # worker thread finishing after interpreter finalization began aborts the process; tests/e2e/test_clean_exit.py)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_arm(args, arm: str) -> dict:
    """One fresh single-rank worker for ``arm``; its result, or ``{"error": ...}``."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--out", out, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch),
           "--seq-len", str(args.seq_len)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    try:
        with open(out) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {"arm": arm, "error": f"rc={proc.returncode}: {proc.stderr[-1500:]}"}
    finally:
        if os.path.exists(out):
            os.remove(out)


def summarize(raw: dict) -> dict:
    """Per arm: the median fwd+bwd over every timed step of every round, the per-round medians, the op probe
    (median over rounds per point and op), thread CPU seconds per fwd+bwd (median over rounds)."""
    out = {}
    for arm, rounds in raw.items():
        ok = [r for r in rounds if "error" not in r]
        if not ok:
            out[arm] = {"error": rounds[-1]["error"] if rounds else "did not run"}
            continue
        steps = [s for r in ok for s in r["fwd_bwd_s"]]
        probes = {p: {op: statistics.median(r["probes"][p][op] for r in ok if p in r["probes"]) for op in PROBE_OPS}
                  for p in PROBE_POINTS if all(p in r["probes"] for r in ok)}
        names = {n for r in ok for n in r["threads"]}
        threads = {n: statistics.median(r["threads"].get(n, [0.0, 0])[0] for r in ok) for n in names}
        out[arm] = {"fwd_bwd_s": statistics.median(steps), "round_medians": [statistics.median(r["fwd_bwd_s"]) for r in ok],
                    "process_cpu_s": statistics.median(c for r in ok for c in r["process_cpu_s"]),
                    "other_processes_cpu_s": statistics.median(c for r in ok for c in r["other_processes_cpu_s"]),
                    "children_cpu_s": statistics.median(c for r in ok for c in r["children_cpu_s"]),
                    "children": ok[0]["children"],
                    "probes": probes, "threads": threads, "facts": ok[0]["facts"], "rounds_ok": len(ok)}
    return out


def print_summary(summary: dict) -> None:
    ok = {k: v for k, v in summary.items() if "error" not in v}
    base = next((v for k, v in ok.items() if parse_arm(k)[0] == "adamw" and not bench_options(k)), None)
    print("\n| arm | fwd+bwd s (per-round medians) | / AdamW | CPU s per fwd+bwd: this process / its child "
          "processes (count) / all other processes |")
    print("|---|---|---|---|")
    for k, v in ok.items():
        ratio = f"{v['fwd_bwd_s'] / base['fwd_bwd_s']:.3f}x" if base else ""
        rounds = ", ".join(f"{m:.4f}" for m in v["round_medians"])
        print(f"| {k} | {v['fwd_bwd_s']:.4f} ({rounds}) | {ratio} | {v['process_cpu_s']:.4f} / "
              f"{v['children_cpu_s']:.4f} ({v['children']}) / {v['other_processes_cpu_s']:.4f} |")
    for k, v in summary.items():
        if "error" in v:
            print(f"| {k} | failed: {v['error'][-300:]!r} | | |")
    print("\nop probe, host us per call (mul / mm / copy_ / add_), median over rounds:")
    print("| arm | " + " | ".join(PROBE_POINTS) + " |")
    print("|---|" + "---|" * len(PROBE_POINTS))
    for k, v in ok.items():
        cells = [" / ".join(f"{v['probes'][p][op]:.1f}" for op in PROBE_OPS) if p in v["probes"] else ""
                 for p in PROBE_POINTS]
        print(f"| {k} | " + " | ".join(cells) + " |")
    print("\nthreads' CPU s per timed fwd+bwd (median over rounds; threads of one name summed; > 0.5 ms shown):")
    for k, v in ok.items():
        busy = {n: s for n, s in sorted(v["threads"].items(), key=lambda kv: -kv[1]) if s > 5e-4}
        print(f"  {k}: " + ", ".join(f"{n} {s:.4f}" for n, s in busy.items()))
    print("\nfacts that differ between arms:")
    keys = sorted({key for v in ok.values() for key in v["facts"]})
    for key in keys:
        values = {k: json.dumps(v["facts"].get(key), default=str, sort_keys=True) for k, v in ok.items()}
        if len(set(values.values())) > 1:
            print(f"  {key}:")
            for k, val in values.items():
                print(f"    {k}: {val[:600]}")
    same = [key for key in keys if len({json.dumps(v["facts"].get(key), default=str, sort_keys=True)
                                        for v in ok.values()}) == 1]
    print("facts equal in every arm: " + ", ".join(same))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arms", default="adamw,ds_muon,adam_mini,ds_muon_eager",
                    help="comma-separated arms (step_time.py's, with optional bench.* options of this script)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per worker")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new worker after this many seconds; the summary covers what ran (0: no limit)")
    ap.add_argument("--out", help="write every round's raw results and the summary here (JSON)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    raw: dict = {arm: [] for arm in arms}
    start = time.monotonic()
    for rnd in range(args.rounds):
        for arm in arms:
            if args.budget_s and time.monotonic() - start > args.budget_s:
                print(f"--budget-s {args.budget_s} spent: round {rnd + 1} {arm} and later not run")
                return print_summary(summarize(raw))
            r = run_arm(args, arm)
            raw[arm].append(r)
            status = r["error"][-200:] if "error" in r else f"fwd+bwd {statistics.median(r['fwd_bwd_s']):.4f} s"
            print(f"round {rnd + 1}/{args.rounds} {arm}: {status}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"raw": raw, "summary": summarize(raw)}, f, default=str)
    print_summary(summarize(raw))


if __name__ == "__main__":
    main()
