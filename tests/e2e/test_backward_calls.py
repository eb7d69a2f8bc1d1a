"""benchmarks/backward_calls.py on the CPU: each arm's Python calls per backward, real engines in fresh processes.

What the diagnostic must get right for its reading ("ds_muon's paused backward is AdamW's plus a few wrappers") to
hold: the profiled backward is the same in every step; with the overlapped step paused nothing of the speculation
runs (no ``mark_final``), while with it running ``mark_final`` is called once per reduce bucket; the differences
are keyed so that a built-in at another address in another process is the same function.
"""
from __future__ import annotations

import pytest

from tests.support.tools import repo_module

backward_calls = repo_module("benchmarks/backward_calls.py")


def _diff(base: dict, other: dict) -> dict:
    return {name: b - a for name, a, b in backward_calls.call_differences(base, other)}


def _named(counts: dict, file: str, function: str) -> int:
    """The count of ``function`` defined in ``file`` (keys are ``"file:line name"``: the line is left out)."""
    found = [n for key, n in counts.items() if key.startswith(file + ":") and key.endswith(" " + function)]
    assert len(found) == 1, (file, function, found)
    return found[0]


def test_call_differences_key_built_ins_without_their_address() -> None:
    base = {"functions": {"~:0 <built-in method __new__ of type object at 0x7f01>": 5, "a.py:3 f": 2}}
    other = {"functions": {"~:0 <built-in method __new__ of type object at 0x7f99>": 5, "a.py:3 f": 4,
                           "b.py:9 g": 1}}
    assert backward_calls.call_differences(base, other) == [("a.py:3 f", 2, 4), ("b.py:9 g", 0, 1)]


def test_paused_overlap_adds_only_wrappers_and_running_overlap_marks_buckets(capsys) -> None:
    arms = "adamw:bench.clip=0,ds_muon_overlap:bench.clip=0:bench.pause=true,ds_muon_overlap:bench.clip=0"
    adamw, paused, running = backward_calls.main(["--arms", arms, "--layers", "2", "--reduce-bucket", "20000",
                                                  "--steps", "2"])
    for r in (adamw, paused, running):
        assert len(r["calls"]) == 2 and len(set(r["calls"])) == 1, r["calls"]  # the same backward every step
        assert r["reduce_bucket_size"] == 20000  # the same bucket in every arm
    hooks = _named(paused["functions"], "zero3.py", "reduce_ready_partitions_and_remove_grads")
    assert hooks > 0
    extra = _diff(adamw, paused)
    # paused: one error-naming wrapper per gradient hook, nothing of the speculation
    epilogue = _named(paused["functions"], "zero3.py", "independent_gradient_partition_epilogue")
    # a generator: entered and left
    assert _named(extra, "collectives.py", "named_collective") == 2 * (hooks + epilogue)
    assert not any("mark_final" in name for name in extra), extra
    assert 0 < paused["calls"][0] - adamw["calls"][0] < 0.05 * adamw["calls"][0]
    assert _named(_diff(paused, running), "overlap.py", "mark_final") > 0  # running: buckets start in backward
    # the profile holds backward alone: none of the model's forward methods, none of the optimizer step's
    for r in (adamw, paused, running):
        assert not [k for k in r["functions"] if k.startswith("model.py:") or k.endswith(" step")], r["arm"]
    out = capsys.readouterr().out
    assert "| adamw:bench.clip=0 | 2e+04 |" in out and "named_collective" in out


def test_pause_refused_where_no_overlap_runs() -> None:
    with pytest.raises(RuntimeError, match="bench.pause needs the overlapped Muon step running"):
        backward_calls.run_arm("ds_muon_nooverlap:bench.clip=0:bench.pause=true", 2, 20000, 1)


def test_forward_phase_the_builtin_arm_and_split_groups(monkeypatch, capsys) -> None:
    """``--phase forward`` profiles the forward alone; the ``builtin_muon`` arm runs DeepSpeed's own Muon where ds_muon
    is installed (its worker starts with ``DS_MUON=0`` and checks the engine's optimizer: none of ds_muon's wrappers
    runs); ``bench.split_groups`` builds AdamW with the Muon engines' two parameter groups and the same forward; the
    engine settings the forward reads (with a persistence threshold that gathers the matrices, as at full size)
    differ between AdamW and the built-in only in ``reduce_scatter`` and the parameters' tags."""
    monkeypatch.setenv("DS_MUON", "1")  # as a user's shell: ds_muon's autoload on (this suite's conftest sets 0)
    arms = ("adamw:bench.clip=0,adamw:bench.clip=0:bench.split_groups=true,"
            "builtin_muon:reduce_scatter=false:bench.clip=0")
    adamw, split, builtin = backward_calls.main(["--arms", arms, "--layers", "2", "--reduce-bucket", "20000",
                                                 "--steps", "2", "--phase", "forward", "--persistence-threshold",
                                                 "1000"])
    assert [r["phase"] for r in (adamw, split, builtin)] == ["forward"] * 3
    assert (adamw["param_groups"], split["param_groups"], builtin["param_groups"]) == (1, 2, 2)
    for r in (adamw, split, builtin):
        assert any(k.startswith("model.py:") for k in r["functions"]), r["arm"]  # the model's forward ran
        assert not any(k.endswith(" backward") for k in r["functions"]), r["arm"]
        assert not any(k.startswith(("collectives.py:", "zero3.py:")) for k in r["functions"]), r["arm"]
    assert split["calls"] == adamw["calls"]
    # the engine settings the forward reads: the split changes none; the built-in only its reduce_scatter and the
    # parameters' tags (the coordinator's limits, persistence and hook counts are AdamW's)
    assert {"coordinator.prefetch_bucket_sz", "coordinator.max_n_available_params", "zero.stage", "persistent",
            "module_hooks"} <= set(adamw["settings"])
    persistent = adamw["settings"]["persistent"].split(",")   # the threshold of 1000: matrices gathered, norms kept
    assert "layers.0.attn_norm.weight" in persistent and "layers.0.attn.q_proj.weight" not in persistent
    assert adamw["settings"]["zero.param_persistence_threshold"] == "1000"
    assert backward_calls.settings_differences(adamw, split) == []
    diff = {name: (a, b) for name, a, b in backward_calls.settings_differences(adamw, builtin)}
    assert set(diff) == {"zero.reduce_scatter", "param_attrs"}, diff
    assert diff["zero.reduce_scatter"] == ("True", "False")
    assert "use_muon" in diff["param_attrs"][1].split(",") and diff["param_attrs"][0] == ""
    out = capsys.readouterr().out
    assert "engine settings that differ" in out and "zero.reduce_scatter: True -> False" in out
