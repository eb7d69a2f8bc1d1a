"""benchmarks/mark_final_cost.py on CPU with the small presets: the owner plan of a preset's Muon parameters in
backward order, every owner-plan bucket started once per step by ``mark_final``, and the table it prints."""
from __future__ import annotations

import sys

from tests.support.tools import repo_module

mark_final_cost = repo_module("benchmarks/mark_final_cost.py")


def test_every_bucket_starts_once_per_step_and_the_table_prints(monkeypatch, capsys) -> None:
    step, n = mark_final_cost.preset_plan_step("moe")
    assert n == len(step.plan.slots) and len(step.plan.buckets) >= 1
    from ds_muon.sharded import overlap
    starts = []
    real = overlap.SpeculativeMuon.mark_final

    def counting(self, *args, **kwargs):
        before = sum(sum(st.started) for st in self._state.values())
        real(self, *args, **kwargs)
        starts.append(sum(sum(st.started) for st in self._state.values()) - before)
    monkeypatch.setattr(overlap.SpeculativeMuon, "mark_final", counting)
    seconds, calls = mark_final_cost.seconds_per_step(step, n, steps=1, per_call=3)
    assert seconds > 0 and calls == len(starts) == -(-n // 3)
    assert sum(starts) == len(step.plan.buckets)  # each bucket started once, when its last parameter was final
    monkeypatch.setattr(sys, "argv", ["mark_final_cost.py", "--presets", "tiny,moe", "--steps", "2"])
    mark_final_cost.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| tiny", "| moe"))]
    assert len(rows) == 2 and all(float(r.split("|")[5]) > 0 for r in rows), rows
