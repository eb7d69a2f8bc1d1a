"""Communication and Newton–Schulz load model of ds_muon's owner exchange at any data-parallel size.

    python benchmarks/comm_model.py [--model 934m] [--world-sizes 2,4,8,16,64,256]
                                    [--tp 8] [--moe-model moe-1.5b] [--ep 8] [--parallel-world-sizes 64,256]

Pure arithmetic over the owner plan that every rank builds (``ds_muon.sharded.ownership.build_plan``, the
same code the ZeRO-3 step runs; no process group): for each world size ``W`` it prints the Muon
elements ``P``, the bytes one rank sends per step in both all_to_all exchanges (bf16 on the wire:
mean over ranks and the maximum), the model's closed form ``2 P (W-1) / W**2`` elements, and the
Newton–Schulz load: the largest per-rank FLOPs against a perfect split (``total / W``), how many
ranks own a matrix at all, and the owner imbalance. (The built-in Muon's traffic is measured, not
modelled: docs/benchmarks.md.)

Then, at ``--parallel-world-sizes``, the same exchange's bytes per rank per step under tensor and expert
parallelism (:func:`parallel_rows`; chunked layout, so at ZeRO-1/2, where a matrix inside one rank's flat
partition stays home, they are upper bounds):

* data parallelism only: one exchange over all ``W`` ranks;
* AutoTP ``tp_mode: "full"`` (``W = T x D``): each full matrix has one owner among all ``T x D`` ranks, so the
  plan is the data-parallel one at ``W`` (docs/parallelism_tp.md);
* AutoTP ``tp_mode: "shard"``: each TP rank's shards (every Muon matrix split ``T`` ways) in an exchange over
  its data-parallel group of ``D = W / T`` ranks;
* expert parallelism (DeepSpeed's AutoEP, ``EP`` expert-parallel ranks; served, docs/parallelism.md): the dense
  Muon matrices over all ``W`` ranks, plus each rank's ``E / EP`` local experts over its expert-data-parallel group
  of ``W / EP`` ranks; against the same MoE model with every expert partitioned over all ``W`` ranks
  (``expert_parallel`` off).

The overlapped step (``overlap_backward``, docs/design.md "The overlapped step") moves the same buckets through the
same exchange during the last backward instead of after it: the bytes here are unchanged (a fallback, where
clipping fires, sends a sub-group's bytes once more in the step).

Tokens' all_to_all (EP) and activations' all_reduce (TP) are the model's traffic, the same for any optimizer, and
not counted.

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


def _reshaped(info, numel: int, shape: tuple):
    from ds_muon.sharded.ownership import ParamInfo
    return ParamInfo(name=info.name, shape=shape, numel=numel)


def tp_shard_infos(infos: list, tp: int) -> list:
    """One tensor-parallel rank's shards: every Muon matrix split ``tp`` ways along its first matrix dim
    (column-parallel; a row-parallel split moves the same number of elements)."""
    out = []
    for p in infos:
        *batch, rows, cols = p.shape
        if rows % tp:
            raise ValueError(f"{p.name}: {rows} rows do not split {tp} ways")
        out.append(_reshaped(p, p.numel // tp, (*batch, rows // tp, cols)))
    return out


def ep_split(infos: list, ep: int) -> tuple[list, list]:
    """``(dense matrices, one rank's local experts)`` under expert parallelism of size ``ep``: stacked expert
    tensors (``[E, out, in]``, names containing ``experts``) keep ``E / ep`` experts."""
    dense, local = [], []
    for p in infos:
        if "experts" not in p.name:
            dense.append(p)
            continue
        experts, *rest = p.shape
        if experts % ep:
            raise ValueError(f"{p.name}: {experts} experts do not split over {ep} expert-parallel ranks")
        local.append(_reshaped(p, p.numel // ep, (experts // ep, *rest)))
    return dense, local


def parallel_rows(infos: list, moe_infos: list, world_size: int, tp: int, ep: int,
                  bytes_per_element: int = 2) -> list[dict]:
    """Bytes per rank per step of the owner exchange at ``world_size`` per mode (:mod:`benchmarks.comm_model`'s
    docstring): ``mode``, ``groups`` (the exchange groups' sizes), ``elements`` (Muon elements each rank's
    exchanges cover), ``mean_bytes``, ``max_bytes``."""
    if world_size % tp or world_size % ep:
        raise ValueError(f"W={world_size} must be a multiple of tp={tp} and ep={ep}")

    def row(mode: str, parts: list[tuple[list, int]]) -> dict:
        rows = [model_row(part, w, bytes_per_element) for part, w in parts if part]
        return dict(mode=mode, groups=" + ".join(str(w) for part, w in parts if part),
                    elements=sum(r["muon_elements"] for r in rows), mean_bytes=sum(r["mean_bytes"] for r in rows),
                    max_bytes=sum(r["max_bytes"] for r in rows))

    dense, local = ep_split(moe_infos, ep)
    return [row("data parallel", [(infos, world_size)]),
            row(f"AutoTP T={tp}, tp_mode full", [(infos, world_size)]),
            row(f"AutoTP T={tp}, tp_mode shard", [(tp_shard_infos(infos, tp), world_size // tp)]),
            row("MoE, data parallel", [(moe_infos, world_size)]),
            row(f"MoE, EP={ep} (AutoEP)", [(dense, world_size), (local, world_size // ep)])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="934m")
    ap.add_argument("--world-sizes", default="2,4,8,16,64,256")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the TP rows")
    ap.add_argument("--moe-model", default="moe-1.5b", help="the model of the EP rows (an examples/model.py MoE preset)")
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel size of the EP rows")
    ap.add_argument("--parallel-world-sizes", default="64,256")
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
    if not args.parallel_world_sizes:
        return
    moe = muon_param_infos(args.moe_model)
    print(f"\ntensor and expert parallelism ({args.model} for TP, {args.moe_model} for EP: "
          f"{sum(p.numel for p in moe) / 1e6:.0f}M Muon elements): owner exchange bytes per rank per step, bf16\n")
    print("| W | mode | exchange group sizes | Muon elements per rank's exchanges | mean MiB | max MiB |")
    print("|---|---|---|---|---|---|")
    for w in (int(x) for x in args.parallel_world_sizes.split(",")):
        for r in parallel_rows(infos, moe, w, args.tp, args.ep):
            print(f"| {w} | {r['mode']} | {r['groups']} | {r['elements'] / 1e6:.0f}M | {r['mean_bytes'] / 2**20:.1f} | "
                  f"{r['max_bytes'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
