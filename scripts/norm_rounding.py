"""Whether DeepSpeed's global gradient norm could be computed in one ``get_grad_norm_direct`` call per step instead of
one per sub-group, bit for bit (docs/design.md, "Host syncs of the step"): on random draws, the per-sub-group norms
combined by DeepSpeed's ``combine_grad_norm_groups`` (what ZeRO-3's step does) against one norm over every sub-group's
gradients (what a single call would return), each with the arithmetic of ``get_grad_norm_direct`` at W=1.

    python scripts/norm_rounding.py [--draws 2000] [--sub-groups 3]

Prints how many draws differ in any bit.
"""
from __future__ import annotations

import argparse

import torch


def norm_direct(grads: list[torch.Tensor]) -> torch.Tensor:
    """``get_grad_norm_direct``'s L2 arithmetic on one rank: the per-tensor norms, their squares summed, the root."""
    return torch.sum(torch.pow(torch.stack([g.norm(2.0) for g in grads]), 2.0)) ** 0.5


def main() -> None:
    from deepspeed.runtime.utils import combine_grad_norm_groups
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--sub-groups", type=int, default=3)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    differ = 0
    for _ in range(args.draws):
        groups = [[torch.randn(int(torch.randint(1, 50, (1,), generator=gen)), generator=gen)
                   * float(torch.rand(1, generator=gen) * 10)
                   for _ in range(int(torch.randint(1, 6, (1,), generator=gen)))] for _ in range(args.sub_groups)]
        per_sub_group = combine_grad_norm_groups([norm_direct(g) for g in groups])
        one_call = combine_grad_norm_groups([norm_direct([g for group in groups for g in group])])
        differ += int(not torch.equal(per_sub_group, one_call))
    print(f"{differ} of {args.draws} draws ({args.sub_groups} sub-groups of 1-5 fp32 tensors) differ in the global norm")


if __name__ == "__main__":
    main()
