"""Microbenchmark of the Adam-mini shard step (block sums of g**2, then the update) against AdamW on as many elements.

    python benchmarks/adam_mini_step.py                       # CPU: 2 layers of the 934M preset
    python benchmarks/adam_mini_step.py --layers 16 --out adam_mini_step.json   # GPU: the whole 934M sub-group

Times, on one device and in one process, the step of one Adam-mini sub-group (the decayed blocked parameters of
``examples/model.py``'s preset, ``--layers`` of its decoder layers, laid out as ZeRO-3 lays out rank ``--rank``'s
shard at ``--world`` ranks; blocks from ``--rule``) in its arms:

* ``per-window``: the step before issue 27 (kept here for the comparison): per window of 2^24 elements,
  ``segment_reduce`` of ``g**2`` over the segments, ``index_add_`` into the blocks, and a per-element
  denominator by ``repeat_interleave`` for the update;
* ``tiles``: ds_muon's step (:mod:`ds_muon.core.block_tiles`): one row reduction over the shard's
  ``(tiles, T)`` view, one pass of the element-wise update with a per-tile denominator column, and the
  short boundary region apart; ``tiles-compiled``: the same with the pass as one ``torch.compile``
  kernel (what the ZeRO step runs on CUDA; on CPU only with ``--compile-cpu``, which needs a C++ compiler);
* ``adamw``: ``torch.optim.AdamW`` on one flat parameter of the same element count (``fused=True`` where torch
  has it for the device, else ``foreach``); ``--fused-adam`` adds DeepSpeed's ``FusedAdam`` (CUDA; builds its
  extension the first time, ~1 min).

Each arm runs ``--warmup`` untimed steps, then ``--repeat`` timed ones: wall clock per step and, on CUDA, CUDA
events around each step (and around the block sums alone); the table gives the median and the min-max,
the bytes the arm must move at the least over its median time, and the ratio to AdamW's median. The
all_reduce of the ``n_blocks`` block sums (4 bytes per block) is not timed. Before the timing every arm
takes one step from the same start; for the Adam-mini arms, ``first_step_error`` is the largest difference
of the parameters from that step computed in float64, over the largest update (the per-window arm's
``segment_reduce`` sums long blocks sequentially in fp32 on CPU: errors of 1e-2 of the update on 11M-element
blocks; the tiles: ~1e-6).

Memory: the arms' state (Adam-mini: ``exp_avg`` and one fp32 per block; AdamW: ``exp_avg``, ``exp_avg_sq``) and,
on CUDA, the peak of what one step allocates above it (``torch.cuda.max_memory_allocated``); the index
tensors each ds_muon arm caches (:meth:`ds_muon.core.block_tiles.BlockTiles.nbytes`).

Target (issue 27, one H200, the 934M model, W=1): the Adam-mini optimizer step of the whole ZeRO-3 run
(``benchmarks/step_time.py``) at most 1.1x FusedAdam AdamW's, and its peak memory at most AdamW's; here
that is ``tiles-compiled`` at most 1.1x ``adamw``/``fused-adam`` and a step's extra memory far below the
4 bytes per element of AdamW's second moment.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("per-window", "tiles", "tiles-compiled", "adamw", "fused-adam")
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


# ------------------------------------------------------------------------------------------------
# the step before issue 27 (ds_muon.core.adam_update up to 2026-12-02), for the comparison
# ------------------------------------------------------------------------------------------------
def windows_before(lengths, block_of_segment, n_blocks: int, device, chunk: int = 1 << 24) -> list:
    """``[(start, numel, piece lengths, piece block ids)]``: the segments cut into windows of ``chunk`` elements
    (padding: block ``n_blocks``), as index tensors on ``device``."""
    import torch
    from ds_muon.core.adam_update import cut_windows
    return [(start, sum(pieces), torch.tensor(pieces, dtype=torch.int64, device=device),
             torch.tensor([n_blocks if b < 0 else b for b in blocks], dtype=torch.int64, device=device))
            for start, pieces, blocks in cut_windows(lengths, block_of_segment, chunk)]


def sums_before(grad, windows, n_blocks: int):
    import torch
    sums = torch.zeros(n_blocks + 1, dtype=torch.float32, device=grad.device)
    for start, numel, lengths, block in windows:
        piece = torch.segment_reduce(grad.narrow(0, start, numel).square(), "sum", lengths=lengths, unsafe=True,
                                     initial=0)
        sums.index_add_(0, block, piece)
    return sums[:n_blocks]


def update_before(param, grad, exp_avg, block_v, sums, block_numel, windows, step: int) -> None:
    import torch
    from ds_muon.core.adam_update import adam_apply_, adam_denominator
    beta1, beta2 = BETAS
    block_v.mul_(beta2).add_(sums / block_numel, alpha=1 - beta2)
    denom = adam_denominator(block_v, step, beta2, EPS)
    denom = torch.cat([denom, denom.new_ones(1)])
    for start, numel, lengths, block in windows:
        p, g, m = (t.narrow(0, start, numel) for t in (param, grad, exp_avg))
        adam_apply_(p, g, m, torch.repeat_interleave(denom[block], lengths, output_size=numel), step, LR, beta1, WD)


def reference_first_step(p0, g, windows, n_blocks: int, block_numel):
    """The first Adam-mini step from zero state in float64 (block sums accumulated in float64), window by window:
    ``p0 (1 - lr wd) - lr g / (sqrt(mean_B g^2) + eps)`` with Adam's bias corrections; ``(n,)`` float64."""
    import torch
    g64 = None
    sums = torch.zeros(n_blocks + 1, dtype=torch.float64, device=g.device)
    for start, numel, lengths, block in windows:
        g64 = g.narrow(0, start, numel).double()
        sums.index_add_(0, block, torch.segment_reduce(g64.square(), "sum", lengths=lengths, unsafe=True, initial=0))
    beta1, beta2 = BETAS
    v = (1 - beta2) * sums[:n_blocks] / block_numel.double()
    denom = torch.cat([(v / (1 - beta2)).sqrt() + EPS, v.new_ones(1)])
    out = p0.double().mul_(1 - LR * WD)
    for start, numel, lengths, block in windows:
        m = g.narrow(0, start, numel).double().mul_(1 - beta1)
        d = torch.repeat_interleave(denom[block], lengths, output_size=numel)
        out.narrow(0, start, numel).addcdiv_(m, d, value=-LR / (1 - beta1))
    del g64
    return out


# ------------------------------------------------------------------------------------------------
# the layout
# ------------------------------------------------------------------------------------------------
class _Slot:
    def __init__(self, name, shape, numel, pieces, block):
        self.name, self.shape, self.numel, self.pieces, self.block = name, shape, numel, pieces, block


def shard_layout(model: str, layers: int, rule: str, world: int, rank: int):
    """``(BlockMap, block numel list, shard numel)`` of the preset's decayed Adam-mini sub-group on ``rank``."""
    import torch
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from model import CausalLM, ModelConfig
    from ds_muon.model.adam_mini_blocks import adam_mini_param_groups
    from ds_muon.names import ADAM_MINI, ALGORITHM_KEY, BLOCK_ATTR
    from ds_muon.partitions import chunked_pieces
    from ds_muon.sharded.blocks import build_block_map
    with torch.device("meta"):
        net = CausalLM(ModelConfig.preset(model, n_layers=layers, record_max_logits=False))
    groups = adam_mini_param_groups(net, {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}, rule)
    group = max((g for g in groups if g[ALGORITHM_KEY] == ADAM_MINI), key=lambda g: sum(p.numel() for p in g["params"]))
    names = {id(p): n for n, p in net.named_parameters()}
    slots, offset = [], 0
    for p in group["params"]:
        pieces = chunked_pieces(p.numel(), world, offset)
        slots.append(_Slot(names[id(p)], tuple(p.shape), p.numel(), pieces, getattr(p, BLOCK_ATTR)))
        offset += pieces[0].sent
    block_map = build_block_map(slots, rank, offset, block_numel=lambda s: s.block)
    block_numel = [s.block for s in slots for _ in range(s.numel // s.block)]
    return block_map, block_numel, offset


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def summarize(samples) -> dict:
    """``{"median", "min", "max", "n"}`` of a list of seconds (empty: {})."""
    if not samples:
        return {}
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def time_arm(step_fn, sums_fn, device, warmup: int, repeat: int) -> dict:
    """Wall clock (and on CUDA, CUDA events) of ``step_fn(t)`` over ``repeat`` steps after ``warmup``; CUDA events
    of ``sums_fn()`` alone (the block sums, a pure function); on CUDA the peak bytes a step allocates above
    what was allocated before the timed steps."""
    import torch
    cuda = device.type == "cuda"
    for t in range(warmup):
        step_fn(t + 2)
    wall, events, sums = [], [], []
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for t in range(repeat):
        if cuda and sums_fn is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sums_fn()
            end.record()
            torch.cuda.synchronize(device)
            sums.append(start.elapsed_time(end) / 1e3)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if cuda:
            start.record()
        step_fn(warmup + t + 2)
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            events.append(start.elapsed_time(end) / 1e3)
        wall.append(time.perf_counter() - t0)
    out = {"wall": summarize(wall), "events": summarize(events), "sums_events": summarize(sums)}
    if cuda:
        out["step_peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="934m", help="an examples/model.py preset")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's on CUDA, 2 on CPU)")
    ap.add_argument("--rule", choices=("default", "neuron"), default="default", help="Adam-mini block_rule")
    ap.add_argument("--world", type=int, default=1, help="ZeRO-3 ranks of the layout")
    ap.add_argument("--rank", type=int, default=0, help="whose shard")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--arms", default="per-window,tiles,tiles-compiled,adamw", help=f"comma-separated, of {ARMS}")
    ap.add_argument("--fused-adam", action="store_true", help="also time DeepSpeed's FusedAdam (CUDA)")
    ap.add_argument("--compile-cpu", action="store_true", help="run tiles-compiled on CPU too (inductor, C++)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON results, written after every arm")
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    layers = args.layers or (None if cuda else 2)
    if layers is None:
        sys.path.insert(0, os.path.join(REPO, "examples"))
        from model import ModelConfig
        layers = ModelConfig.preset(args.model).n_layers
    arms = [a for a in args.arms.split(",") if a] + (["fused-adam"] if args.fused_adam else [])
    if device.type != "cuda":
        arms = [a for a in arms if a != "fused-adam" and (a != "tiles-compiled" or args.compile_cpu)]
    t0 = time.perf_counter()
    bm, block_numel, _ = shard_layout(args.model, layers, args.rule, args.world, args.rank)
    n, nb = sum(bm.lengths), bm.n_blocks
    layout_s = time.perf_counter() - t0
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(n, device=device, generator=gen).mul_(1e-3)
    p0 = torch.randn(n, device=device, generator=gen).mul_(0.02)
    numel_t = torch.tensor(block_numel, dtype=torch.float32, device=device)
    result = {"model": args.model, "layers": layers, "rule": args.rule, "world": args.world, "rank": args.rank,
              "device": str(device), "torch": torch.__version__, "numel": n, "n_blocks": nb,
              "segments": len(bm.lengths), "layout_s": layout_s, "arms": {}}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(device)
    print(f"{args.model} x {layers} layers, rule {args.rule}, W={args.world} rank {args.rank}: shard {n} fp32 "
          f"elements, {nb} blocks, {len(bm.lengths)} segments; {device} ({result.get('gpu', 'cpu')}), torch "
          f"{torch.__version__}", flush=True)
    reference = None
    if any(a in ("per-window", "tiles", "tiles-compiled") for a in arms):
        reference = reference_first_step(p0, g, windows_before(bm.lengths, bm.block_of_segment, nb, device), nb, numel_t)
        update_size = float((reference - p0.double()).abs().max())
    for arm in arms:
        p = p0.clone()
        step_fn, sums_fn, info = make_arm(arm, p, g, bm, numel_t, device)
        t1 = time.perf_counter()
        step_fn(1)  # one step from the common start (and the compile, for tiles-compiled)
        if cuda:
            torch.cuda.synchronize(device)
        info["first_step_s"] = time.perf_counter() - t1
        if arm in ("per-window", "tiles", "tiles-compiled"):
            info["first_step_error"] = float((p.double() - reference).abs().max()) / update_size
        info.update(time_arm(step_fn, sums_fn, device, args.warmup, args.repeat))
        result["arms"][arm] = info
        del p, step_fn, sums_fn
        if cuda:
            torch.cuda.empty_cache()
        print(_row(arm, info, result["arms"].get("adamw"), n), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    print_table(result)


def make_arm(arm: str, p, g, bm, numel_t, device):
    """``(step_fn(t), sums_fn or None, info)`` of one arm on the parameters ``p`` (updated in place) and gradient
    ``g``; its state is created here (zeros) and lives as long as ``step_fn``."""
    import torch
    from ds_muon.core import adam_update as au
    n, nb = p.numel(), bm.n_blocks
    info: dict = {}
    if arm not in ("per-window", "tiles", "tiles-compiled"):
        param = torch.nn.Parameter(p)
        param.grad = g
        if arm == "fused-adam":
            from deepspeed.ops.adam import FusedAdam
            opt = FusedAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=True)
            info["implementation"] = "deepspeed FusedAdam"
        else:
            try:
                opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
                info["implementation"] = "torch.optim.AdamW(fused=True)"
            except (RuntimeError, TypeError):
                opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
                info["implementation"] = "torch.optim.AdamW(foreach=True)"
        info["state_bytes"] = 8 * n
        return (lambda t: opt.step()), None, info
    m = torch.zeros_like(p)
    v = torch.zeros(nb, device=device)
    info["state_bytes"] = 4 * (n + nb)
    t1 = time.perf_counter()
    if arm == "per-window":
        windows = windows_before(bm.lengths, bm.block_of_segment, nb, device)
        info.update(build_s=time.perf_counter() - t1, windows=len(windows))
        sums_fn = lambda: sums_before(g, windows, nb)  # noqa: E731
        return (lambda t: update_before(p, g, m, v, sums_fn(), numel_t, windows, t)), sums_fn, info
    windows = au.shard_chunks(bm.lengths, bm.block_of_segment, nb, device)
    info.update(build_s=time.perf_counter() - t1, windows=len(windows), tile=[w.tile for w in windows],
                mixed_numel=sum(w.mixed_numel for w in windows), index_bytes=sum(w.nbytes() for w in windows))
    compiled = arm == "tiles-compiled"
    sums_fn = lambda: au.block_square_sums(g, windows, nb)  # noqa: E731
    return (lambda t: au.adam_mini_shard_update_(p, g, m, v, sums_fn(), numel_t, windows, t, LR, BETAS, EPS, WD,
                                                 compiled=compiled)), sums_fn, info


def _least_bytes(arm: str, n: int) -> int:
    """Bytes an arm must move at the least per element x n: Adam-mini reads g for the sums, then p, g, m and
    writes p, m (24); AdamW reads p, g, m, v and writes p, m, v (28)."""
    return (24 if arm.startswith(("tiles", "per-window")) else 28) * n


def _row(arm: str, info: dict, adamw, n: int) -> str:
    t = info["events"] or info["wall"]
    ratio = f"{t['median'] / (adamw['events'] or adamw['wall'])['median']:.2f}x" if adamw else ""
    sums = f"{info['sums_events']['median'] * 1e3:.2f}" if info.get("sums_events") else ""
    extra = info.get("step_peak_extra_bytes")
    extra = "" if extra is None else f"{extra / 2**20:.0f}"
    return (f"| {arm} | {t['median'] * 1e3:.2f} | {t['min'] * 1e3:.2f}-{t['max'] * 1e3:.2f} | "
            f"{info['wall']['median'] * 1e3:.2f} | {sums} | {_least_bytes(arm, n) / t['median'] / 1e9:.0f} | {ratio} | "
            f"{info['state_bytes'] / 2**30:.2f} | {extra} | {info.get('index_bytes', 0) / 2**20:.2f} |")


HEADER = ("| arm | step ms (median; CUDA events on GPU) | min-max ms | wall ms (median) | block sums ms (median) | "
          "GB/s (least bytes) | / adamw | state GiB | step extra MiB (GPU) | cached index MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def print_table(result: dict) -> None:
    """The arms as a markdown table (the ratio column against the ``adamw`` arm of the same run)."""
    print(f"\n{result['model']} x {result['layers']} layers, rule {result['rule']}, W={result['world']}: "
          f"{result['numel']} elements, {result['n_blocks']} blocks, {result['segments']} segments, "
          f"{result['device']} {result.get('gpu', '')}, torch {result['torch']}")
    print(HEADER)
    adamw = result["arms"].get("adamw")
    for arm, info in result["arms"].items():
        print(_row(arm, info, adamw, result["numel"]))
    for arm, info in result["arms"].items():
        details = {k: info[k] for k in ("implementation", "windows", "tile", "mixed_numel", "build_s", "first_step_s",
                                        "first_step_error") if k in info}
        print(f"{arm}: {details}")


if __name__ == "__main__":
    main()
