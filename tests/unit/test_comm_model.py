"""The owner plan's communication and Newton–Schulz load at world sizes too large to spawn here
(W = 16, 64, 256), on the 934M benchmark model's real Muon shapes (benchmarks/comm_model.py).

The same plan code is checked against counted gloo traffic at W = 2, 3, 4, 8 in
tests/dist/test_comm_accounting.py; here the plan alone is the simulation.
"""
from __future__ import annotations

import math

import pytest

from tests.support.tools import repo_module

comm_model = repo_module("benchmarks/comm_model.py")


@pytest.fixture(scope="module")
def infos():
    return comm_model.muon_param_infos("934m")


@pytest.mark.parametrize("world_size", [16, 64, 256])
def test_bytes_and_load_at_scale(infos, world_size: int) -> None:
    from ds_muon.sharded.ownership import build_plan
    r = comm_model.model_row(infos, world_size, bytes_per_element=1)
    W, P = world_size, r["muon_elements"]
    # mean over ranks: exactly 2 P (W-1) / W^2 plus the zero padding of each matrix's last chunk
    padding = sum(math.ceil(p.numel / W) * W - p.numel for p in infos)
    assert 0 <= padding <= len(infos) * (W - 1)
    assert r["mean_bytes"] == pytest.approx(2 * (P + padding) * (W - 1) / W**2, rel=1e-12)
    # the busiest rank: the owner of the most elements sends W-1 chunks of each of them
    plan = build_plan(infos, W)
    owned = [0] * W
    for s in plan.slots:
        owned[s.owner] += s.chunk
    total_chunks = sum(s.chunk for s in plan.slots)
    assert r["max_bytes"] == max(total_chunks - owned[k] + (W - 1) * owned[k] for k in range(W))
    # Newton–Schulz: LPT gives every rank work while there are matrices to go round, and its largest
    # load is within the LPT bound (4/3 of optimal, and optimal >= max(total/W, largest matrix))
    costs = sorted((s.cost for s in plan.slots), reverse=True)
    assert r["owners_with_work"] == min(W, len(infos))
    assert r["ns_max_flops"] <= 4 / 3 * max(sum(costs) / W, costs[0])
    if W <= 16:
        assert r["imbalance"] <= 1.05, r["imbalance"]


def test_the_model_prints_a_table(capsys) -> None:
    comm_model.main(["--model", "tiny", "--world-sizes", "2,16"])
    out = capsys.readouterr().out
    assert "| 16 |" in out and "owners with work" in out


@pytest.mark.parametrize("world_size", [64, 256])
def test_tensor_and_expert_parallel_rows(infos, world_size: int) -> None:
    """The TP and EP rows of docs/parallelism.md: ``full`` = the data-parallel plan at W; ``shard`` = each TP rank's
    shards (1/T of every matrix) over D = W/T; EP = the dense matrices over W plus 1/EP of the experts over W/EP.
    Each mean within the closed form ``2 n (w-1) / w^2`` per exchange (plus chunk padding)."""
    tp, ep = 8, 8
    moe = comm_model.muon_param_infos("moe-1.5b")
    rows = {r["mode"].split(" (")[0]: r for r in comm_model.parallel_rows(infos, moe, world_size, tp, ep, 1)}
    P = sum(p.numel for p in infos)
    dp, full, shard = rows["data parallel"], rows[f"AutoTP T={tp}, tp_mode full"], rows[f"AutoTP T={tp}, tp_mode shard"]
    assert full == {**dp, "mode": full["mode"]}
    assert shard["elements"] == P // tp and shard["groups"] == str(world_size // tp)

    def closed(n, w):
        return 2 * n * (w - 1) / w**2

    assert closed(P / tp, world_size // tp) <= shard["mean_bytes"] <= closed(P / tp, world_size // tp) * 1.01
    dense = sum(p.numel for p in moe if "experts" not in p.name)
    experts = sum(p.numel for p in moe if "experts" in p.name)
    assert experts > 0 and dense > 0
    moe_ep = rows[f"MoE, EP={ep}"]
    assert moe_ep["elements"] == dense + experts // ep
    assert moe_ep["groups"] == f"{world_size} + {world_size // ep}"
    want = closed(dense, world_size) + closed(experts / ep, world_size // ep)
    assert want <= moe_ep["mean_bytes"] <= want * 1.01
    assert moe_ep["max_bytes"] < rows["MoE, data parallel"]["max_bytes"]
