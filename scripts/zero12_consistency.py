"""Self-consistency checks of a ZeRO-1/2 Muon optimizer: DeepSpeed 0.19.8's built-in against ds_muon.

    python scripts/zero12_consistency.py [--stage 2] [--world-size 2] [--out results.json]

CPU (gloo), the parity model (tests/support/models.py, without its conv layer, which the built-in cannot take),
fp32. Each check compares an optimizer with itself, so the built-in's own Muon math (its Newton–Schulz, scale and
defaults) is never held against ds_muon's; a correct ZeRO optimizer gives the same numbers both ways, up to fp32
rounding:

* ``gas``: 3 steps of 2 micro-batches of 2 rows vs. 3 steps of 1 micro-batch of the same 4 rows (the same mean
  gradient): max relative difference over the Muon parameters;
* ``grad_norm``: the global gradient norm the engine reports at the first step vs. the raw gradient's norm (the
  same at the first step for every optimizer): relative difference;
* ``clip``: the first update with ``gradient_clipping`` 1e-3 (the raw norm is far above it) vs. without: a
  clipped raw gradient gives Muon the same update (Newton–Schulz normalizes it), so the relative difference of
  a Muon parameter's first update is ~0 for raw-gradient clipping and large for clipping applied after the
  update (the built-in scales its orthogonalized update);
* ``offload``: 3 steps with CPU optimizer offload vs. without: max relative difference;
* ``resume``: 4 continuous steps vs. 2 steps, ``save_checkpoint``, a new engine, ``load_checkpoint``, 2 steps (AdamW
  betas 0.5/0.75, exact in fp32): max relative difference;
* ``universal``: whether the checkpoint converts to a universal one (the built-in: DeepSpeed's
  ``ds_to_universal``; ds_muon: ``python -m ds_muon.checkpoint to-universal``).

Prints a markdown table; docs/migration.md records the result.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.support.spawn import run_distributed  # noqa: E402

PARAMS = {"builtin": {"lr": 0.02, "momentum": 0.9, "adam_lr": 3e-3, "weight_decay": 0.0, "betas": [0.5, 0.75]},
          "ds_muon": {"lr": 0.02, "momentum": 0.9, "adam_lr": 3e-3, "weight_decay": 0.0, "betas": [0.5, 0.75],
                      "ns_dtype": "float32", "exchange_dtype": "float32"}}


def _config(kind: str, stage: int, gas: int = 1, micro: int = 2, clip: float = 0.0, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "optimizer": {"type": "Muon", "params": dict(PARAMS[kind])},
            "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 10_000}


def _engine(kind: str, cfg: dict):
    import deepspeed
    import torch

    import ds_muon
    from tests.support.models import ParityNet
    torch.manual_seed(0)
    model = ParityNet(conv=False)
    init = ds_muon.initialize if kind == "ds_muon" else deepspeed.initialize
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=cfg)
    expected = "MuonZero12Optimizer" if kind == "ds_muon" else "DeepSpeedZeroOptimizer"
    assert type(engine.optimizer).__name__ == expected, type(engine.optimizer)
    return engine, model


def _rows(step: int, rank: int, micro: int, rows: int):
    """Rows ``[micro * rows, (micro + 1) * rows)`` of this rank's 4-row batch of ``step``."""
    from tests.support.models import batch
    tokens, targets = batch(step, rank, 0, 4)
    return tokens[micro * rows:(micro + 1) * rows], targets[micro * rows:(micro + 1) * rows]


def _train(engine, rank: int, steps, gas: int) -> list[float]:
    norms = []
    for step in steps:
        for micro in range(gas):
            tokens, targets = _rows(step, rank, micro, 4 // gas)
            engine.backward(engine(tokens, targets, True))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return norms


def _weights(engine, model) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in model.named_parameters()
            if p.requires_grad}


def _max_rel(a: dict, b: dict, names) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in names)


def _raw_norm(rank: int, world_size: int) -> float:
    """The raw global gradient norm of the first step (mean gradient over all ranks' 4-row batches)."""
    import torch
    from tests.support.models import ParityNet
    torch.manual_seed(0)
    model = ParityNet(conv=False)
    for r in range(world_size):
        tokens, targets = _rows(0, r, 0, 4)
        (model(tokens, targets, True) / world_size).backward()
    return float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))


def worker(rank: int, world_size: int, stage: int, root: str) -> dict:
    out = {}
    for kind in ("builtin", "ds_muon"):
        res = {}
        engine, model = _engine(kind, _config(kind, stage, gas=2, micro=2))
        muon = [n for n, p in model.named_parameters() if getattr(p, "use_muon", False) and p.requires_grad]
        _train(engine, rank, range(3), 2)
        gas2 = _weights(engine, model)
        engine.destroy()
        engine, model = _engine(kind, _config(kind, stage, gas=1, micro=4))
        init = _weights(engine, model)
        norms = _train(engine, rank, range(3), 1)
        gas1 = _weights(engine, model)
        engine.destroy()
        res["gas"] = _max_rel(gas2, gas1, muon)
        res["grad_norm"] = abs(norms[0] - _raw_norm(rank, world_size)) / _raw_norm(rank, world_size)
        first = {}
        for clip in (0.0, 1e-3):
            engine, model = _engine(kind, _config(kind, stage, gas=1, micro=4, clip=clip))
            _train(engine, rank, range(1), 1)
            first[clip] = {n: w - init[n] for n, w in _weights(engine, model).items()}
            engine.destroy()
        res["clip"] = _max_rel(first[1e-3], first[0.0], muon)
        engine, model = _engine(kind, _config(kind, stage, gas=1, micro=4, offload_optimizer={"device": "cpu"}))
        _train(engine, rank, range(3), 1)
        res["offload"] = _max_rel(_weights(engine, model), gas1, muon)
        engine.destroy()
        ckpt = os.path.join(root, kind)
        engine, model = _engine(kind, _config(kind, stage, gas=1, micro=4))
        _train(engine, rank, range(4), 1)
        continuous = _weights(engine, model)
        engine.destroy()
        engine, model = _engine(kind, _config(kind, stage, gas=1, micro=4))
        _train(engine, rank, range(2), 1)
        engine.save_checkpoint(ckpt, tag="half")
        engine.destroy()
        engine, model = _engine(kind, _config(kind, stage, gas=1, micro=4))
        engine.load_checkpoint(ckpt, tag="half")
        _train(engine, rank, range(2, 4), 1)
        res["resume"] = _max_rel(_weights(engine, model), continuous, continuous)
        engine.destroy()
        out[kind] = res
    return out


def _universal(kind: str, ckpt: str, out: str) -> str:
    if kind == "ds_muon":
        cmd = [sys.executable, "-m", "ds_muon.checkpoint", "to-universal", ckpt, out, "--tag", "half"]
    else:
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               os.path.join(ckpt, "half"), "--output_folder", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if proc.returncode == 0:
        return "converts"
    last = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return f"fails: {last[-1][:120] if last else proc.returncode}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=int, choices=(1, 2), default=2)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ["DS_MUON"] = "0"  # the built-in runs as DeepSpeed ships it; ds_muon through ds_muon.initialize
    with tempfile.TemporaryDirectory() as root:
        res = run_distributed(worker, args.world_size, args.stage, root, timeout=1800)[0]
        for kind in res:
            res[kind]["universal"] = _universal(kind, os.path.join(root, kind), os.path.join(root, f"{kind}_u"))
    rows = [("gas", "GAS 2 vs. GAS 1, same rows: max rel. diff of Muon weights"),
            ("grad_norm", "reported grad norm vs. raw gradient norm, step 1: rel. diff"),
            ("clip", "first Muon update, clip 1e-3 vs. none: max rel. diff (raw-gradient clipping: ~0)"),
            ("offload", "CPU offload vs. none, 3 steps: max rel. diff"),
            ("resume", "save/load after 2 of 4 steps vs. continuous: max rel. diff"),
            ("universal", "universal conversion of the checkpoint")]
    fmt = functools.partial(lambda v: v if isinstance(v, str) else f"{v:.2e}")
    print(f"\nZeRO stage {args.stage}, W={args.world_size}, CPU/gloo, fp32\n")
    print("| check | DeepSpeed built-in | ds_muon |\n|---|---|---|")
    for key, label in rows:
        print(f"| {label} | {fmt(res['builtin'][key])} | {fmt(res['ds_muon'][key])} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
