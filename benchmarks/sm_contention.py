"""Newton–Schulz on a side stream against a backward's matmuls on the main stream: the slowdown, and an SM carveout.

Issue 40 at 2.9B (docs/benchmarks.md): with the overlapped Muon step, backward's own kernels ran 0.10 s longer
(0.493 against 0.392 s of main-stream events, 34% of the gap to AdamW) while they shared the SMs with the
speculative Newton–Schulz on the side stream. CUDA's stream priorities cannot put the side stream below the default
stream (priority 0 is the lowest), so the lever left is how many SMs Newton–Schulz's matmuls may fill: torch's
``torch._C._set_sm_carveout_experimental(k)`` asks cuBLASLt (and torch's CUTLASS kernels) to leave ``k`` SMs free
(``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``; the value is read when a matmul is launched, so setting it only while the
side stream's work is launched limits that work alone, and a CUDA graph captured so keeps it). Whether torch's
batched matmul (``bmm``, what Newton–Schulz runs) honours it, and with which BLAS library, is part of what this
measures: a carveout that changes nothing in the "side alone" column does not reach those kernels.

One GPU, no DeepSpeed. For a model preset of ``examples/model.py``:

- **main**: bf16 matmuls ``(tokens, d_model) @ (d_model, ffn_hidden)`` back to back on the current
  stream (``tokens`` = micro-batch 4 × ``max_seq_len``, the shapes of a backward's largest GEMMs);
- **side**: ds_muon's compiled Newton–Schulz (``compiled_orthogonalize``, bf16, 5 steps, quintic) of ``--layers``
  layers' Muon matrices as ds_muon selects them (each shape a batch: q/k/v/o, gate/up, down; :func:`matrix_shapes`)
  on a side stream.

Arms, interleaved in ``--rounds`` rounds (medians reported): main alone; side alone (with each carveout); both at
once (the side work launched first, as the speculation's bucket is, then the main matmuls), with no carveout and
with each ``--carveouts`` value, each once with torch's BLAS as configured and once with cuBLASLt preferred
(``torch.backends.cuda.preferred_blas_library``) while the side work is launched. Columns: main and side time
(CUDA events on their streams, each from its first launch), the makespan (from the earlier first launch to the
later end), main's slowdown (× main alone), and the share of the side work hidden
(``(main alone + side alone - makespan) / side alone``: 1 = all of Newton–Schulz hidden, 0 = none).

**Target** (the decision this run makes): an SM carveout is worth a config option where, at some ``k``, main's
slowdown is at most half of the no-carveout arm's excess (e.g. 1.20× -> ≤ 1.10×) while the pair takes no longer
(makespan ≤ the no-carveout arm's). The cuBLASLt arms are held to the same baseline (torch's BLAS, no carveout):
an option would set both. Otherwise the 34% stays as it is and the closing note says so with this run's numbers.

By default (``--main-iters 0``) the number of main matmuls is set in the last warm-up round so that main alone
takes about as long as the side work alone (the run prints the ratio): with a fixed count the main work could lie
wholly inside the side work, which caps the share hidden and biases the comparison.

    python benchmarks/sm_contention.py --model 2.9b --rounds 3 [--carveouts 0,16,32,48,66] [--out results.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def matrix_shapes(model) -> list[tuple[int, int, int]]:
    """The blocks ds_muon orthogonalizes in ``model`` as ``(batch, rows, cols)``, one entry per block shape in
    first-seen order: the Muon parameters of :func:`ds_muon.model.selection.select_muon_params` (default rules), each
    cut by its matrix view (``Selection.view``: a stacked parameter is one block per matrix, a fused gate/up
    projection two). ``model`` may live on the meta device (no memory). For a dense layer: q/o ``(d, d)``, k/v
    ``(kv_heads * head_dim, d)``, gate/up ``(ffn, d)``, down ``(d, ffn)``."""
    from ds_muon.model.selection import select_muon_params
    selection = select_muon_params(model)
    counts: dict[tuple[int, int], int] = {}
    for name, used in selection.use_muon.items():
        if used:
            for group in selection.view(name).groups:
                counts[group.rows, group.cols] = counts.get((group.rows, group.cols), 0) + group.count
    return [(n, rows, cols) for (rows, cols), n in counts.items()]


def preset_matrix_shapes(causal_lm, cfg, layers: int) -> list[tuple[int, int, int]]:
    """:func:`matrix_shapes` of ``layers`` layers of ``causal_lm(cfg)`` (``examples/model.py``'s ``CausalLM`` and a
    ``ModelConfig`` preset), built on the meta device."""
    import dataclasses

    import torch
    with torch.device("meta"):
        return matrix_shapes(causal_lm(dataclasses.replace(cfg, n_layers=layers)))


def arm_names(carveouts: list[int]) -> list[str]:
    """Every arm of a round, in launch order: ``main``, ``side`` and ``side/kK``, ``both`` and ``both/kK``, and the
    cuBLASLt variants ``.../lt``."""
    names = ["main", "side", "both"]
    for k in carveouts:
        names += [f"side/k{k}", f"both/k{k}", f"side/k{k}/lt", f"both/k{k}/lt"]
    return names


def summarize(rounds: list[dict[str, dict[str, float]]]) -> list[dict]:
    """Per arm, the medians over rounds of ``main_ms``, ``side_ms``, ``makespan_ms`` (those it has), main's slowdown
    against ``main`` alone, and the share of the side work hidden against ``main`` + the matching side-alone arm
    (``both/kK/lt`` against ``side/kK/lt``; ``both`` against ``side``).

    Args:
        rounds: one ``{arm: {"main_ms": .., "side_ms": .., "makespan_ms": ..}}`` per round (milliseconds).

    Raises:
        KeyError: a round without the ``main`` or ``side`` arm.
    """
    arms = list(rounds[0])
    med = {a: {key: statistics.median(r[a][key] for r in rounds) for key in rounds[0][a]} for a in arms}
    main_alone = med["main"]["main_ms"]
    rows = []
    for a in arms:
        row = {"arm": a, **med[a]}
        if a.startswith("both"):
            side_alone = med["side" + a[len("both"):]]["side_ms"]
            row["main_slowdown"] = med[a]["main_ms"] / main_alone
            row["hidden_share"] = (main_alone + side_alone - med[a]["makespan_ms"]) / side_alone
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows of :func:`summarize` as a fixed-width table (milliseconds; ratios with 2 decimals)."""
    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else format("-", ">" + fmt.split(".")[0])
    lines = [f"{'arm':<14} {'main ms':>9} {'side ms':>9} {'makespan':>9} {'main x':>7} {'hidden':>7}"]
    for r in rows:
        lines.append(f"{r['arm']:<14} {cell(r, 'main_ms', '9.2f')} {cell(r, 'side_ms', '9.2f')} "
                     f"{cell(r, 'makespan_ms', '9.2f')} {cell(r, 'main_slowdown', '7.2f')} "
                     f"{cell(r, 'hidden_share', '7.2f')}")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    """The target's decision in one line: the carveout arms that halve main's excess slowdown of the no-carveout
    ``both`` arm without a longer makespan, the best (least slowdown) of them; else the least slowed arm and why it
    misses."""
    base = next(r for r in rows if r["arm"] == "both")
    tried = [r for r in rows if r["arm"].startswith("both/")]
    if not tried:
        return "no carveout arm ran"

    def halved(r: dict) -> bool:
        return r["main_slowdown"] - 1 <= (base["main_slowdown"] - 1) / 2 + 1e-9  # 1e-9: float rounding

    def no_longer(r: dict) -> bool:
        return r["makespan_ms"] <= base["makespan_ms"] * (1 + 1e-9)

    meeting = [r for r in tried if halved(r) and no_longer(r)]
    best = min(meeting or tried, key=lambda r: r["main_slowdown"])
    return (f"{'best meeting the target' if meeting else 'least slowed'} {best['arm']}: main "
            f"{best['main_slowdown']:.2f}x (no carveout {base['main_slowdown']:.2f}x), makespan "
            f"{best['makespan_ms']:.2f} ms (no carveout {base['makespan_ms']:.2f}), hidden {best['hidden_share']:.2f} "
            f"(no carveout {base['hidden_share']:.2f}): target {'met' if meeting else 'not met'}")


@contextlib.contextmanager
def side_settings(torch, carveout: Optional[int], cublaslt: bool):
    """While the side work is launched: torch's SM carveout ``carveout`` (None: none) and, with ``cublaslt``, cuBLASLt
    as torch's preferred BLAS library; both restored after."""
    old_k = torch._C._get_sm_carveout_experimental()
    old_lib = torch.backends.cuda.preferred_blas_library()
    try:
        torch._C._set_sm_carveout_experimental(carveout)
        if cublaslt:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        torch._C._set_sm_carveout_experimental(old_k)
        torch.backends.cuda.preferred_blas_library(old_lib)


def run_arm(torch, arm: str, main_work: Callable[[], None], side_work: Callable[[], None], side_stream) -> dict:
    """One arm once: its streams' times in milliseconds (CUDA events), the device synchronized before and after."""
    parts = arm.split("/")
    carveout = int(parts[1][1:]) if len(parts) > 1 else None
    lt = parts[-1] == "lt"
    ev = {name: torch.cuda.Event(enable_timing=True)
          for name in ("start", "main_start", "main_end", "side_start", "side_end")}
    torch.cuda.synchronize()
    ev["start"].record()
    out = {}
    if parts[0] in ("side", "both"):
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream), side_settings(torch, carveout, lt):
            ev["side_start"].record()
            side_work()
            ev["side_end"].record()
    if parts[0] in ("main", "both"):
        ev["main_start"].record()  # after the side work's launches, as backward's next kernels come after a bucket's
        main_work()
        ev["main_end"].record()
    torch.cuda.current_stream().wait_stream(side_stream)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    if parts[0] in ("main", "both"):
        out["main_ms"] = ev["main_start"].elapsed_time(ev["main_end"])
    if parts[0] in ("side", "both"):
        out["side_ms"] = ev["side_start"].elapsed_time(ev["side_end"])
    if parts[0] == "both":
        first = min(ev["start"].elapsed_time(ev["main_start"]), ev["start"].elapsed_time(ev["side_start"]))
        out["makespan_ms"] = ev["start"].elapsed_time(end) - first
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="2.9b", help="an examples/model.py preset (dense): 934m, 2.9b, ...")
    ap.add_argument("--layers", type=int, default=4, help="layers whose Muon matrices the side work orthogonalizes")
    ap.add_argument("--main-iters", type=int, default=0,
                    help="main-stream matmuls per arm (0: as many as take about the side work's time alone)")
    ap.add_argument("--carveouts", default="0,16,32,48,66",
                    help="SMs left free, comma-separated (0: cuBLASLt told to use every SM, the carveout path's "
                         "baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed rounds first (compiles Newton–Schulz; the last sets the main matmul count)")
    ap.add_argument("--out", default=None, help="write the rounds, the table's rows and the settings as JSON")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("sm_contention.py needs a CUDA GPU (streams, SM carveout); none is available here", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    sys.path.insert(0, ROOT)
    from model import PRESETS, CausalLM
    from ds_muon.core.ns_compile import compiled_orthogonalize
    cfg = PRESETS[args.model]
    if cfg.n_experts:  # the main matmuls are a dense MLP's
        print(f"sm_contention.py takes a dense preset (its main matmuls are a dense MLP's); {args.model} has "
              f"n_experts={cfg.n_experts}", file=sys.stderr)
        return 2
    carveouts = [int(k) for k in args.carveouts.split(",") if k]
    dev = torch.device("cuda")
    tokens = 4 * cfg.max_seq_len
    a = torch.randn(tokens, cfg.d_model, device=dev, dtype=torch.bfloat16)
    b = torch.randn(cfg.d_model, cfg.ffn_hidden, device=dev, dtype=torch.bfloat16)
    c = torch.empty(tokens, cfg.ffn_hidden, device=dev, dtype=torch.bfloat16)
    shapes = preset_matrix_shapes(CausalLM, cfg, args.layers)
    mats = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    ns = compiled_orthogonalize("standard", 5, torch.bfloat16)

    iters = [args.main_iters or 20]  # a list: calibrated below when --main-iters is 0

    def main_work() -> None:
        for _ in range(iters[0]):
            torch.mm(a, b, out=c)

    def side_work() -> None:
        for m in mats:
            ns(m)

    side = torch.cuda.Stream()
    arms = arm_names(carveouts)
    rounds = []
    warm = max(1 if args.main_iters else 2, args.warmup)  # calibrating needs a round after the compiling one
    for r in range(warm + args.rounds):
        got = {arm: run_arm(torch, arm, main_work, side_work, side) for arm in arms}
        if r == warm - 1 and not args.main_iters:  # calibrate: main alone about as long as the side work alone
            iters[0] = max(1, round(iters[0] * got["side"]["side_ms"] / got["main"]["main_ms"]))
        if r >= warm:
            rounds.append(got)
    rows = summarize(rounds)
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; model {args.model}: main "
          f"{iters[0]} x ({tokens}x{cfg.d_model})@({cfg.d_model}x{cfg.ffn_hidden}) bf16, side Newton–Schulz "
          f"of {args.layers} layers {shapes}; medians of "
          f"{args.rounds} interleaved rounds")
    print(f"main alone / side alone: {rows[0]['main_ms'] / rows[1]['side_ms']:.2f}")
    print(table(rows))
    print(verdict(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                       "settings": dict(vars(args), main_iters_used=iters[0]), "rounds": rounds, "rows": rows,
                       "verdict": verdict(rows)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
