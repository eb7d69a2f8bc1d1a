"""Host syncs of one ZeRO-3 optimizer step (issue 40, item 3): ds_muon's step makes no host read of its own and at
most as many as DeepSpeed's built-in Muon step.

Counted on the CPU (gloo, W=2) by ``tests/support/host_reads.py: HostReads``: the calls that would make the host wait
for an accelerator, named by their innermost ds_muon or DeepSpeed frame (docs/design.md, "Host syncs of the step").
DeepSpeed makes one per sub-group itself (``get_grad_norm_direct``'s ``torch.tensor(-1.0, device=...)``,
stage3.py:2483), so the comparison with the built-in runs with the same sub-groups on both sides
(``decay_norms_and_biases``: ds_muon's AdamW half in one group, as the built-in's).
"""
from __future__ import annotations

import pytest

from tests.support.spawn import run_distributed

WORLD = 2
DS_MUON, DS_MUON_ONE_ADAMW, BUILTIN = "ds_muon", "ds_muon+decay_norms_and_biases=true", "builtin_muon"


def _sources(result: dict) -> str:
    return "; ".join(f"{n} x {where}" for where, n in sorted(result["sources"].items())) or "none"


@pytest.fixture(scope="module")
def counts() -> list[dict]:
    from tests.support.host_reads import count_steps
    return run_distributed(count_steps, WORLD, [DS_MUON, DS_MUON_ONE_ADAMW, BUILTIN, "ds_muon_overlap"], 1, 1.0)


@pytest.mark.parametrize("arm", [DS_MUON, DS_MUON_ONE_ADAMW, "ds_muon_overlap"])
def test_ds_muon_step_makes_no_host_read_of_its_own(counts, arm):
    for rank, result in enumerate(counts):
        ours = [where for _, where in result[arm]["events"] if where.startswith("ds_muon/")]
        assert not ours, (f"rank {rank}, {arm}: ds_muon's step reads the device on the host at {ours} "
                          f"(all sources: {_sources(result[arm])})")


@pytest.mark.parametrize("arm", [DS_MUON, "ds_muon_overlap"])
def test_flags_are_agreed_before_a_deepspeed_host_read(counts, arm):
    """On an accelerator the flags reach the host by a non-blocking copy; a host read of DeepSpeed's after it (its
    norm check) makes taking them wait for nothing. Agreed after DeepSpeed's last read, taking them would wait (a sync
    the CPU count cannot see): so the order is checked."""
    for rank, result in enumerate(counts):
        timeline = result[arm]["timeline"]
        agreed = [k for k, label in enumerate(timeline) if label == "flags agreed"]
        deepspeed = [k for k, label in enumerate(timeline) if label.startswith("deepspeed/")]
        assert agreed and deepspeed and agreed[-1] < deepspeed[-1], f"rank {rank}, {arm}: {timeline}"


def test_ds_muon_step_makes_at_most_the_builtin_host_syncs(counts):
    for rank, result in enumerate(counts):
        ours, builtin = result[DS_MUON_ONE_ADAMW], result[BUILTIN]
        assert ours["sub_groups"] == builtin["sub_groups"], (ours["sub_groups"], builtin["sub_groups"])
        assert builtin["count"] >= 1, "the counter saw none of the built-in's host syncs"  # the counter works
        assert ours["count"] <= builtin["count"], (
            f"rank {rank}: ds_muon's step makes {ours['count']} host syncs ({_sources(ours)}), the built-in's "
            f"{builtin['count']} ({_sources(builtin)})")
