"""Communication and Newton–Schulz load model of ds_muon's owner exchange at any data-parallel size.

    python benchmarks/comm_model.py [--model 934m] [--world-sizes 2,4,8,16,64,256]

Pure arithmetic over the owner plan that every rank builds (``ds_muon.ownership.build_plan``, the
same code the ZeRO-3 step runs; no process group): for each world size ``W`` it prints the Muon
elements ``P``, the bytes one rank sends per step in both all_to_all exchanges (bf16 on the wire:
mean over ranks and the maximum), the model's closed form ``2 P (W-1) / W**2`` elements, and the
Newton–Schulz load: the largest per-rank FLOPs against a perfect split (``total / W``), how many
ranks own a matrix at all, and the owner imbalance. (The built-in Muon's traffic is measured, not
modelled: docs/benchmarks.md.)

At CPU scale the same plan's byte counts are checked against counted gloo traffic at W=2,3,4,8
(tests/dist/test_comm_accounting.py); tests/unit/test_comm_model.py checks this model at W=16, 64 and 256.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def muon_param_infos(model_name: str) -> list:
    """``ParamInfo`` of every Muon matrix of an ``examples/model.py`` preset (built on the meta device)."""
    import torch
    sys.path.insert(0, os.path.join(REPO, "examples"))
    sys.path.insert(0, REPO)
    from model import CausalLM, ModelConfig
    from ds_muon.sharded.ownership import ParamInfo
    from ds_muon.model.selection import select_muon_params
    with torch.device("meta"):
        model = CausalLM(ModelConfig.preset(model_name))
    sel = select_muon_params(model)
    return [ParamInfo(name=n, shape=tuple(p.shape), numel=p.numel())
            for n, p in model.named_parameters() if sel.use_muon[n]]


def model_row(infos: list, world_size: int, bytes_per_element: int = 2) -> dict:
    """One world size's figures (bytes per rank per step, both exchanges; FLOPs per rank)."""
    from ds_muon.sharded.ownership import build_plan
    plan = build_plan(infos, world_size)
    P = sum(p.numel for p in infos)
    sent = [plan.sent_elements(r) for r in range(world_size)]
    loads = plan.load()
    return dict(world_size=world_size, muon_elements=P, matrices=len(infos),
                mean_bytes=sum(sent) / world_size * bytes_per_element, max_bytes=max(sent) * bytes_per_element,
                closed_form_bytes=2 * P * (world_size - 1) / world_size**2 * bytes_per_element,
                ns_max_flops=max(loads), ns_even_flops=sum(loads) / world_size,
                imbalance=plan.imbalance(), owners_with_work=sum(1 for x in loads if x > 0))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="934m")
    ap.add_argument("--world-sizes", default="2,4,8,16,64,256")
    args = ap.parse_args(argv)
    infos = muon_param_infos(args.model)
    print(f"model {args.model}: {len(infos)} Muon matrices, {sum(p.numel for p in infos) / 1e6:.0f}M Muon elements; "
          "bytes per rank per step, bf16 on the wire\n")
    print("| W | mean MiB | max MiB | closed form MiB | NS max / even split | owners with work | imbalance |")
    print("|---|---|---|---|---|---|---|")
    for w in (int(x) for x in args.world_sizes.split(",")):
        r = model_row(infos, w)
        mib = 2**20
        print(f"| {w} | {r['mean_bytes'] / mib:.0f} | {r['max_bytes'] / mib:.0f} | {r['closed_form_bytes'] / mib:.0f} | "
              f"{r['ns_max_flops'] / r['ns_even_flops']:.2f} | {r['owners_with_work']} | {r['imbalance']:.2f} |")


if __name__ == "__main__":
    main()
