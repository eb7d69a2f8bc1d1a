"""Draw the result charts in docs/img/ from the JSON stored in benchmarks/results/.

    pip install -e ".[plot]"          # matplotlib
    python scripts/plot_results.py    # writes docs/img/loss_vs_tokens.png, step_time_memory.png, step_time_w1.png

* ``loss_vs_tokens.png``: training loss (and validation loss, as markers) against tokens seen, ds_muon's Muon and
  Adam-mini against AdamW on the same model, data and seed, each run labelled and coloured by :data:`RUNS`; the
  PNG holds a digest of the data it shows (:func:`loss_digest`, checked by tests/unit/test_charts.py). Input: every ``benchmarks/results/loss_*.json``
  written by ``examples/train.py --log-json`` (one panel per ``model``/``device`` pair found).
* ``step_time_w1.png``: the one-GPU runs the README's results table quotes (:data:`W1_RUNS`, each a
  ``benchmarks/step_time.py --rounds 3 --rotate`` JSON with AdamW, DeepSpeed's built-in Muon and ds_muon): median
  step time split into forward+backward and optimizer step, and peak memory, per model; the PNG holds a digest of
  the numbers it shows (:func:`w1_digest`, checked by tests/unit/test_charts.py).
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
#: The one-GPU runs of ``step_time_w1.png``: (model label, file in benchmarks/results/, the run as the chart names
#: it: the machine, the commit measured, the date). Each file's rounds are read from it.
W1_RUNS = (("934M", "step_time_w1_934m_targets_rotated_h100_2026-12-06s12.json", "one H100, db8d360, 2026-12-06"),
           ("2.9B", "step_time_w1_2.9b_targets_rotated_h100_2026-12-06s12.json", "one H100, db8d360, 2026-12-06"),
           ("MoE-1.5B", "step_time_w1_moe-1.5b_targets_rotated_h100_2026-12-06s11.json",
            "one H100, 609ecf1, 2026-12-06"))
#: ``step_time.py`` arm name (before its first ``:``) -> the chart's optimizer label (a key of :data:`COLORS`).
W1_ARMS = {"adamw": "AdamW", "builtin_muon": "built-in Muon", "ds_muon": "ds_muon"}
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


def _step_memory_bars(groups: list, tick_labels: list[str], row_of, opt_key: str, figsize: tuple, time_label: str,
                      memory_label: str, ylabel_size=None, totals: bool = False):
    """The two panels of a timing chart, returned as the figure: per group (a run, a model; the x axis, labelled
    ``tick_labels``) one bar per optimizer of :data:`COLORS` (``row_of(group, optimizer)`` -> its row, or None for no
    bar): its ``fwd_bwd_s`` (light) under its ``opt_key`` (dark), seconds, with ``step_s`` written on top where
    ``totals``; and its ``peak_gib``."""
    plt = _pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=figsize)
    width = 0.27
    for k, opt in enumerate(COLORS):
        placed = [(i + (k - 1) * width, row_of(g, opt)) for i, g in enumerate(groups)]
        placed = [(x, r) for x, r in placed if r is not None]
        xs, fwd = [x for x, _ in placed], [r["fwd_bwd_s"] for _, r in placed]
        ax_t.bar(xs, fwd, width, color=COLORS[opt], alpha=0.45)
        ax_t.bar(xs, [r[opt_key] for _, r in placed], width, bottom=fwd, color=COLORS[opt], label=opt)
        for x, r in placed if totals else ():
            ax_t.text(x, r["fwd_bwd_s"] + r[opt_key], f"{r['step_s']:.2f}", ha="center", va="bottom", fontsize=7)
        ax_m.bar(xs, [r["peak_gib"] for _, r in placed], width, color=COLORS[opt], label=opt)
    for ax, ylabel in ((ax_t, time_label), (ax_m, memory_label)):
        ax.set_xticks(range(len(groups)), tick_labels, fontsize=8)
        ax.set_ylabel(ylabel, **({} if ylabel_size is None else {"fontsize": ylabel_size}))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def plot_step_time(path: str, out: str) -> None:
    data = json.load(open(path, encoding="utf-8"))
    rows = [r for r in data["rows"] if r["optimizer"] in COLORS]  # the three optimizers, not the variants
    runs = sorted({r["run"] for r in rows})
    labels = {run: next(f"{run}: {r['model']}, W={r['world_size']}" for r in rows if r["run"] == run) for run in runs}
    fig = _step_memory_bars(
        runs, [labels[r] for r in runs],
        lambda run, opt: next((r for r in rows if r["run"] == run and r["optimizer"] == opt), None),
        "optimizer_step_s", (12, 4), "step time, s (light: fwd+bwd, dark: optimizer step)", "peak memory, GiB/rank")
    fig.suptitle(f"{data['machine']}, {data['versions']} ({data['date']}); bf16, ZeRO-3, micro-batch 4x1024")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def w1_rows(results_dir: str) -> list[dict]:
    """One row per (model, optimizer) of :data:`W1_RUNS`: ``model`` (its label and run, as the chart's x axis
    names it), ``optimizer`` (a :data:`COLORS` key), ``fwd_bwd_s``, ``opt_step_s``, ``step_s`` (medians over all
    rounds, s), ``rounds`` and ``peak_gib`` (GiB per rank); the first arm of each optimizer in the file.

    Raises:
        SystemExit: a file lacks one of the three optimizers. OSError, KeyError: a file of :data:`W1_RUNS` is
            missing or is not a ``benchmarks/step_time.py --out`` JSON.
    """
    rows = []
    for model, name, run in W1_RUNS:
        path = os.path.join(results_dir, name)
        arms = json.load(open(path, encoding="utf-8"))
        for prefix, label in W1_ARMS.items():
            arm = next((v for k, v in arms.items() if k.split(":")[0] == prefix and "error" not in v), None)
            if arm is None:
                raise SystemExit(f"{path}: no {prefix} arm")
            where = run.replace(", ", "\n", 1)  # the machine on one line, the commit and date on the next
            rows.append({"model": f"{model}\n{where}\n{arm['rounds']} rounds", "optimizer": label,
                         "fwd_bwd_s": arm["fwd_bwd_s"], "opt_step_s": arm["opt_step_s"], "step_s": arm["step_s"],
                         "rounds": arm["rounds"], "peak_gib": arm["peak_gib"]})
    return rows


def w1_digest(rows: list[dict]) -> str:
    """SHA-256 of what ``step_time_w1.png`` shows (every row of :func:`w1_rows`, in order)."""
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def plot_step_time_w1(results_dir: str, out: str) -> None:
    """Draw ``out`` (a PNG, with :func:`w1_digest` in its text chunk) from :func:`w1_rows`; needs matplotlib
    (``pip install -e ".[plot]"``). Raises as :func:`w1_rows`."""
    rows = w1_rows(results_dir)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig = _step_memory_bars(
        models, models, lambda m, opt: next(r for r in rows if r["model"] == m and r["optimizer"] == opt),
        "opt_step_s", (12, 5), "step time, s (light: fwd+bwd, dark: optimizer step;\nds_muon's fwd+bwd holds its "
        "overlapped Muon step)", "peak memory, GiB", ylabel_size=9, totals=True)
    fig.suptitle("W=1, torch 2.11, deepspeed 0.19.8, bf16, ZeRO-3, micro-batch 4x1024; medians over rotated rounds\n"
                 "(AdamW, DeepSpeed's built-in Muon and ds_muon in one run per model)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={DIGEST_KEY: w1_digest(rows)})
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
    plot_step_time_w1(args.results, os.path.join(args.out_dir, "step_time_w1.png"))


if __name__ == "__main__":
    main()
