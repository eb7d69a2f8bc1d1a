"""No gradient, no step: Muon blocks (experts, matrices) that get no gradient in a step keep their
momentum and weights, in the oracle and in ZeRO-3 alike; AdamW parameters follow their optimizers.

CPU, gloo, fp32; tolerance as in test_zero3_parity (``PARITY_RTOL`` of each parameter, 1e-3 of its update).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_muon import MuonAdamW
from ds_muon.sharded.blocks import PADDING, build_block_map
from ds_muon.sharded.ownership import ParamInfo, build_plan
from tests.support.spawn import run_distributed
from tests.support.harness import (MUON_PARAMS, PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                           reference_model, train_reference)
from tests.support.models import VOCAB, batch, use_extra

DIM, HIDDEN, EXPERTS, DEAD = 24, 32, 4, 3  # expert DEAD is never routed to
NEG = 1  # expert NEG's w_out gradient is made <= 0 everywhere (on every rank, every micro-batch)
STEPS = 3


class TinyMoE(nn.Module):
    """Top-1 routed MoE LM: stacked experts ``w_in (E, HIDDEN, DIM)`` / ``w_out (E, DIM, HIDDEN)`` (Muon,
    one matrix per expert), a router that never picks expert ``DEAD``, and a ``side`` branch
    (Linear with bias) taken only when ``use_extra`` (even steps), so its weight (Muon) and bias
    (AdamW) have ``grad is None`` on odd steps. Which of the live experts a token goes to depends
    on the data, so an expert can be idle on one rank and busy on another. A gradient hook makes
    ``w_out[NEG]``'s gradient ``-|g|``: a block with a gradient whose largest element is 0, which must
    step (the no-gradient rule looks at ``|g|``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.2)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.2)
        self.w_in.use_muon = self.w_out.use_muon = True
        self.w_out.register_hook(_non_positive_expert)
        self.side = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        x = self.embed(tokens).reshape(-1, DIM)
        logits = self.router(x)
        logits[:, DEAD] = float("-inf")
        gate, choice = F.softmax(logits, dim=-1).max(dim=-1)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():  # as HF MoE blocks do: an expert with no token is not computed
                h = F.silu(x[rows] @ self.w_in[e].t()) @ self.w_out[e].t()
                out = out.index_add(0, rows, gate[rows, None] * h)
        h = x + out
        if use_side:
            h = h + self.side(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits, targets.reshape(-1))


def _non_positive_expert(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with expert ``NEG``'s block replaced by ``-|grad|`` (a new tensor)."""
    out = grad.clone()
    out[NEG] = -grad[NEG].abs()
    return out


# ------------------------------------------------------------------------------------------------
# the oracle, single process
# ------------------------------------------------------------------------------------------------
def test_oracle_skips_blocks_and_params_without_gradient():
    """A zero expert keeps momentum and weights bit for bit; the others step exactly as if alone."""
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(3, 6, 5))
    single = [nn.Parameter(stack.data[k].clone()) for k in (0, 2)]
    for p in [stack, *single]:
        p.use_muon = True
    opt = MuonAdamW([stack], **MUON_PARAMS)
    ref = MuonAdamW(single, **MUON_PARAMS)
    for step in range(3):
        g = torch.randn(3, 6, 5)
        if step > 0:
            g[1] = 0  # expert 1: a gradient in step 0 only (so it has momentum), none afterwards
        stack.grad = g
        single[0].grad, single[1].grad = g[0].clone(), g[2].clone()
        before_w, before_m = stack.detach()[1].clone(), None
        if step > 0:
            before_m = opt.state[stack]["momentum_buffer"][1].clone()
        opt.step()
        ref.step()
        if step > 0:
            assert torch.equal(stack.detach()[1], before_w), "an expert with no gradient moved"
            assert torch.equal(opt.state[stack]["momentum_buffer"][1], before_m), "its momentum changed"
        else:
            assert not torch.equal(stack.detach()[1], before_w)
        torch.testing.assert_close(stack.detach()[0], single[0].detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stack.detach()[2], single[1].detach(), rtol=1e-6, atol=1e-7)

    # a 2-D parameter with an all-zero gradient is skipped like one with grad None
    w = nn.Parameter(torch.randn(4, 4))
    w.use_muon = True
    opt = MuonAdamW([w], **MUON_PARAMS)
    w.grad = torch.randn(4, 4)
    opt.step()
    state = opt.state[w]["momentum_buffer"].clone()
    before = w.detach().clone()
    w.grad = torch.zeros(4, 4)
    opt.step()
    assert torch.equal(w.detach(), before) and torch.equal(opt.state[w]["momentum_buffer"], state)


def test_oracle_skips_idle_expert_with_bf16_momentum():
    """The same rule with ``momentum_dtype: bfloat16`` (momentum stored rounded, update in fp32)."""
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(3, 6, 5))
    stack.use_muon = True
    opt = MuonAdamW([stack], **MUON_PARAMS, momentum_dtype="bfloat16")
    stack.grad = torch.randn(3, 6, 5)
    opt.step()
    m = opt.state[stack]["momentum_buffer"]
    assert m.dtype == torch.bfloat16
    before_w, before_m = stack.detach().clone(), m.clone()
    g = torch.randn(3, 6, 5)
    g[2] = 0
    stack.grad = g
    opt.step()
    assert torch.equal(stack.detach()[2], before_w[2]) and torch.equal(m[2], before_m[2])
    assert not torch.equal(stack.detach()[0], before_w[0]) and not torch.equal(m[1], before_m[1])


def test_block_map_tiles_every_block_exactly_once():
    """Over all ranks, each block's segments cover its elements once; padding is marked."""
    infos = [ParamInfo("a", (3, 7, 5), 105), ParamInfo("b", (11, 2), 22), ParamInfo("c", (2, 3, 1), 6)]
    for world in (1, 2, 3, 4):
        plan = build_plan(infos, world)
        covered: dict[int, int] = {}
        for rank in range(world):
            bm = build_block_map(plan.slots, rank, plan.shard_numel)
            assert sum(bm.lengths) == plan.shard_numel and bm.n_blocks == 3 + 1 + 2
            for length, block in zip(bm.lengths, bm.block_of_segment):
                if block != PADDING:
                    covered[block] = covered.get(block, 0) + length
        assert bm.block_names[:4] == ("a[0]", "a[1]", "a[2]", "b[0]")
        assert covered == {0: 35, 1: 35, 2: 35, 3: 22, 4: 3, 5: 3}, (world, covered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_local_flags_are_max_abs_nonzero_per_block(dtype):
    """``GradientFlags.local`` (two segment reductions, no ``|g|`` temporary) flags exactly the blocks whose shard
    holds an element with ``|g| != 0``, NaN included: blocks of positive-only, negative-only, zero, ``-0.0``, NaN
    (alone and among non-zeros), ``-inf``, one non-zero element, split over ranks, beside padding. A flag from the largest element alone misses the
    negative-only block."""
    from ds_muon.sharded.no_grad import GradientFlags
    infos = [ParamInfo("a", (6, 4, 3), 72), ParamInfo("b", (5, 2), 10), ParamInfo("c", (3, 2, 2), 12),
             ParamInfo("d", (4, 2, 2), 16)]
    fills = [lambda g: g.abs_(), lambda g: g.abs_().neg_(), lambda g: g.zero_(), lambda g: g.zero_().neg_(),
             lambda g: g.zero_().index_fill_(0, torch.tensor([1]), float("nan")),
             lambda g: g.zero_().index_fill_(0, torch.tensor([len(g) - 1]), -1e-3), lambda g: g, lambda g: g.zero_(),
             lambda g: g.zero_().neg_(), lambda g: g.abs_().neg_(),
             lambda g: g.index_fill_(0, torch.tensor([len(g) // 2]), float("nan")),  # NaN among non-zeros
             lambda g: g.zero_().index_fill_(0, torch.tensor([0]), float("-inf"))]
    for world in (1, 2, 3):
        plan = build_plan(infos, world)
        for rank in range(world):
            bm = build_block_map(plan.slots, rank, plan.shard_numel)
            grad = torch.randn(plan.shard_numel).to(dtype)
            expected = torch.zeros(bm.n_blocks, dtype=torch.uint8)
            start = 0
            for length, block in zip(bm.lengths, bm.block_of_segment):
                seg = grad.narrow(0, start, length)
                if block == PADDING:
                    seg.zero_()
                else:
                    fills[block % len(fills)](seg)
                    expected[block] |= bool((seg.float().abs() != 0).any())  # NaN != 0
                start += length
            got = GradientFlags({0: bm}, torch.device("cpu")).local(0, grad)
            assert got.dtype == torch.uint8 and torch.equal(got, expected), (world, rank, dtype, got, expected)
            assert expected.any() and not expected.all()


# ------------------------------------------------------------------------------------------------
# ZeRO-3 against the oracle, W = 2 and 3
# ------------------------------------------------------------------------------------------------
def _train_reference_keep_none(model, optimizer, steps: int, world_size: int, gas: int, clip: float) -> None:
    """As harness.train_reference, but a parameter with no gradient keeps ``grad = None``."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for rank in range(world_size):
            for micro in range(gas):
                tokens, targets = batch(step, rank, micro)
                (model(tokens, targets, use_extra(step)) / (world_size * gas)).backward()
        torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None],
                                       clip if clip > 0 else float("inf"))
        optimizer.step()


def _worker(rank: int, world_size: int, cases: list[dict]) -> list:
    from ds_muon.integration.zero3 import MuonZeroOptimizer
    from tests.support.comm_counter import counting
    out = []
    for case in cases:
        gas, clip = case["gas"], case["clip"]
        cfg = ds_config(gas=gas, clip=clip, **case.get("zero", {}))
        engine, model = build_engine(cfg, model_fn=TinyMoE)
        assert type(engine.optimizer) is MuonZeroOptimizer
        init, tags = gathered_params(model), clone_tags(model)
        blocks = [bm.n_blocks for bm in (s.block_map for s in engine.optimizer.muon_steps.values())]  # per Muon sub-group
        after, flag_collectives = [], []
        for step in range(STEPS):
            for micro in range(gas):
                tokens, targets = batch(step, rank, micro)
                engine.backward(engine(tokens, targets, use_extra(step)))
                with counting() as records:
                    engine.step()
                    # the no-gradient flags: the only uint8 all_reduce (one byte per element)
                    flag_collectives.append([n for op, n, b in records if op == "all_reduce" and b == n])
            after.append(gathered_params(model))
        engine.destroy()
        if rank == 0:
            case_flags = {"blocks": blocks, "flag_collectives": flag_collectives}
        if rank != 0:
            out.append(None)
            continue
        ref = reference_model(init, tags, TinyMoE)
        train_reference(ref, MuonAdamW(ref.parameters(), **cfg["optimizer"]["params"]), STEPS, world_size, gas, clip)
        keep_none = reference_model(init, tags, TinyMoE)
        _train_reference_keep_none(keep_none, MuonAdamW(keep_none.parameters(), **cfg["optimizer"]["params"]),
                                   STEPS, world_size, gas, clip)
        neg = ref.w_out.grad[NEG]  # the last step's (clipped) gradient of the non-positive block
        out.append({"init": init, "after": after, "tags": tags, **case_flags,
                    "neg_grad": (bool((neg <= 0).all()), bool((neg < 0).any())),
                    "errors": compare(after[-1], {n: p.detach().clone() for n, p in ref.named_parameters()}, init),
                    "vs_keep_none": compare(after[-1], {n: p.detach().clone() for n, p in keep_none.named_parameters()},
                                            init)})
    return out


def _before_init() -> None:
    from tests.support.comm_counter import install
    install()


_worker.before_init = _before_init

# sub_group_size 2000: the Muon parameters fall into two sub-groups (8 and 2 Newton-Schulz blocks at W=3),
# whose no-gradient flags go through one all_reduce per step
CASES = {2: [dict(name="w2-gas2-clip", gas=2, clip=0.5)],
         3: [dict(name="w3-gas2-clip-cpu-offload-subgroups", gas=2, clip=0.5,
                  zero=dict(offload_optimizer={"device": "cpu"}, sub_group_size=2000))]}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_zero3_no_gradient_blocks_match_oracle(world_size: int) -> None:
    results = run_distributed(_worker, world_size, CASES[world_size])
    for case, res in zip(CASES[world_size], results[0]):
        name, init, after = case["name"], res["init"], res["after"]
        assert res["tags"]["w_in"] and res["tags"]["side.weight"] and not res["tags"]["side.bias"]
        # one all_reduce of every Muon sub-group's flags per optimizer step, none on accumulation micro-steps
        assert "subgroups" not in name or len(res["blocks"]) >= 2, res["blocks"]
        steps = [c for c in res["flag_collectives"] if c]
        assert len(steps) == STEPS and all(c == [sum(res["blocks"])] for c in steps), res["flag_collectives"]
        for pname, err in res["errors"].items():
            assert err["rel"] <= PARITY_RTOL, f"{name}: {pname} rel error {err['rel']:.2e}"
            assert err["moved"] > 0 and err["rel_update"] <= 1e-3, f"{name}: {pname} {err}"
        # the block whose gradient is <= 0 everywhere had a gradient, so it stepped (the parity above, and moved)
        assert res["neg_grad"] == (True, True), (name, res["neg_grad"])
        assert not torch.equal(after[0]["w_out"][NEG], init["w_out"][NEG]), f"{name}: w_out[{NEG}] did not step"
        # the expert no token reached never moved (no update from momentum, no weight decay) ...
        for p in ("w_in", "w_out"):
            assert torch.equal(after[-1][p][DEAD], init[p][DEAD]), f"{name}: idle expert {p}[{DEAD}] moved"
            assert all(not torch.equal(after[-1][p][e], init[p][e]) for e in range(EXPERTS) if e != DEAD)
        # ... and the side branch's Muon weight stood still in step 1, when it had no gradient
        assert torch.equal(after[1]["side.weight"], after[0]["side.weight"]), name
        assert not torch.equal(after[2]["side.weight"], after[1]["side.weight"]), name
        # AdamW: ZeRO-3 steps side.bias with a zero gradient in step 1 (DeepSpeed's Adam runs over the
        # whole flat sub-group), as the oracle does when fed zeros (the parity above). The oracle fed
        # grad=None skips it instead, as torch.optim does: the documented difference, asserted here.
        assert not torch.equal(after[1]["side.bias"], after[0]["side.bias"]), name
        assert res["vs_keep_none"]["side.bias"]["rel_update"] > 1e-2, f"{name}: {res['vs_keep_none']['side.bias']}"
