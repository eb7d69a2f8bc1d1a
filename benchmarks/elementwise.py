"""Microbenchmark of the Muon step's element-wise work on one rank's shard: eager vs. fused.

    python benchmarks/elementwise.py [--numel 400000000] [--repeat 20] [--out elementwise.json]

Times, on one GPU and an fp32 shard of ``--numel`` elements (934M model at W=2: ~400M Muon elements per
rank), the two element-wise phases of :mod:`ds_muon.sharded.muon_step`:

* momentum: ``m <- lerp(m, g, 1-beta)``; ``u <- lerp(g, m, beta)`` into ``g`` (Nesterov). Eager: two
  kernels, 24 bytes per element; fused (:func:`ds_muon.core.muon_update.fused_momentum_update_`): one kernel, 16.
* apply: ``p <- p (1 - lr wd) - lr o``. Eager: two kernels, 20 bytes per element; fused
  (:func:`ds_muon.core.muon_update.fused_apply_update_`): one kernel, 12.

For each it prints the time, the bytes the kernels must move at the least (the count above) over that
time as GB/s, that rate as a fraction of the device's copy bandwidth measured in the same process
(``copy_`` of the same size: 8 bytes per element), and the largest difference of the fused result from
the eager one (relative to the largest magnitude; fp32 rounding: a few 1e-7). It also counts
``torch.compile`` graphs after calls with three shard sizes and two learning rates (one per fused
function is the goal: no recompiles).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _time(fn, repeat: int) -> float:
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=400_000_000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    import torch
    from torch._dynamo.utils import counters

    from ds_muon.core.muon_update import fused_apply_update_, fused_momentum_update_, momentum_update_
    device = torch.device("cuda", 0)
    n, beta, lr, wd = args.numel, 0.95, 0.02, 0.1
    gen = torch.Generator(device=device).manual_seed(0)
    m, g, p = (torch.randn(n, device=device, generator=gen) for _ in range(3))
    m0, g0, p0 = m.clone(), g.clone(), p.clone()
    copy_rate = 8 * n / _time(lambda: m.copy_(g), args.repeat) / 1e9
    m.copy_(m0)

    def check(fused, eager) -> float:
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(fused, eager))

    rows = []
    # momentum + Nesterov blend (momentum_update_ writes u into g)
    eager_m, eager_g = m0.clone(), g0.clone()
    momentum_update_(eager_m, eager_g, beta, True)
    fused_momentum_update_(m, g, beta, True)
    diff = check((m, g), (eager_m, eager_g))
    for label, fn, nbytes in (("momentum eager", lambda: momentum_update_(m, g, beta, True), 24),
                              ("momentum fused", lambda: fused_momentum_update_(m, g, beta, True), 16)):
        sec = _time(fn, args.repeat)
        rows.append(dict(phase=label, ms=sec * 1e3, gbps=nbytes * n / sec / 1e9, of_copy=nbytes * n / sec / 1e9 / copy_rate,
                         max_rel_diff=diff if "fused" in label else 0.0))
    # decoupled weight decay + apply
    eager_p = p0.clone()
    eager_p.mul_(1 - lr * wd).add_(g0, alpha=-lr)
    p.copy_(p0)
    fused_apply_update_(p, g0, lr, wd)
    diff = check((p,), (eager_p,))
    for label, fn, nbytes in (("apply eager", lambda: p.mul_(1 - lr * wd).add_(g0, alpha=-lr), 20),
                              ("apply fused", lambda: fused_apply_update_(p, g0, lr, wd), 12)):
        sec = _time(fn, args.repeat)
        rows.append(dict(phase=label, ms=sec * 1e3, gbps=nbytes * n / sec / 1e9, of_copy=nbytes * n / sec / 1e9 / copy_rate,
                         max_rel_diff=diff if "fused" in label else 0.0))
    # recompiles: other shard sizes and learning rates
    for size in (n // 3 + 1, n // 7 + 5):
        for rate in (0.01, 0.005):
            fused_momentum_update_(m[:size], g[:size], beta, True)
            fused_apply_update_(p[:size], g[:size], rate, wd)
    graphs = int(counters["stats"].get("unique_graphs", 0))
    print(f"shard {n} fp32 elements; copy bandwidth {copy_rate:.0f} GB/s (8 bytes per element copied)")
    print("| phase | ms | GB/s (least bytes) | of copy bandwidth | max |fused - eager| / max |eager| |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['ms']:.2f} | {r['gbps']:.0f} | {r['of_copy']:.0%} | {r['max_rel_diff']:.1e} |")
    print(f"torch.compile graphs after 3 shard sizes x 3 learning rates: {graphs} (2 = no recompiles)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"numel": n, "copy_gbps": copy_rate, "rows": rows, "compiled_graphs": graphs}, f, indent=2)


if __name__ == "__main__":
    main()
