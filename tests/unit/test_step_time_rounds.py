"""benchmarks/step_time.py's driver on CPU, without a GPU or a worker: arms with ZeRO overrides, the settings the
table states, rounds in the order A B C A B C, the aggregate of several rounds (median over all steps, the spread
of the per-round medians, failed rounds counted) and ``--out`` rewritten after every arm, the workers replaced by
a stub that writes what a worker writes."""
from __future__ import annotations

import json
import os
import statistics
import sys
import types

import pytest
import torch

from tests.support.tools import repo_module

step_time = repo_module("benchmarks/step_time.py")


def test_arms_with_zero_overrides_and_their_settings() -> None:
    assert step_time.parse_arm("adamw") == ("adamw", {})
    assert step_time.parse_arm("ds_muon:reduce_scatter=false:overlap_comm=false:sub_group_size=1e9") == (
        "ds_muon", {"reduce_scatter": False, "overlap_comm": False, "sub_group_size": 1e9})
    with pytest.raises(ValueError, match="unknown optimizer 'adamx'"):
        step_time.parse_arm("adamx")
    with pytest.raises(ValueError, match="not key=value"):
        step_time.parse_arm("adamw:reduce_scatter")
    zero = step_time.ds_config("adamw:reduce_scatter=false", 4, 3)["zero_optimization"]
    assert zero == {"stage": 3, "overlap_comm": True, "reduce_scatter": False}
    # the built-in refuses reduce_scatter with Muon at stage 3, takes it at stages 1/2
    assert step_time.ds_config("builtin_muon", 4, 3)["zero_optimization"]["reduce_scatter"] is False
    assert step_time.ds_config("builtin_muon", 4, 2)["zero_optimization"]["reduce_scatter"] is True
    assert step_time.arm_settings("adamw", 4) == ("ZeRO 3, overlap_comm=true, reduce_scatter=true, bf16, clip 1.0, "
                                                  "micro-batch 4")
    gram = step_time.arm_settings("ds_muon_gram:reduce_scatter=false", 4, 2)
    assert gram.startswith("ZeRO 2, overlap_comm=true, reduce_scatter=false, ") and 'ns_method="gram"' in gram \
        and 'exchange_dtype="bfloat16"' in gram
    assert "ns_method" not in step_time.arm_settings("ds_muon", 4)


def _result(arm: str, steps: list, fwd: list, peak: float = 10.0) -> dict:
    samples = {"step_s": steps, "fwd_bwd_s": fwd, "opt_step_s": [a - b for a, b in zip(steps, fwd)]}
    samples.update({f"{k}_events": [x * 0.99 for x in v] for k, v in list(samples.items())})
    out = dict(optimizer=arm, samples=samples, **{k: statistics.median(v) for k, v in samples.items()},
               peak_gib=peak, peak_fwd_bwd_gib=peak, peak_step_gib=peak - 1, comm_total=2**20, opt_state_gib=1.0,
               world=1)
    if arm.startswith("ds_muon"):
        out.update(ns_floor_s=0.05, ns_gflop_per_rank_max=40.0, matmul_tflops=800.0, imbalance=1.0,
                   compiled_graphs=2)
    return out


def test_aggregate_of_rounds() -> None:
    r1 = _result("adamw", [0.30, 0.31, 0.29], [0.27, 0.28, 0.26], peak=20.0)
    r2 = _result("adamw", [0.40, 0.41, 0.39, 0.42], [0.37, 0.38, 0.36, 0.39], peak=21.0)
    agg = step_time.aggregate_rounds([r1, {"error": "exit 1"}, r2])
    assert agg["rounds"] == 3 and agg["rounds_ok"] == 2 and agg["round_errors"] == ["exit 1"]
    assert agg["step_s"] == statistics.median(r1["samples"]["step_s"] + r2["samples"]["step_s"])
    spread = agg["spread"]["step_s"]
    assert spread["round_medians"] == [0.30, 0.405] and (spread["min"], spread["max"]) == (0.30, 0.405)
    assert spread["steps"] == 7 and spread["q1"] < agg["step_s"] < spread["q3"]
    assert agg["step_s_events"] == pytest.approx(0.99 * agg["step_s"])
    assert agg["peak_gib"] == 21.0 and "samples" not in agg
    assert step_time.timing_cell(agg, "step_s") == "0.390 (0.300-0.405)"
    one = step_time.aggregate_rounds([r1])
    assert step_time.timing_cell(one, "step_s") == "0.300 (0.295-0.305)"  # one round: the steps' quartiles
    legacy = step_time.aggregate_rounds([{k: v for k, v in r1.items() if k != "samples"}])
    assert legacy["step_s"] == 0.30 and legacy["spread"]["step_s"]["steps"] == 1
    assert step_time.aggregate_rounds([{"error": "exit 1"}, {"error": "exit 9"}]) == {"error": "exit 1; exit 9",
                                                                                      "rounds": 2}


def test_rounds_alternate_and_out_is_written_after_every_arm(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "results.json"
    calls, seen = [], []

    class Done:
        returncode = 0

    def fake_run(cmd, **kwargs):  # what one torchrun worker group does: write its result to its --out
        arm, path = cmd[cmd.index("--optimizer") + 1], cmd[cmd.index("--out") + 1]
        calls.append(arm)
        seen.append(json.loads(out.read_text()) if out.exists() else None)
        if arm == "builtin_muon" and len(calls) > 3:
            failed = Done()
            failed.returncode = 1
            return failed
        k = len(calls)
        result = _result(arm, [0.3 + 0.01 * k, 0.31 + 0.01 * k], [0.2, 0.21])
        assert cmd[cmd.index("--loop-steps") + 1] == "3"
        result["samples"]["loop_step_s"] = [0.25 + 0.01 * k]  # one value per round (training_loop_seconds)
        result["loop_step_s"] = 0.25 + 0.01 * k
        with open(path, "w") as f:
            json.dump(result, f)
        return Done()

    monkeypatch.setattr(step_time.subprocess, "run", fake_run)
    arms = "adamw,builtin_muon,ds_muon:reduce_scatter=false"
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers", arms, "--rounds", "2",
                                      "--no-ns-micro", "--loop-steps", "3", "--out", str(out)])
    step_time.main()
    assert calls == arms.split(",") * 2
    # before each worker group, --out holds every arm that finished before it
    assert seen[0] is None and list(seen[1]) == ["adamw"] and list(seen[3]) == arms.split(",")
    assert seen[4]["adamw"]["rounds"] == 2 and seen[4]["builtin_muon"]["rounds"] == 1
    final = json.loads(out.read_text())
    assert final["builtin_muon"]["rounds_ok"] == 1 and final["builtin_muon"]["round_errors"] == ["exit 1"]
    ds = final["ds_muon:reduce_scatter=false"]
    assert ds["settings"].startswith("ZeRO 3, overlap_comm=true, reduce_scatter=false")
    assert ds["spread"]["step_s"]["round_medians"] == pytest.approx([0.335, 0.365])  # calls 3 and 6
    assert len(ds["round_results"]) == 2
    assert ds["loop_step_s"] == pytest.approx(0.295) and ds["spread"]["loop_step_s"]["round_medians"] == \
        pytest.approx([0.28, 0.31])  # the median of the rounds' loop times
    table = capsys.readouterr().out
    assert "| ds_muon:reduce_scatter=false | ZeRO 3, overlap_comm=true, reduce_scatter=false" in table
    assert "1 of 2 rounds failed: exit 1" in table and "median over all timed steps of 2 round(s)" in table
    assert "| loop s/step |" in table and "| 0.295 (0.280-0.310) |" in table
    assert "ds_muon/built-in in a training loop (no sync between phases): " in table


def test_rotated_rounds_put_every_arm_in_every_place() -> None:
    calls = []

    def run_arm(arm, rnd):
        calls.append((rnd, arm))
        return {"error": "exit 1"} if (rnd, arm) == (2, "A") else {"step_s": 0.3}

    raw = step_time.run_rounds(["A", "B", "C"], 3, run_arm, rotate=True)
    assert [a for _, a in calls] == list("ABCBCACAB") and [r for r, _ in calls] == [0] * 3 + [1] * 3 + [2] * 3
    for arm in "ABC":  # once in each place of the round
        assert sorted(r["round_position"] for r in raw[arm]) == [0, 1, 2]
    assert raw["A"][2] == {"error": "exit 1", "round_position": 1}
    assert step_time.aggregate_rounds(raw["A"])["round_errors"] == ["exit 1"]
    # without rotate: A B C in every round
    assert step_time.round_order(["A", "B", "C"], 4) == ["A", "B", "C"]
    assert step_time.round_order(["A", "B", "C"], 4, rotate=True) == ["B", "C", "A"]
    assert [r["round_position"] for r in step_time.run_rounds(["A", "B"], 2, lambda a, r: {})["B"]] == [1, 1]


def test_place_table_lists_each_round_by_its_place() -> None:
    def result(steps, place):
        return dict(_result("x", steps, [0.2] * len(steps)), round_position=place)

    rotated = {"adamw": {"round_results": [result([0.30, 0.32, 0.31], 0), result([0.40], 1)]},
               "ds_muon": {"round_results": [result([0.35], 1), {"error": "exit 1", "round_position": 0}]}}
    rows = step_time.place_table(rotated)
    assert rows[0].startswith("| arm | round | place in round | step s | fwd+bwd s |")
    assert rows[2] == "| adamw | 1 | 1 | 0.310 | 0.200 | 0.110 |  |"
    assert rows[3].startswith("| adamw | 2 | 2 | 0.400 |") and rows[5] == "| ds_muon | 2 | 1 | failed: exit 1 | | | |"
    fixed = {"adamw": {"round_results": [result([0.3], 0), result([0.3], 0)]}, "ds_muon": {"round_results": []}}
    assert step_time.place_table(fixed) == [] and step_time.place_table({"adamw": {}}) == []


def test_sync_points_name_the_lines_that_wait(monkeypatch) -> None:
    """``--sync-debug``'s collector: each "synchronizing" warning counted at the line that raised it (on a GPU
    torch raises them in sync debug mode; here a stand-in warns, since the CPU build has no such mode); other
    warnings are not counted, and the mode is set back to "default" after."""
    import warnings

    import torch
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")  # the line reported
        warnings.warn("something else")

    found = step_time.sync_points(step)
    line = step.__code__.co_firstlineno + 2
    assert found == {f"tests/unit/test_step_time_rounds.py:{line}": 2}, found
    assert modes == ["warn", "default"]


def test_step_medians_leave_out_timings_not_taken() -> None:
    """A worker run without ``--loop-steps`` has no ``loop_step_s`` samples: the result leaves the key out (its
    median of nothing failed every such worker on the GPU, 2026-12-03) and keeps the medians of the rest."""
    samples = {k: [0.3, 0.1, 0.2] for k in step_time.TIMINGS if k != "loop_step_s"}
    samples["loop_step_s"] = []
    kept, medians = step_time.step_medians(samples)
    assert "loop_step_s" not in kept and "loop_step_s" not in medians
    assert medians["step_s"] == 0.2 and set(medians) == set(step_time.TIMINGS) - {"loop_step_s"}


def _fake_workers(monkeypatch, calls: list, cut_at: int = 0, envs: dict = None):
    """``subprocess.run`` as torchrun: write a worker result to the command's --out; the ``cut_at``-th call raises
    KeyboardInterrupt instead (a device call's time limit killing the driver mid-round); ``envs``, where given, gets
    each arm's worker environment."""
    class Done:
        returncode = 0

    def fake_run(cmd, env=None, **kwargs):
        arm, path = cmd[cmd.index("--optimizer") + 1], cmd[cmd.index("--out") + 1]
        calls.append(cmd)
        if envs is not None:
            envs[arm] = env
        if len(calls) == cut_at:
            raise KeyboardInterrupt
        with open(path, "w") as f:
            json.dump(_result(arm, [0.3 + 0.01 * len(calls)], [0.2]), f)
        return Done()

    monkeypatch.setattr(step_time.subprocess, "run", fake_run)


def _arm(cmd) -> str:
    return cmd[cmd.index("--optimizer") + 1]


def test_resume_runs_only_the_rounds_a_cut_run_lacks(tmp_path, monkeypatch, capsys) -> None:
    """A rotated run (A B, B A, A B) cut in the middle of round 2, resumed: the 3 missing arm-rounds run in their
    places, the 3 kept are unchanged; a resume of a complete file runs nothing and rewrites --out whole."""
    out, calls = tmp_path / "results.json", []
    _fake_workers(monkeypatch, calls, cut_at=4)
    argv = ["step_time.py", "--nproc", "1", "--optimizers", "adamw,ds_muon", "--rounds", "3", "--rotate",
            "--no-ns-micro", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        step_time.main()
    assert [_arm(c) for c in calls] == ["adamw", "ds_muon", "ds_muon", "adamw"]
    cut = json.loads(out.read_text())
    assert [len(cut[a]["round_results"]) for a in ("adamw", "ds_muon")] == [1, 2]
    resumed = tmp_path / "resumed.json"
    monkeypatch.setattr(sys, "argv", argv[:-1] + [str(resumed), "--resume", str(out)])
    calls.clear()
    step_time.main()
    assert [_arm(c) for c in calls] == ["adamw", "adamw", "ds_muon"]  # round 2's second place, then round 3
    final = json.loads(resumed.read_text())
    assert [r["round_position"] for r in final["adamw"]["round_results"]] == [0, 1, 0]
    assert [r["round_position"] for r in final["ds_muon"]["round_results"]] == [1, 0, 1]
    assert final["adamw"]["round_results"][:1] == cut["adamw"]["round_results"]
    assert final["ds_muon"]["rounds"] == 3 and final["ds_muon"]["run"]["arms"] == ["adamw", "ds_muon"]
    # nothing missing: no worker, the table printed, and --out (here the resumed file itself) keeps every arm
    calls.clear()
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", argv[:-1] + [str(resumed), "--resume", str(resumed)])
    step_time.main()
    assert calls == [] and json.loads(resumed.read_text()) == final
    assert "| ds_muon | ZeRO 3" in capsys.readouterr().out
    # a file written before `taskset` and `arms` were recorded resumes where those are at their old values
    old = {arm: dict(v, run={k: w for k, w in v["run"].items() if k not in ("taskset", "arms")})
           for arm, v in cut.items()}
    (tmp_path / "old.json").write_text(json.dumps(old))
    calls.clear()
    monkeypatch.setattr(sys, "argv", argv[:-1] + [str(tmp_path / "again.json"), "--resume", str(tmp_path / "old.json")])
    step_time.main()
    assert len(calls) == 3
    # a resume with other options, other arms or another order is refused before any worker starts
    calls.clear()
    for bad, match in ((["--steps", "7"], "was measured with"), (["--optimizers", "adamw"], "not in --optimizers"),
                       (["--optimizers", "ds_muon,adamw"], "was measured with"),
                       (["--rounds", "1"], "more than --rounds 1")):
        monkeypatch.setattr(sys, "argv", argv + ["--resume", str(out)] + bad)
        with pytest.raises(ValueError, match=match):
            step_time.main()
    assert calls == []


def test_taskset_pins_every_worker_group(tmp_path, monkeypatch) -> None:
    """``--taskset 0`` puts ``taskset -c 0`` before every worker group's torchrun, a resume must repeat it, and a
    CPU list this process may not use, or no taskset on PATH, fails before any worker starts."""
    out, calls = tmp_path / "results.json", []
    _fake_workers(monkeypatch, calls)
    monkeypatch.setattr(step_time.shutil, "which", lambda name: "/usr/bin/" + name)
    argv = ["step_time.py", "--nproc", "1", "--optimizers", "adamw", "--rounds", "2", "--no-ns-micro",
            "--out", str(out)]
    cpu = str(min(os.sched_getaffinity(0)))
    monkeypatch.setattr(sys, "argv", argv + ["--taskset", cpu])
    step_time.main()
    assert len(calls) == 2 and all(c[:4] == ["taskset", "-c", cpu, sys.executable] for c in calls)
    assert json.loads(out.read_text())["adamw"]["run"]["taskset"] == cpu
    monkeypatch.setattr(sys, "argv", argv + ["--resume", str(out)])  # without --taskset: refused
    with pytest.raises(ValueError, match="was measured with"):
        step_time.main()
    calls.clear()
    for bad, match in (("0-x", "not a CPU list"), (str(max(os.sched_getaffinity(0)) + 1), "are not among")):
        monkeypatch.setattr(sys, "argv", argv + ["--taskset", bad])
        with pytest.raises(ValueError, match=match):
            step_time.main()
    assert step_time.parse_cpus("0-2,5") == {0, 1, 2, 5}
    monkeypatch.setattr(step_time.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", argv + ["--taskset", cpu])
    with pytest.raises(SystemExit, match="needs util-linux's taskset"):
        step_time.main()
    assert calls == []
    monkeypatch.setattr(sys, "argv", argv)
    step_time.main()
    assert calls[0][0] == sys.executable  # no --taskset: no prefix


def test_host_counters_sum_the_affine_cpus(tmp_path) -> None:
    """``host_counters`` reads /proc/stat's per-CPU lines of the given CPUs only: busy = user + nice + system +
    irq + softirq (not idle, iowait or steal), steal apart; an unreadable file gives no counters."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 900 900 900 900 900 900 900 0 0\n"
                    "cpu0 1 2 4 1000 2000 8 16 32 0 0\n"
                    "cpu1 100 200 400 5000 6000 800 1600 3200 0 0\n"
                    "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    one = step_time.host_counters(str(stat), cpus={1})
    assert one["busy_s"] == pytest.approx(3100 / hz) and one["steal_s"] == pytest.approx(3200 / hz)
    both = step_time.host_counters(str(stat), cpus={0, 1})
    assert both["busy_s"] == pytest.approx(3131 / hz) and both["steal_s"] == pytest.approx(3232 / hz)
    assert isinstance(both["nivcsw"], int)
    assert step_time.host_counters(str(tmp_path / "missing")) == {}


def test_host_counters_see_this_process_and_others() -> None:
    """On this machine: the busy seconds of this process's CPUs grow by at least what a busy loop of this process
    spends, and by what a busy child beside it spends (the 'other processes' CPU s' diagnostic: busy minus this
    process's CPU time)."""
    import subprocess
    import time
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat: not Linux (the diagnostics are then left out, tested above)")
    a, cpu0 = step_time.host_counters(), time.process_time()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    b, cpu = step_time.host_counters(), time.process_time() - cpu0
    assert b["busy_s"] - a["busy_s"] >= 0.8 * cpu - 0.05 and b["steal_s"] >= a["steal_s"] and b["nivcsw"] >= a["nivcsw"]
    spin = "import time\nt = time.perf_counter() + 0.6\nwhile time.perf_counter() < t: pass"
    c, cpu0 = step_time.host_counters(), time.process_time()
    subprocess.run([sys.executable, "-c", spin], check=True)
    d, cpu = step_time.host_counters(), time.process_time() - cpu0
    assert d["busy_s"] - c["busy_s"] - cpu >= 0.3  # the child's ~0.6 s, at clock-tick resolution
    assert {"fwd_bwd_other_cpu_s", "fwd_bwd_steal_s", "fwd_bwd_nivcsw"} <= set(step_time.DIAGNOSTICS)


def test_table_prints_the_host_diagnostics(capsys) -> None:
    """The fwd+bwd diagnostics line of the table names the host counters where the rounds have them."""
    r = _result("adamw", [0.3, 0.31], [0.2, 0.21])
    for key, values in (("fwd_bwd_cpu_s", [0.2, 0.21]), ("fwd_bwd_gc_s", [0.0, 0.0]),
                        ("fwd_bwd_device_allocs", [0, 0]), ("fwd_bwd_other_cpu_s", [0.01, 0.03]),
                        ("fwd_bwd_steal_s", [0.0, 0.02]), ("fwd_bwd_nivcsw", [3, 5])):
        r["samples"][key], r[key] = values, statistics.median(values)
    step_time.print_table(step_time.aggregate_arms({"adamw": [r]}, 4, 3))
    line = next(x for x in capsys.readouterr().out.splitlines() if "fwd+bwd diagnostics" in x)
    assert "other processes' CPU s 0.020" in line and "steal s 0.010" in line and "context switches 4.000" in line


def test_table_prints_the_phases_apart_and_the_zero3_trace(capsys) -> None:
    """The diagnostics line splits fwd+bwd into the host's forward and backward and the forward's CUDA events, and
    counts the timed steps that began without DeepSpeed's ZeRO-3 module trace (no prefetch), over all rounds."""
    rounds = []
    for flags in ([1.0, 0.0, 1.0], [0.0, 1.0, 1.0]):
        r = _result("ds_muon", [0.3, 0.31, 0.32], [0.2, 0.21, 0.22])
        for key, values in (("fwd_bwd_cpu_s", [0.2, 0.21, 0.22]), ("fwd_host_s", [0.05, 0.06, 0.07]),
                            ("bwd_host_s", [0.1, 0.11, 0.12]),
                            ("fwd_s_events", [0.04, 0.05, 0.06]), ("zero3_trace_complete", flags)):
            r["samples"][key], r[key] = values, statistics.median(values)
        rounds.append(r)
    step_time.print_table(step_time.aggregate_arms({"ds_muon": rounds}, 4, 3))
    line = next(x for x in capsys.readouterr().out.splitlines() if "fwd+bwd diagnostics" in x)
    assert "forward: host s 0.060 (0.060-0.060), CUDA events s 0.050" in line and "backward: host s 0.110" in line
    assert "trace not complete through fwd+bwd (modules fetched without prefetch) in 2 of 6 timed steps" in line


def test_zero3_trace_complete_reads_the_parameter_coordinator() -> None:
    """1.0 or 0.0 from the ZeRO-3 parameter coordinator's ``is_complete_trace()``; None below ZeRO-3."""
    class Coordinator:
        def __init__(self, complete: bool) -> None:
            self.complete = complete

        def is_complete_trace(self) -> bool:
            return self.complete

    def engine(complete):
        offload = None if complete is None else types.SimpleNamespace(
            get_param_coordinator=lambda: Coordinator(complete))
        return types.SimpleNamespace(optimizer=types.SimpleNamespace(parameter_offload=offload))

    assert [step_time.zero3_trace_complete(engine(c)) for c in (True, False, None)] == [1.0, 0.0, None]
    assert step_time.zero3_trace_complete(types.SimpleNamespace(optimizer=object())) is None
    # the DeepSpeed this is tested with has what it reads
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    assert callable(DeepSpeedZeRoOffload.get_param_coordinator)
    assert callable(PartitionedParameterCoordinator.is_complete_trace)


def test_paired_line_splits_the_phases_and_counts_pairs_over_old_and_new_rounds(capsys) -> None:
    """The paired line prints forward and backward apart where the rounds have them; a resumed run's older rounds,
    without the phase keys, still count in the pairs (which come from the step time every round has)."""
    def round_(new: bool) -> dict:
        r = _result("ds_muon:bench.alternate_overlap=true", [0.45, 0.45, 0.45], [0.40, 0.40, 0.40])
        r["paused_samples"] = {"fwd_bwd_s": [0.30] * 3, "step_s": [0.50] * 3}
        r["overlapped_flags"] = {"captures": [0, 0, 0], "fallbacks": [0, 0, 0]}
        if new:
            for key, on, off in (("fwd_host_s", 0.12, 0.10), ("bwd_host_s", 0.25, 0.18), ("fwd_s_events", 0.09, 0.08)):
                r["samples"][key], r[key], r["paused_samples"][key] = [on] * 3, on, [off] * 3
        return r

    paired = step_time.paired_overlap([round_(False), round_(False), round_(True)])
    assert paired["pairs"] == 9 and paired["pairs_left_out"] == 0
    step_time.print_table(step_time.aggregate_arms({"ds_muon:bench.alternate_overlap=true":
                                                    [round_(False), round_(False), round_(True)]}, 4, 3))
    line = next(x for x in capsys.readouterr().out.splitlines() if "overlapped minus paused" in x)
    assert line.count("9 paused steps") == 1
    assert "forward host s +0.020 (0.120 against 0.100)" in line and "forward events s +0.010" in line
    assert "backward host s +0.070 (0.250 against 0.180)" in line


def test_paired_overlap_compares_each_paused_step_with_the_overlapped_ones_around_it(capsys) -> None:
    """``bench.alternate_overlap``: each paused step (``paused_samples``) against the mean of the overlapped steps
    around it in the same round (the one before alone after the last); a pair whose overlapped step captured a CUDA
    graph or fell back is left out; the table prints it. Only ds_muon arms running the overlapped step take the
    option."""
    def round_(on: list, off: list, captures=None) -> dict:
        r = _result("ds_muon:bench.alternate_overlap=true", [x + 0.05 for x in on], on)
        r["paused_samples"] = {"fwd_bwd_s": off, "step_s": [x + 0.09 for x in off],
                               "opt_step_s": [0.09] * len(off)}
        r["overlapped_flags"] = {"captures": captures or [0] * len(on), "fallbacks": [0] * len(on)}
        return r

    # round 1: overlapped 0.30, 0.32 around paused 0.25, then 0.32 alone before paused 0.26: diffs 0.06, 0.06;
    # round 2 (a slower process): 0.50 against 0.44; round 3: its first overlapped step captured a graph
    rounds = [round_([0.30, 0.32], [0.25, 0.26]), round_([0.50], [0.44]),
              round_([0.90, 0.40], [0.30, 0.34], captures=[1, 0])]
    p = step_time.aggregate_rounds(rounds)["paired_overlap"]
    assert p["pairs"] == 4 and p["pairs_left_out"] == 1  # round 3's first paused step: around a capture
    assert p["fwd_bwd_s"]["diff"] == pytest.approx(0.06)  # 0.06, 0.06, 0.06, 0.06 (0.40 - 0.34)
    assert p["fwd_bwd_s"]["paused"] == pytest.approx(0.30)  # 0.25, 0.26, 0.44, 0.34
    assert p["step_s"]["diff"] == pytest.approx(0.02) and p["opt_step_s"]["diff"] == pytest.approx(-0.04)
    agg = step_time.aggregate_rounds(rounds)
    assert "paused_samples" not in agg and "overlapped_flags" not in agg
    assert "paired_overlap" not in step_time.aggregate_rounds([_result("ds_muon", [0.3], [0.2])])
    step_time.print_table(step_time.aggregate_arms({"ds_muon:bench.alternate_overlap=true": rounds}, 4, 3))
    line = next(x for x in capsys.readouterr().out.splitlines() if "overlapped minus paused" in x)
    assert "4 paused steps" in line and "1 left out" in line and "fwd+bwd +0.060" in line
    assert "optimizer step -0.040" in line
    assert step_time.bench_options("ds_muon:bench.alternate_overlap=true") == {"alternate_overlap": True}
    with pytest.raises(ValueError, match="use it on a ds_muon arm"):
        step_time.bench_options("adamw:bench.alternate_overlap=true")


def test_alternate_overlap_is_refused_where_the_arm_does_not_overlap(tmp_path, monkeypatch) -> None:
    """An arm whose overlapped step does not run (overlap off, or "auto" at ZeRO-1/2) is refused before any worker."""
    calls = []
    _fake_workers(monkeypatch, calls)
    for arm, stage in (("ds_muon_nooverlap:bench.alternate_overlap=true", "3"),
                       ("ds_muon:opt.overlap_backward=false:bench.alternate_overlap=true", "3"),
                       ("ds_muon:bench.alternate_overlap=true", "2"),
                       ("ds_muon:stage=2:bench.alternate_overlap=true", "3")):  # the arm's own stage counts
        monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers", arm, "--stage", stage,
                                          "--no-ns-micro", "--out", str(tmp_path / "r.json")])
        with pytest.raises(ValueError, match="which this arm does not run"):
            step_time.main()
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers",
                                      "ds_muon_overlap:bench.alternate_overlap=true", "--stage", "2",
                                      "--no-ns-micro", "--out", str(tmp_path / "r.json")])
    step_time.main()
    assert len(calls) == 1
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers",
                                      "ds_muon:stage=3:bench.alternate_overlap=true", "--stage", "2",
                                      "--no-ns-micro", "--out", str(tmp_path / "r.json")])
    step_time.main()
    assert len(calls) == 2


def test_reduce_events_is_an_integer_checked_before_any_worker(tmp_path, monkeypatch) -> None:
    """``bench.reduce_events=N`` (DeepSpeed's ZeRO-3 ``max_param_reduce_events``) takes an integer >= 1 at ZeRO-3;
    any other value or stage is refused before a worker starts, and the arm's settings name it."""
    assert step_time.bench_options("ds_muon:bench.reduce_events=64") == {"reduce_events": 64}
    assert "bench.reduce_events=64" in step_time.arm_settings("ds_muon:bench.reduce_events=64", 4)
    calls = []
    _fake_workers(monkeypatch, calls)
    for value in ("0", "-3", "2.5", "true", "many"):
        monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers",
                                          f"adamw,ds_muon:bench.reduce_events={value}", "--no-ns-micro",
                                          "--out", str(tmp_path / "r.json")])
        with pytest.raises(ValueError, match="not an integer >= 1"):
            step_time.main()
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers", "ds_muon:bench.reduce_events=8",
                                      "--stage", "2", "--no-ns-micro", "--out", str(tmp_path / "r.json")])
    with pytest.raises(ValueError, match="which ZeRO 2 lacks"):
        step_time.main()
    assert calls == []


def test_reduce_stream_priority_is_checked_before_any_worker_and_replaces_deepspeeds_stream(tmp_path,
                                                                                             monkeypatch) -> None:
    """``bench.reduce_stream_priority=P`` takes a negative integer at ZeRO-3 with ``overlap_comm`` (the arm's own
    ``stage=`` and ``overlap_comm=`` count), refused otherwise before a worker starts; in the worker it replaces the
    reduce stream that the installed DeepSpeed reads at each use, and refuses an optimizer without one of its own."""
    assert step_time.bench_options("ds_muon:bench.reduce_stream_priority=-1") == {"reduce_stream_priority": -1}
    calls = []
    _fake_workers(monkeypatch, calls)
    for arm, stage, match in (("ds_muon:bench.reduce_stream_priority=0", "3", "not a negative integer"),
                              ("ds_muon:bench.reduce_stream_priority=1", "3", "not a negative integer"),
                              ("ds_muon:bench.reduce_stream_priority=-1.5", "3", "not a negative integer"),
                              ("ds_muon:bench.reduce_stream_priority=-1", "2", "ZeRO 2 with overlap_comm true"),
                              ("ds_muon:stage=2:bench.reduce_stream_priority=-1", "3", "ZeRO 2 with"),
                              ("ds_muon:overlap_comm=false:bench.reduce_stream_priority=-1", "3",
                               "ZeRO 3 with overlap_comm false"),
                              ("ds_muon:stage=1:bench.reduce_events=4", "3", "which ZeRO 1 lacks")):
        monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers", arm, "--stage", stage,
                                          "--no-ns-micro", "--out", str(tmp_path / "r.json")])
        with pytest.raises(ValueError, match=match):
            step_time.main()
    assert calls == []

    import torch

    class Stream:
        def __init__(self, device="cuda:0", priority=0) -> None:
            self.device, self.priority = device, priority

    default = Stream()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    old = Stream("cuda:1")
    optimizer = types.SimpleNamespace(parameter_offload=object(), reduce_and_partition_stream=old)
    step_time.reduce_stream_at_priority(optimizer, -2)
    new = optimizer.reduce_and_partition_stream
    assert new is not old and (new.device, new.priority) == ("cuda:1", -2)
    for bad in (types.SimpleNamespace(parameter_offload=object(), reduce_and_partition_stream=default),  # no side
                types.SimpleNamespace(reduce_and_partition_stream=Stream()),  # not ZeRO-3's
                types.SimpleNamespace(parameter_offload=object(), reduce_and_partition_stream=None)):  # CPU
        with pytest.raises(SystemExit, match="no ZeRO-3 reduce stream of its own"):
            step_time.reduce_stream_at_priority(bad, -1)
    # the installed DeepSpeed keeps the stream there and reads it at each use
    import inspect
    from deepspeed.runtime.zero import stage3
    source = inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3)
    assert "self.reduce_and_partition_stream = " in source
    assert source.count("get_accelerator().stream(self.reduce_and_partition_stream)") >= 2


def test_quintic_form_is_checked_and_set_before_the_engine(monkeypatch) -> None:
    """``bench.quintic_form`` names one of ds_muon's forms on a ds_muon arm (refused otherwise, before any worker),
    and the worker's ``use_quintic_form`` sets the form the engine then builds its Newton-Schulz with; an arm
    without the option keeps the default."""
    from ds_muon.core import newton_schulz
    from ds_muon.core.muon_update import scaled_orthogonalizer
    assert step_time.bench_options("ds_muon:bench.quintic_form=sym4") == {"quintic_form": "sym4"}
    with pytest.raises(ValueError, match=r"bench.quintic_form='sym3' is not one of \('auto', 'plain', 'fused', 'sym2'"):
        step_time.bench_options("ds_muon:bench.quintic_form=sym3")
    with pytest.raises(ValueError, match="use it on a ds_muon arm"):
        step_time.bench_options("adamw:bench.quintic_form=sym4")
    monkeypatch.setattr(newton_schulz, "QUINTIC_FORM", newton_schulz.QUINTIC_FORM)  # restored after the test
    default = newton_schulz.QUINTIC_FORM
    assert step_time.use_quintic_form(step_time.bench_options("ds_muon")) == default
    assert step_time.use_quintic_form(step_time.bench_options("ds_muon:bench.quintic_form=sym2")) == "sym2"
    seen = []
    real = newton_schulz.symmetric_product
    monkeypatch.setattr(newton_schulz, "symmetric_product", lambda L, R, k: seen.append(k) or real(L, R, k))
    scaled_orthogonalizer("standard", 5, torch.float32, "shape", compiled=False)(torch.randn(2, 8, 16))
    assert seen == [2] * 10
    # the compiled Newton-Schulz (CUDA) fixes its form when it is built, i.e. in ds_muon.initialize: one built after
    # the form is set runs it, one built before keeps the form it had; the worker sets the form before initialize
    from ds_muon.core.ns_compile import compiled_orthogonalize
    try:
        seen.clear()
        compiled_orthogonalize("standard", 5, torch.float32, backend="eager")(torch.randn(2, 8, 16))
        assert seen and set(seen) == {2}
        monkeypatch.setattr(newton_schulz, "QUINTIC_FORM", "plain")
        seen.clear()
        compiled_orthogonalize("standard", 5, torch.float32, backend="eager")(torch.randn(2, 8, 16))
        assert seen == []
    finally:
        compiled_orthogonalize.cache_clear()
        torch._dynamo.reset()
    import inspect
    build = inspect.getsource(step_time.build_engine)  # the worker's engine (and backward_calls.py's)
    assert 0 < build.index("use_quintic_form(") < build.index("ds_muon.initialize(")
    assert "build_engine(" in inspect.getsource(step_time.worker)


def test_ns_loads_count_the_arms_form() -> None:
    """``ns_loads`` (the worker's Newton-Schulz floor) equals the owner plans' own ``load()`` in the default form
    (``"auto"``: ``sym2`` at 2.9B's shapes), at W=1 and W=3, and counts each form's FLOPs: 2.9B's Muon matrices lose
    15.3% (``sym2``) and 23.0% (``sym4``) against ``plain``."""
    from ds_muon.sharded.ownership import ParamInfo, build_bucketed_plan
    layer = [(3072, 3072)] * 4 + [(8192, 3072)] * 2 + [(3072, 8192)]
    params = [ParamInfo(f"p{i}", s, s[0] * s[1]) for i, s in enumerate(layer * 2)]
    for world in (1, 3):
        plans = [build_bucketed_plan(params, world, 3072 * 8192 * 2, order="reverse")]
        plain = step_time.ns_loads(plans, world, 5, "standard", "plain")
        assert step_time.ns_loads(plans, world, 5, "standard", "auto") == plans[0].load()
        assert step_time.ns_loads(plans, world, 5, "standard", "auto") == step_time.ns_loads(plans, world, 5,
                                                                                              "standard", "sym2")
        for form, saved in (("sym2", 0.153), ("sym4", 0.230)):
            got = step_time.ns_loads(plans, world, 5, "standard", form)
            assert sum(got) / sum(plain) == pytest.approx(1 - saved, abs=5e-4), form


def test_builtin_arm_runs_deepspeeds_muon_where_ds_muon_is_installed(tmp_path, monkeypatch) -> None:
    """An installed ds_muon takes DeepSpeed's ``"Muon"`` over in every process (``ds_muon_autoload.pth``): the
    ``builtin_muon`` arm's worker starts with ``DS_MUON=0`` and every other arm's with this process's environment,
    and a worker whose engine runs the wrong optimizer stops (``check_engine_optimizer``)."""
    envs = {}
    _fake_workers(monkeypatch, [], envs=envs)
    monkeypatch.setenv("DS_MUON", "1")
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--nproc", "1", "--optimizers", "adamw,builtin_muon,ds_muon",
                                      "--no-ns-micro", "--out", str(tmp_path / "r.json")])
    step_time.main()
    assert envs["builtin_muon"]["DS_MUON"] == "0"
    assert envs["adamw"]["DS_MUON"] == envs["ds_muon"]["DS_MUON"] == "1"

    ours = type("MuonZeroOptimizer", (), {"__module__": "ds_muon.integration.zero3"})()
    theirs = type("DeepSpeedZeroOptimizer_Stage3", (), {"__module__": "deepspeed.runtime.zero.stage3"})()
    with pytest.raises(SystemExit, match="runs ds_muon's MuonZeroOptimizer, not DeepSpeed's built-in"):
        step_time.check_engine_optimizer("builtin_muon", ours)
    with pytest.raises(SystemExit, match="not ds_muon's optimizer"):
        step_time.check_engine_optimizer("ds_muon_nooverlap", theirs)
    step_time.check_engine_optimizer("builtin_muon", theirs)
    step_time.check_engine_optimizer("adam_mini", ours)
    step_time.check_engine_optimizer("adamw", theirs)


def test_wait_clock_times_the_hosts_waits_and_the_table_prints_them(capsys) -> None:
    """``WaitClock`` times every call of the synchronize functions it wraps (a method on a class, as
    ``torch.cuda.Event.synchronize``; a module function, as ``torch.cuda.synchronize``), and ``close`` puts them back;
    the diagnostics line prints each phase's waits."""
    import time as _time
    import types

    class Event:
        def synchronize(self):
            _time.sleep(0.01)
            return "done"

    module = types.SimpleNamespace(synchronize=lambda: _time.sleep(0.02))
    original = Event.synchronize
    clock = step_time.WaitClock(targets=((Event, "synchronize"), (module, "synchronize")))
    assert Event().synchronize() == "done"
    module.synchronize()
    assert clock.calls == 2 and 0.03 <= clock.seconds < 0.5
    clock.close()
    assert Event.synchronize is original
    Event().synchronize()
    assert clock.calls == 2

    r = _result("ds_muon", [0.3, 0.31, 0.32], [0.2, 0.21, 0.22])
    for key, values in (("fwd_bwd_cpu_s", [0.2, 0.21, 0.22]), ("fwd_host_s", [0.05, 0.06, 0.07]),
                        ("bwd_host_s", [0.1, 0.11, 0.12]), ("fwd_wait_s", [0.001, 0.002, 0.003]),
                        ("bwd_wait_s", [0.02, 0.03, 0.04])):
        r["samples"][key], r[key] = values, statistics.median(values)
    step_time.print_table(step_time.aggregate_arms({"ds_muon": [r]}, 4, 3))
    line = next(x for x in capsys.readouterr().out.splitlines() if "fwd+bwd diagnostics" in x)
    assert "waiting on the GPU (Event/Stream/device synchronize): forward 0.002" in line
    assert "backward 0.030" in line


def test_compile_probe_is_an_adamw_option_and_runs_ds_muons_compiled_newton_schulz(monkeypatch) -> None:
    """``bench.compile_probe=true`` is refused on any arm but adamw, and :func:`step_time.compile_probe` runs ds_muon's
    compiled Newton–Schulz (``compiled_orthogonalize``, 5 steps in bf16, the backend the probe passes) once on a bf16
    batch, and raises where the result is not finite."""
    import torch
    from ds_muon.core import ns_compile
    assert step_time.bench_options("adamw:bench.compile_probe=true") == {"compile_probe": True}
    for arm in ("ds_muon:bench.compile_probe=true", "builtin_muon:bench.compile_probe=true"):
        with pytest.raises(ValueError, match="use it on an adamw arm"):
            step_time.bench_options(arm)
    seen = []
    real = ns_compile.compiled_orthogonalize
    poison = []

    def spy(*args, **kwargs):
        fn = real(*args, **kwargs)
        seen.append((args, kwargs))

        def call(x):
            seen.append((tuple(x.shape), x.dtype))
            out = fn(x)
            return out * float("nan") if poison else out
        return call

    monkeypatch.setattr(ns_compile, "compiled_orthogonalize", spy)
    step_time.compile_probe(torch.device("cpu"), backend="eager")
    assert seen == [((), {"steps": 5, "dtype": torch.bfloat16, "backend": "eager", "mode": None}),
                    ((2, 256, 512), torch.bfloat16)]
    poison.append(True)
    with pytest.raises(RuntimeError, match="non-finite"):
        step_time.compile_probe(torch.device("cpu"), backend="eager")


def test_matmul_burst_is_checked_and_keeps_the_device_busy_for_its_seconds() -> None:
    """``bench.matmul_burst_s=S`` takes a number of seconds > 0 on any arm (anything else is refused before a worker
    starts), and :func:`step_time.matmul_burst` runs matmuls, in groups of 8, until S seconds have passed."""
    import time

    import torch
    assert step_time.bench_options("adamw:bench.matmul_burst_s=0.25") == {"matmul_burst_s": 0.25}
    assert "bench.matmul_burst_s=0.25" in step_time.arm_settings("adamw:bench.matmul_burst_s=0.25", 4)
    for value in ("0", "-1", "true", "\"x\""):
        with pytest.raises(ValueError, match="not a number of seconds > 0"):
            step_time.bench_options(f"adamw:bench.matmul_burst_s={value}")
    t0 = time.perf_counter()
    n = step_time.matmul_burst(torch.device("cpu"), 0.05, size=64)
    took = time.perf_counter() - t0
    assert n >= 8 and n % 8 == 0
    assert took >= 0.05


def _alloc(addr, size, filename="/x/ds_muon/sharded/overlap.py", line=1, name="f", action="alloc"):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/t/torch/nn/functional.py", "line": 9, "name": "linear"},
                       {"filename": filename, "line": line, "name": name},
                       {"filename": "/r/benchmarks/step_time.py", "line": 99, "name": "worker"}]}


def test_peak_allocations_replays_the_history_and_names_every_block_at_the_phases_peak() -> None:
    """``bench.memory_peak``: :func:`step_time.peak_allocations` replays allocations and completed frees (the
    allocator's requested bytes drop there) over the whole history, looks for the peak from the phase's first entry
    on (the first entry reaching it), and groups every block live there, older ones included, by the innermost
    ds_muon/DeepSpeed/benchmark frame, saying how much of each group the phase allocated; the option takes only a
    phase of ``MEMORY_PHASES``."""
    gib = 2**30
    trace = [
        _alloc(9, 6 * gib, "/s/deepspeed/runtime/zero/stage_1_and_2.py", 5, "init"),   # before the phase: 6 GiB
        _alloc(8, 8 * gib, "/r/ds_muon/integration/overlap12.py", 6, "collect"),       # 14 GiB before the phase
        _alloc(8, 8 * gib, action="free_completed"),                                    # 6 GiB: the phase starts next
        _alloc(1, 2 * gib, "/s/deepspeed/runtime/zero/stage_1_and_2.py", 10, "step"),
        _alloc(2, 1 * gib, "/r/ds_muon/integration/zero12.py", 20, "grad"),
        _alloc(1, 2 * gib, action="free_requested"),   # not yet reusable: only free_completed counts
        _alloc(3, 1 * gib, "/r/ds_muon/integration/zero12.py", 20, "grad"),            # 10 GiB: the first peak
        _alloc(1, 2 * gib, action="free_completed"),
        _alloc(5, 2 * gib, "/r/ds_muon/sharded/overlap.py", 30, "commit"),             # 10 GiB again: a tie
        _alloc(9, 6 * gib, action="free_completed"),                                    # an older block freed
        _alloc(4, 5 * gib, "/r/ds_muon/sharded/overlap.py", 30, "commit"),             # 9 GiB
    ]
    out = step_time.peak_allocations(trace, baseline=gib // 2, start=3)
    assert (out["baseline_gib"], out["at_start_gib"], out["peak_gib"], out["phase_live_gib"]) == (0.5, 6.5, 10.5, 4)
    assert out["entry"] == 6
    assert out["groups"] == [["deepspeed/runtime/zero/stage_1_and_2.py:5 init", 6.0, 1, 0.0],
                             ["deepspeed/runtime/zero/stage_1_and_2.py:10 step", 2.0, 1, 2.0],
                             ["ds_muon/integration/zero12.py:20 grad", 2.0, 2, 2.0]]
    assert out["other_gib"] == 0
    # the peak is looked for from the phase on: the whole history's (14 GiB at entry 1) is not the phase's
    whole = step_time.peak_allocations(trace, start=0)
    assert (whole["entry"], whole["peak_gib"]) == (1, 14)
    # a trace without free_completed frees on free_requested (held: 6, 14, | 16, 17, 15, 16, 18, 23 from entry 2 on)
    requested = [e for e in trace if e["action"] != "free_completed"]
    got = step_time.peak_allocations(requested, start=2)
    assert (got["peak_gib"], got["entry"]) == (23, 7)
    # no owner frame: autograd's node among C++ frames, else the innermost Python frame, else no frame to name
    cpp = [{"filename": "", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"},
           {"filename": "", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply"},
           {"filename": "/t/torch/autograd/graph.py", "line": 5, "name": "_engine_run_backward"}]
    bare = [{"action": "alloc", "addr": 5, "size": 3 * gib, "frames": cpp},
            {"action": "alloc", "addr": 6, "size": 2 * gib, "frames": [{"filename": "/t/torch/a.py", "line": 3,
                                                                         "name": "g"}]},
            {"action": "alloc", "addr": 7, "size": gib, "frames": cpp[:1]}]
    assert [g[0] for g in step_time.peak_allocations(bare)["groups"]] == [
        "autograd torch::autograd::generated::MmBackward0::apply", "a.py:3 g", step_time.NO_PYTHON_FRAME]
    # a phase with no entry of its own (start at the trace's end): its peak is what the trace ends with
    empty_phase = step_time.peak_allocations(bare, start=3)
    assert (empty_phase["peak_gib"], empty_phase["at_start_gib"], empty_phase["phase_live_gib"]) == (6, 6, 0)
    cell = dict(out, phase="step", requested_peak_gib=10.5, max_allocated_gib=10.6, wrapped=False)
    text = step_time.memory_peak_text(cell)
    assert "memory at the step peak" in text and "ds_muon/integration/zero12.py:20 grad 2.00 (2.00 new) [2]" in text
    assert "deepspeed/runtime/zero/stage_1_and_2.py:5 init 6.00 [1]" in text and "FULL" not in text
    assert "FULL" in step_time.memory_peak_text(dict(cell, wrapped=True))
    assert step_time.bench_options("adamw:bench.memory_peak=step") == {"memory_peak": "step"}
    with pytest.raises(ValueError, match="is not one of"):
        step_time.bench_options("adamw:bench.memory_peak=optimizer")


def test_recorded_peak_marks_the_phase_and_runs_the_whole_step(monkeypatch) -> None:
    """:func:`step_time.start_memory_history` and :func:`step_time.recorded_peak` (CUDA's allocator history, stood in
    for here: the history is emptied when recording stops, as torch's is): the recording starts with Python frames,
    the bounded history and a clean slate, and the fwd+bwd phase switches to C++ frames keeping it; the phase
    starts after the marker's free (a uint8 block of ``MEMORY_MARKER_BYTES``, matched by its address), with the
    peak statistics reset after it; the peaks are read after the phase, the step's included; the history is taken
    before the recording stops; the other phase still runs; a full history is flagged, one without the marker
    refused; the recording stops even where the phase raises."""
    import inspect

    import torch
    calls = []
    gib = 2**30
    real = inspect.signature(torch.cuda.memory._record_memory_history)
    # an earlier step's peak (10 GiB) is what the statistics hold until the marker resets them
    stats = {"requested_bytes.all.current": gib // 2, "requested_bytes.all.peak": 10 * gib,
             "allocated_bytes.all.current": 9}
    trace, lost, recording = [], [], [True]

    def record(*args, **kwargs):
        bound = real.bind(*args, **kwargs)   # a misspelled keyword fails here
        bound.apply_defaults()
        calls.append(("record",) + tuple(bound.arguments[k] for k in ("enabled", "context", "stacks", "max_entries",
                                                                          "clear_history")))
        if bound.arguments["enabled"] is None or bound.arguments["clear_history"]:
            trace.clear()
        recording[0] = bound.arguments["enabled"] is not None

    def empty(n, dtype=None, device=None):
        size = n * torch.empty_like(torch.zeros(0, dtype=dtype)).element_size() if dtype is not None else 4 * n
        if not lost:   # freed at once (``del``): its alloc and free, as the allocator records them
            trace.extend([{"action": "alloc", "addr": 77, "size": size, "frames": []},
                          {"action": "free_requested", "addr": 77, "size": size},
                          {"action": "free_completed", "addr": 77, "size": size}])
        calls.append("marker")
        return types.SimpleNamespace(data_ptr=lambda: 77)

    def reset(*a):
        calls.append("reset")
        stats["requested_bytes.all.peak"] = stats["requested_bytes.all.current"]

    def snapshot(*a):
        calls.append("snapshot")
        return {"device_traces": [[], list(trace)]}

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: dict(stats))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: stats["requested_bytes.all.peak"] + 7)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k) if a == (step_time.MEMORY_MARKER_BYTES,)
                        else real_empty(*a, **k))

    def grow(n_gib, where):   # an allocation: the history (while recording) and the allocator's counts
        if recording[0]:
            trace.append(_alloc(len(trace) + 100, n_gib * gib, f"/r/{where}", 3, "f"))
        stats["requested_bytes.all.current"] += n_gib * gib
        stats["requested_bytes.all.peak"] = max(stats["requested_bytes.all.peak"],
                                                stats["requested_bytes.all.current"])

    class Engine:
        def __call__(self, x, y):
            calls.append("forward")
            grow(1, "examples/model.py")
            return x

        def backward(self, loss):
            calls.append("backward")

        def step(self):
            calls.append("step")
            grow(2, "ds_muon/integration/zero12.py")

    device = torch.device("cuda", 1)
    assert step_time.start_memory_history(device) == gib // 2
    assert calls == [("record", "all", "alloc", "python", step_time.MEMORY_HISTORY_ENTRIES, True)]
    x = torch.zeros(2, 5, dtype=torch.long)
    calls.clear()
    out = step_time.recorded_peak(Engine(), x, device, "step", gib // 2)
    assert calls == ["forward", "backward", "marker", "reset", "step", "snapshot",
                     ("record", None, "all", "all", sys.maxsize, False)]
    assert (out["phase"], out["baseline_gib"], out["at_start_gib"], out["held_at_start_gib"]) == ("step", .5, 1.5, 1.5)
    assert (out["peak_gib"], out["requested_peak_gib"], out["phase_live_gib"]) == (3.5, 3.5, 2)
    assert out["max_allocated_gib"] == 3.5 + 7 / gib and out["wrapped"] is False
    assert [g[0] for g in out["groups"]] == ["ds_muon/integration/zero12.py:3 f", "examples/model.py:3 f"]
    assert "REPLAY INCOMPLETE" not in step_time.memory_peak_text(out)
    assert "REPLAY INCOMPLETE" in step_time.memory_peak_text(dict(out, held_at_start_gib=2.5))
    record(enabled="all")   # the worker records again (a fresh history: stopping cleared it)
    calls.clear()
    out = step_time.recorded_peak(Engine(), x, device, "fwd_bwd", gib // 2)
    assert calls == [("record", "all", "alloc", "all", step_time.MEMORY_HISTORY_ENTRIES, False), "marker", "reset",
                     "forward", "backward", "snapshot", ("record", None, "all", "all", sys.maxsize, False), "step"]
    assert out["phase_live_gib"] == 1 and [g[0] for g in out["groups"]] == ["examples/model.py:3 f"]
    monkeypatch.setattr(step_time, "MEMORY_HISTORY_ENTRIES", 5)   # the step's history: 5 entries, exactly full
    record(enabled="all")
    assert step_time.recorded_peak(Engine(), x, device, "step", 0)["wrapped"] is True
    lost.append(True)
    record(enabled="all")
    with pytest.raises(RuntimeError, match="marker is not in the allocator's history"):
        step_time.recorded_peak(Engine(), x, device, "step", 0)

    class Failing(Engine):
        def step(self):
            raise RuntimeError("boom")

    lost.clear()
    record(enabled="all")
    calls.clear()
    with pytest.raises(RuntimeError, match="boom"):
        step_time.recorded_peak(Failing(), x, device, "step", 0)
    assert calls[-1][:2] == ("record", None)


def test_stream_priority_is_checked_and_makes_a_priority_stream_current(monkeypatch) -> None:
    """``bench.stream_priority=P`` takes a negative integer (anything else is refused before a worker starts), and
    :func:`step_time.use_priority_stream` makes a new stream of that priority on the worker's device current."""
    import torch
    assert step_time.bench_options("ds_muon:bench.stream_priority=-1") == {"stream_priority": -1}
    for value in ("0", "1", "-1.5", "true", "high"):
        with pytest.raises(ValueError, match="bench.stream_priority=.* is not a negative integer"):
            step_time.bench_options(f"adamw:bench.stream_priority={value}")
    made, current = [], []

    class Stream:
        def __init__(self, device=None, priority=0):
            made.append((device, priority))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "set_stream", current.append)
    stream = step_time.use_priority_stream(torch.device("cuda", 0), -2)
    assert made == [(torch.device("cuda", 0), -2)] and current == [stream]


def test_gap_by_cause_splits_the_step_over_adamws_into_phases_that_add_up(capsys) -> None:
    """``gap_by_cause``: a Muon arm's step over AdamW's = forward host + backward's waits on the GPU + backward's
    other host time + the main stream past backward's host return (CUDA events less the host's phases) + the side
    stream's spill (fwd+bwd wall clock less its CUDA events) + the optimizer step, each the arm's median less
    AdamW's; None without CUDA events (the CPU). The table prints it for every arm, with shares only where the gap
    is at least a millisecond."""
    adamw = dict(step_s=0.20, fwd_host_s=0.08, bwd_host_s=0.09, bwd_wait_s=0.0, fwd_bwd_s=0.17,
                 fwd_bwd_s_events=0.17, opt_step_s=0.03)
    muon = dict(step_s=0.25, fwd_host_s=0.081, bwd_host_s=0.11, bwd_wait_s=0.02, fwd_bwd_s=0.22,
                fwd_bwd_s_events=0.201, opt_step_s=0.028)
    gap = step_time.gap_by_cause(muon, adamw)
    expected = dict(gap=0.05, fwd=0.001, bwd_waits=0.02, bwd_other=0.0, main_tail=0.01, spill=0.019, opt=-0.002,
                    sum=0.048)
    assert gap.keys() == expected.keys() and all(abs(gap[k] - v) < 1e-12 for k, v in expected.items()), gap
    assert step_time.gap_by_cause({k: v for k, v in muon.items() if k != "fwd_bwd_s_events"}, adamw) is None

    arms = {}
    for arm, v in (("adamw", adamw), ("ds_muon", muon), ("adamw:bench.split_groups=true", dict(adamw, step_s=0.2002))):
        r = _result(arm, [v["step_s"]] * 3, [v["fwd_bwd_s"]] * 3)
        for key in ("fwd_host_s", "bwd_host_s", "bwd_wait_s", "fwd_bwd_s_events", "opt_step_s"):
            r["samples"][key], r[key] = [v[key]] * 3, v[key]
        arms[arm] = [r]
    step_time.print_table(step_time.aggregate_arms(arms, 4, 3))
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("ds_muon - AdamW step"))
    assert line.startswith("ds_muon - AdamW step +0.0500 s by cause (medians of this run; the parts sum to +0.0480 s)")
    assert ("forward host +0.0010 (2%), backward's host waiting on the GPU +0.0200 (40%), backward's other host time "
            "+0.0000 (0%), main stream past backward's host return (fwd+bwd CUDA events less the host's forward and "
            "backward) +0.0100 (20%), side-stream work past the main stream (fwd+bwd wall clock less its CUDA events) "
            "+0.0190 (38%), optimizer step -0.0020 (-4%)") in line
    same = next(x for x in lines if x.startswith("adamw:bench.split_groups=true - AdamW step +0.0002 s"))
    assert "%" not in same and "forward host +0.0000, " in same
