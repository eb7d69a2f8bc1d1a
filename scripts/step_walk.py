"""The frames from DeepSpeed's ``engine.step()`` to Newton–Schulz in one ZeRO-3 Muon step (docs/design.md, "The walk,
file by file"): a one-step W=1 run on the CPU accelerator with a tiny model, the stack captured inside
``ds_muon.core.newton_schulz.newton_schulz_quintic``.

    python scripts/step_walk.py [--json]

Prints one frame per line (``file function``; DeepSpeed's and torch's frames prefixed ``deepspeed:``/``torch:``),
then a JSON summary: ``frames_below_optimizer_step`` (the frames from ``_optimizer_step``, exclusive, down to
``newton_schulz.orthogonalize``, inclusive), ``ds_muon_files`` and the ds_muon frames below the dispatch as
``[[file, function], ...]``. tests/dist/test_step_walk.py checks them against docs/design.md.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(filename: str) -> str:
    """``ds_muon/...`` for ds_muon's files, else ``deepspeed:<path under deepspeed/>`` or ``torch:<path>``."""
    if os.sep + "ds_muon" + os.sep in filename:
        return "ds_muon" + filename.split(os.sep + "ds_muon", 1)[1].replace(os.sep, "/")
    for lib in ("deepspeed", "torch"):
        if os.sep + lib + os.sep in filename:
            return f"{lib}:" + filename.split(os.sep + lib + os.sep, 1)[1].replace(os.sep, "/")
    return filename


def main() -> None:
    for key, value in (("DS_ACCELERATOR", "cpu"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29555"),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import torch
    import ds_muon
    import ds_muon.core.newton_schulz as ns
    captured: list = []
    real = ns.newton_schulz_quintic

    def spy(*args, **kwargs):
        if not captured:
            captured.extend(traceback.extract_stack()[:-1])
        return real(*args, **kwargs)

    ns.newton_schulz_quintic = spy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 32), torch.nn.Linear(32, 64))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1_000_000,
           "optimizer": {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3}}
    engine, *_ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, 64, (2, 8))
    engine.backward(engine(x).float().square().mean())
    engine.step()
    ns.newton_schulz_quintic = real
    if not captured:
        raise SystemExit("Newton–Schulz (newton_schulz_quintic) never ran in the step")
    start = next(i for i, f in enumerate(captured) if f.name == "step" and _where(f.filename).startswith("deepspeed:"))
    walk = [(_where(f.filename), f.name) for f in captured[start:]]
    dispatch = next(i for i, (_, name) in enumerate(walk) if name == "_optimizer_step")
    below = walk[dispatch + 1:]
    ours = [w for w in below if w[0].startswith("ds_muon/")]
    summary = {"frames_below_optimizer_step": len(below), "ds_muon_files": len({f for f, _ in ours}),
               "below": [list(w) for w in below]}
    if "--json" not in sys.argv:
        for where, name in walk:
            print(where, name)
    print(json.dumps(summary))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
