"""QK-clip at a deliberately high learning rate: the main job with and without it, drawn to docs/img/qk_clip.png.

    python scripts/plot_qk_clip.py                       # 2 CPU processes, tiny model, Muon lr 0.3, 150 steps each
    python scripts/plot_qk_clip.py --steps 300 --lr 0.3 --threshold 100 --nproc 2 --out docs/img/qk_clip.png

Runs ``examples/train.py`` (the main job: tiny byte-level Llama-like model, ZeRO-3, ds_muon,
``examples/ds_config_cpu.json``) once per arm with the Muon ``lr`` raised to ``--lr``: without
QK-clip, and with ``optimizer.params.qk_clip = {"enabled": true, "threshold": τ, "alpha": α}``
(optionally a third arm at the config's own lr, ``--baseline``). Each run writes ``--metrics``
JSON lines whose ``max_logit`` is the step's largest pre-softmax attention logit over all layers,
heads and ranks, as recorded by the model's attention (``ds_muon.model.max_logits``) before the
optimizer step. Draws the max logit per step (log scale, τ marked) and the training loss per step,
and prints each arm's largest logit and final loss. ``--reuse`` redraws from the metrics files of an
earlier run in ``--workdir``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # for tests/support/spawn.py: the repository's one free-port helper
from tests.support.spawn import free_port  # noqa: E402
TRAIN = os.path.join(REPO, "examples", "train.py")



def arms(args) -> dict[str, dict]:
    """Arm label -> DeepSpeed config."""
    with open(args.config) as f:
        base = json.load(f)
    base["steps_per_print"] = 10**9
    out = {}
    if args.baseline:
        out[f"lr {base['optimizer']['params']['lr']:g} (the config's)"] = json.loads(json.dumps(base))
    high = json.loads(json.dumps(base))
    high["optimizer"]["params"]["lr"] = args.lr
    out[f"lr {args.lr:g}, no QK-clip"] = high
    clip = json.loads(json.dumps(high))
    clip["optimizer"]["params"]["qk_clip"] = {"enabled": True, "threshold": args.threshold, "alpha": args.alpha}
    out[f"lr {args.lr:g}, QK-clip τ={args.threshold:g}"] = clip
    return out


def run(label: str, config: dict, metrics: str, args) -> None:
    cfg_path = metrics.replace(".jsonl", ".ds_config.json")
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=1)
    if os.path.exists(metrics):
        os.remove(metrics)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
           str(free_port()), TRAIN, "--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "1",
           "--save-dir", "", "--seed", str(args.seed), "--metrics", metrics, "--deepspeed_config", cfg_path]
    print(f">> [{label}]", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout[-2000:] + proc.stderr[-4000:])
        if "qk_clip" in tail:
            tail += ("\n(this ds_muon does not accept optimizer.params.qk_clip: QK-clip itself, ds_muon/qk_clip.py, "
                     "is needed for the clipped arm)")
        raise SystemExit(f"[{label}] examples/train.py failed (exit {proc.returncode}):\n{tail}")


def read(metrics: str) -> tuple[list[int], list[float], list[float]]:
    """``(steps, training losses, max logit of each step's forward)`` from a ``train.py --metrics`` file."""
    steps, losses, logits = [], [], []
    with open(metrics) as f:
        for rec in map(json.loads, f):
            if "loss" in rec:
                steps.append(rec["step"])
                losses.append(rec["loss"])
                logits.append(rec.get("max_logit"))
    if not steps or any(v is None for v in logits):
        raise SystemExit(f"{metrics}: no per-step max_logit (the model must record its max logits)")
    return steps, losses, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.3, help="Muon lr of the high-lr arms (the config's is 0.02)")
    ap.add_argument("--threshold", type=float, default=100.0, help="QK-clip τ (Kimi K2: 100)")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--config", default=os.path.join(REPO, "examples", "ds_config_cpu.json"))
    ap.add_argument("--baseline", action="store_true", help="also run at the config's own lr")
    ap.add_argument("--workdir", default=os.path.join(REPO, "runs", "qk_clip"), help="metrics and configs (git-ignored)")
    ap.add_argument("--reuse", action="store_true", help="draw from the metrics already in --workdir")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "img", "qk_clip.png"))
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)

    results = {}
    for i, (label, config) in enumerate(arms(args).items()):
        metrics = os.path.join(args.workdir, f"arm{i}.jsonl")
        if not args.reuse:
            run(label, config, metrics, args)
        results[label] = read(metrics)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_logit, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for label, (steps, losses, logits) in results.items():
        line, = ax_logit.plot(steps, logits, label=label)
        ax_loss.plot(steps, losses, label=label, color=line.get_color())
        last = losses[-10:]
        above = [v / args.threshold for v in logits if v > args.threshold]
        print(f"{label}: max logit {max(logits):.1f} (last step {logits[-1]:.1f}); loss {losses[0]:.3f} -> "
              f"{sum(last) / len(last):.3f} (mean of the last {len(last)} steps); steps above tau "
              f"{len(above)} of {len(logits)}" + (f", at most {max(above):.3f} tau" if above else ""))
    ax_logit.axhline(args.threshold, color="gray", linestyle="--", linewidth=1, zorder=0, label=f"τ = {args.threshold:g}")
    ax_logit.set_yscale("log")
    ax_logit.set_xlabel("step")
    ax_logit.set_ylabel("max pre-softmax logit (all layers, heads)")
    ax_logit.legend(fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize=8)
    fig.suptitle(f"examples/train.py (tiny), {args.nproc} processes, ZeRO-3 + ds_muon, Muon lr {args.lr:g}",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
