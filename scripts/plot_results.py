"""Draw the result charts in docs/img/ from the JSON stored in benchmarks/results/.

    pip install -e ".[plot]"          # matplotlib
    python scripts/plot_results.py    # writes docs/img/loss_vs_tokens.png and docs/img/step_time_memory.png

* ``loss_vs_tokens.png``: training loss (and validation loss, as markers) against tokens seen, ds_muon's Muon and
  Adam-mini against AdamW on the same model, data and seed, each run labelled and coloured by :data:`RUNS`; the
  PNG holds a digest of the data it shows (:func:`loss_digest`, checked by tests/unit/test_charts.py). Input: every ``benchmarks/results/loss_*.json``
  written by ``examples/train.py --log-json`` (one panel per ``model``/``device`` pair found).
* ``step_time_memory.png``: median step time (split into forward+backward and optimizer step) and
  peak memory per rank, for each benchmark run of ``benchmarks/results/step_time_h200.json`` (the
  run-5 table of docs/benchmarks.md: AdamW, DeepSpeed's built-in Muon, ds_muon).

Nothing is measured here; the charts only redraw the stored numbers.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLORS = {"AdamW": "tab:orange", "built-in Muon": "tab:green", "ds_muon": "tab:blue"}
#: Each stored run's label and colour, from its file name ``loss_<model>_<device>_<run>.json``.
RUNS = {"adamw": ("AdamW", "tab:orange"), "ds_muon": ("ds_muon (Muon)", "tab:blue"),
        "adam_mini": ("ds_muon Adam-mini (default blocks)", "tab:purple"),
        "adam_mini_neuron": ("ds_muon Adam-mini (neuron blocks)", "tab:red")}
#: PNG text key that holds :func:`loss_digest` of the data a chart was drawn from.
DIGEST_KEY = "ds_muon-data-digest"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_runs(results_dir: str) -> list[dict]:
    """Every stored ``loss_*.json`` run with its label and colour (:data:`RUNS`, by the file name's run part), in
    file-name order. Raises SystemExit for none, or for a run name :data:`RUNS` does not know."""
    paths = sorted(glob.glob(os.path.join(results_dir, "loss_*.json")))
    if not paths:
        raise SystemExit(f"no loss_*.json in {results_dir}; write them with examples/train.py --log-json")
    runs = []
    for path in paths:
        r = json.load(open(path, encoding="utf-8"))
        stem = os.path.basename(path)[len("loss_"):-len(".json")]
        name = stem.split("_", 2)[2] if stem.count("_") >= 2 else stem
        if name not in RUNS:
            raise SystemExit(f"{path}: run {name!r} has no label; add it to RUNS in scripts/plot_results.py")
        r["label"], r["color"] = RUNS[name]
        runs.append(r)
    return runs


def loss_digest(runs: list[dict], window: int) -> str:
    """SHA-256 of what the loss chart shows (labels, colours, panels, every point), so a test can tell that the
    committed image was drawn from the committed data without drawing it."""
    shown = [[r["label"], r["color"], r["model"], r["device"].split(":")[0], r["world_size"], r["tokens_per_step"],
              r.get("first_step", 1), r["train_loss"], r["val_loss"]] for r in runs]
    return hashlib.sha256(json.dumps([window, shown]).encode()).hexdigest()


def plot_loss(results_dir: str, out: str, window: int) -> None:
    plt = _pyplot()
    runs = loss_runs(results_dir)
    panels = sorted({(r["model"], r["device"].split(":")[0], r["world_size"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (model, device, world) in zip(axes[0], panels):
        for r in runs:
            if (r["model"], r["device"].split(":")[0], r["world_size"]) != (model, device, world):
                continue
            first = r.get("first_step", 1)  # > 1 for a run resumed with --resume
            tokens = [(first + i) * r["tokens_per_step"] for i in range(len(r["train_loss"]))]
            ax.plot(tokens, smooth(r["train_loss"], window), color=r["color"], label=f"{r['label']} train")
            ax.plot([s * r["tokens_per_step"] for s, _ in r["val_loss"]], [v for _, v in r["val_loss"]], "o--",
                    color=r["color"], markersize=4, label=f"{r['label']} validation")
        ax.set_title(f"model '{model}', {world}x {device}")
        ax.set_xlabel("tokens seen")
        ax.set_ylabel(f"loss (train: mean of {window} steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={DIGEST_KEY: loss_digest(runs, window)})
    print(f"wrote {out}")


def png_text(path: str) -> dict[str, str]:
    """The tEXt chunks of a PNG file (keyword -> text), read with the standard library."""
    import struct
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    pos = 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"tEXt":
            key, _, text = data[pos + 8:pos + 8 + length].partition(b"\0")
            out[key.decode("latin-1")] = text.decode("latin-1")
        pos += 12 + length
    return out


def plot_step_time(path: str, out: str) -> None:
    plt = _pyplot()
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
