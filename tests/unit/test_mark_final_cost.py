"""benchmarks/mark_final_cost.py on CPU with the small presets: the sub-groups as DeepSpeed cuts them, the owner
plans in backward order, every owner-plan bucket of every sub-group started once per step by ``mark_final``, and
the table it prints."""
from __future__ import annotations

import sys

from tests.support.tools import repo_module

mark_final_cost = repo_module("benchmarks/mark_final_cost.py")


def test_every_bucket_starts_once_per_step_and_the_table_prints(monkeypatch, capsys) -> None:
    steps, calls = mark_final_cost.preset_steps("moe", reduce_bucket=3000)
    finals = [f for call in calls for f in call]
    every = sorted((i, j) for i, s in steps.items() for j in range(len(s.plan.slots)))
    assert len(calls) > 1 and sorted(finals) == every  # each Muon parameter final once per step
    from ds_muon.sharded import overlap
    starts = []
    real = overlap.SpeculativeMuon.mark_final

    def counting(self, *args, **kwargs):
        before = {(i, k) for i, st in self._state.items() for k, on in enumerate(st.started) if on}
        real(self, *args, **kwargs)
        starts.extend(sorted({(i, k) for i, st in self._state.items() for k, on in enumerate(st.started) if on}
                             - before))
    monkeypatch.setattr(overlap.SpeculativeMuon, "mark_final", counting)
    mark_final_cost.seconds_per_step(steps, calls, 1)
    # each bucket of each sub-group started once, when its last parameter was final
    assert sorted(starts) == sorted((i, k) for i, s in steps.items() for k in range(len(s.plan.buckets))), starts
    monkeypatch.setattr(sys, "argv", ["mark_final_cost.py", "--presets", "tiny,moe", "--steps", "2"])
    mark_final_cost.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| tiny", "| moe"))]
    assert len(rows) == 2 and all(float(r.split("|")[6]) > 0 for r in rows), rows
