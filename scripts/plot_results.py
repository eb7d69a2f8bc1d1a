"""Draw the result charts in docs/img/ from the JSON stored in benchmarks/results/.

    pip install -e ".[plot]"          # matplotlib
    python scripts/plot_results.py    # writes docs/img/loss_vs_tokens.png and docs/img/step_time_memory.png

* ``loss_vs_tokens.png``: training loss (and validation loss, as markers) against tokens seen, ds_muon
  against AdamW on the same model, data and seed. Input: every ``benchmarks/results/loss_*.json``
  written by ``examples/train.py --log-json`` (one panel per ``model``/``device`` pair found).
* ``step_time_memory.png``: median step time (split into forward+backward and optimizer step) and
  peak memory per rank, for each benchmark run of ``benchmarks/results/step_time_h200.json`` (the
  run-5 table of docs/benchmarks.md: AdamW, DeepSpeed's built-in Muon, ds_muon).

Nothing is measured here; the charts only redraw the stored numbers.
"""
from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLORS = {"AdamW": "tab:orange", "built-in Muon": "tab:green", "ds_muon": "tab:blue"}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss(results_dir: str, out: str, window: int) -> None:
    runs = [json.load(open(p, encoding="utf-8")) for p in sorted(glob.glob(os.path.join(results_dir, "loss_*.json")))]
    if not runs:
        raise SystemExit(f"no loss_*.json in {results_dir}; write them with examples/train.py --log-json")
    panels = sorted({(r["model"], r["device"].split(":")[0], r["world_size"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (model, device, world) in zip(axes[0], panels):
        for r in runs:
            if (r["model"], r["device"].split(":")[0], r["world_size"]) != (model, device, world):
                continue
            first = r.get("first_step", 1)  # > 1 for a run resumed with --resume
            tokens = [(first + i) * r["tokens_per_step"] for i in range(len(r["train_loss"]))]
            color = COLORS.get(r["optimizer"])
            ax.plot(tokens, smooth(r["train_loss"], window), color=color, label=f"{r['optimizer']} train")
            ax.plot([s * r["tokens_per_step"] for s, _ in r["val_loss"]], [v for _, v in r["val_loss"]], "o--",
                    color=color, markersize=4, label=f"{r['optimizer']} validation")
        ax.set_title(f"model '{model}', {world}x {device}")
        ax.set_xlabel("tokens seen")
        ax.set_ylabel(f"loss (train: mean of {window} steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def plot_step_time(path: str, out: str) -> None:
    data = json.load(open(path, encoding="utf-8"))
    rows = [r for r in data["rows"] if r["optimizer"] in COLORS]  # the three optimizers, not the variants
    runs = sorted({r["run"] for r in rows})
    labels = {run: next(f"{run}: {r['model']}, W={r['world_size']}" for r in rows if r["run"] == run) for run in runs}
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.27
    for k, opt in enumerate(COLORS):
        xs, fwd, step, peak = [], [], [], []
        for i, run in enumerate(runs):
            r = next((r for r in rows if r["run"] == run and r["optimizer"] == opt), None)
            if r is not None:
                xs.append(i + (k - 1) * width)
                fwd.append(r["fwd_bwd_s"])
                step.append(r["optimizer_step_s"])
                peak.append(r["peak_gib"])
        ax_t.bar(xs, fwd, width, color=COLORS[opt], alpha=0.45)
        ax_t.bar(xs, step, width, bottom=fwd, color=COLORS[opt], label=opt)
        ax_m.bar(xs, peak, width, color=COLORS[opt], label=opt)
    for ax, ylabel in ((ax_t, "step time, s (light: fwd+bwd, dark: optimizer step)"), (ax_m, "peak memory, GiB/rank")):
        ax.set_xticks(range(len(runs)), [labels[r] for r in runs], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['machine']}, {data['versions']} ({data['date']}); bf16, ZeRO-3, micro-batch 4x1024")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--window", type=int, default=10, help="steps averaged in the train-loss curve")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    plot_loss(args.results, os.path.join(args.out_dir, "loss_vs_tokens.png"), args.window)
    plot_step_time(os.path.join(args.results, "step_time_h200.json"), os.path.join(args.out_dir, "step_time_memory.png"))


if __name__ == "__main__":
    main()
