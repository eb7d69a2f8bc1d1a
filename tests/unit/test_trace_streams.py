"""benchmarks/trace_streams.py on a hand-written Chrome trace (no GPU): the GPU's idle time inside fwd+bwd is the
window less the union of every stream's kernels (two streams overlapping count once), a kernel outside the window
counts only its part inside, and the Newton–Schulz floor is compared with that idle time."""
from __future__ import annotations

import re

from tests.support.tools import repo_module

trace_streams = repo_module("benchmarks/trace_streams.py")


def _kernel(ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream}}


def _events() -> list[dict]:
    """fwd+bwd from 1000 to 2000 us, the step after it to 2500 us. Main stream (7) busy 1000-1300 and 1500-1600 (and
    kernels of the step before, 500-600 and 900-1050, the second running across forward's start), the side stream
    (20) 1250-1400 (overlaps main 1250-1300) and 1900-2100 (all of it after main's last fwd+bwd kernel)."""
    return [
        {"ph": "X", "cat": "user_annotation", "name": "bench/forward_backward", "ts": 1000.0, "dur": 1000.0},
        {"ph": "X", "cat": "user_annotation", "name": "bench/step", "ts": 2000.0, "dur": 500.0},
        _kernel(500, 100, 7), _kernel(900, 150, 7), _kernel(1000, 300, 7), _kernel(1500, 100, 7),
        _kernel(2050, 100, 7), _kernel(1250, 150, 20), _kernel(1900, 200, 20),
    ]


def test_busy_us_is_the_union_clipped_to_the_window() -> None:
    assert trace_streams.busy_us([(0, 10), (5, 20), (30, 40)], 0, 100) == 30
    assert trace_streams.busy_us([(30, 40), (0, 10), (5, 20)], 8, 35) == 12 + 5  # unsorted, clipped at both ends
    assert trace_streams.busy_us([], 0, 100) == 0
    assert trace_streams.busy_us([(0, 100), (10, 20), (30, 40)], 0, 100) == 100  # nested: counted once
    assert trace_streams.busy_us([(-50, -10), (200, 300)], 0, 100) == 0  # entirely outside


def test_report_states_the_idle_time_and_the_floor_it_could_absorb() -> None:
    text = trace_streams.report(_events(), bin_ms=0.1, ns_floor_ms=1.0)
    # union inside [1000, 2000]: 1000-1400 (400) + 1500-1600 (100) + 1900-2000 (100) = 600 us busy, 400 us idle; the
    # kernel across forward's start (900-1050) lies inside 1000-1300 there, the one at 500-600 is outside
    line = next(x for x in text.splitlines() if x.startswith("inside fwd+bwd"))
    assert re.search(r"GPU busy 0\.6 ms \(main stream 0\.4 ms\), idle 0\.4 ms \(40% of the window\)", line), line
    assert "Newton-Schulz floor 1.0 ms: idle / floor = 0.40" in text
    # a kernel across forward's start counts for its part inside: main's first fwd+bwd kernel now 1100-1300, the one
    # before 900-1100
    events = [e for e in _events() if not (e["cat"] == "kernel" and e["ts"] in (900, 1000))]
    events += [_kernel(900, 200, 7), _kernel(1100, 200, 7)]
    assert "idle 0.4 ms (40% of the window)" in trace_streams.report(events, bin_ms=0.1)
    # the window runs on to the main stream's last fwd+bwd kernel where that ends after the host's range
    events = _events() + [_kernel(1950, 250, 7)]  # main busy to 2200: window 1200 us
    assert "inside fwd+bwd (1.2 ms" in trace_streams.report(events, bin_ms=0.1)
    # the side stream's work after main's last fwd+bwd kernel (at 1600 us): 1900-2100
    assert "of it 0.2 ms after the main stream's end" in text
    assert "Newton-Schulz floor" not in trace_streams.report(_events(), bin_ms=0.1)


def test_step_time_reports_each_arms_trace_against_the_muon_arms_floor(tmp_path, capsys) -> None:
    """``step_time.py --trace DIR``'s end: each arm's trace read by trace_streams.py, printed and written to
    ``DIR/<arm>.txt``, with the first Muon arm's ``ns_floor_s``; an arm without a trace, or whose rounds failed, is
    passed over."""
    import json
    step_time = repo_module("benchmarks/step_time.py")
    arms = ["ds_muon_overlap:bench.clip=0", "adamw:bench.clip=0", "builtin_muon"]
    (tmp_path / "adamw_bench.clip_0.json").write_text(json.dumps({"traceEvents": _events()}))
    (tmp_path / "builtin_muon.json").write_text("a trace from an earlier run")  # this run's arm failed: passed over
    step_time.report_traces(str(tmp_path), arms, {arms[0]: {"ns_floor_s": 0.001}, arms[1]: {},
                                                  arms[2]: {"error": "exit 1"}})
    text = (tmp_path / "adamw_bench.clip_0.txt").read_text()
    assert "idle 0.4 ms (40% of the window)" in text and "floor 1.0 ms: idle / floor = 0.40" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adamw_bench.clip_0.json", "adamw_bench.clip_0.txt",
                                                          "builtin_muon.json"]
    assert "adamw:bench.clip=0, trace" in capsys.readouterr().out


def test_report_splits_the_host_into_forward_and_backward_with_its_api_calls() -> None:
    """With a ``bench/forward`` range (nested in fwd+bwd, so not taken for the step after it), the report gives the
    host's forward and backward milliseconds and, per phase, the CUDA API calls with the most host time first."""
    def call(name: str, ts: float, dur: float, cat: str = "cuda_runtime") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = _events() + [
        {"ph": "X", "cat": "user_annotation", "name": "bench/forward", "ts": 1001.0, "dur": 399.0},
        call("cudaLaunchKernel", 1010, 4), call("cudaLaunchKernel", 1020, 4), call("cudaStreamSynchronize", 1100, 50),
        call("cudaLaunchKernel", 1500, 5), call("cudaEventSynchronize", 1600, 200),
        call("cuLaunchKernel", 1850, 30, "cuda_driver"), call("cudaGraphLaunch", 1390, 20),  # runs across mid
        call("cudaStreamWaitEvent", 1400, 1),  # at forward's end: backward's
        call("cudaEventSynchronize", 2000, 300),  # at fwd+bwd's end, the step's: not counted
    ]
    text = trace_streams.report(events, bin_ms=0.1)
    assert "host: forward 0.4 ms, backward 0.6 ms" in text
    fwd = next(x for x in text.splitlines() if x.startswith("host API calls in forward"))
    # a call that runs across forward's end counts in forward for its 10 us inside it, and not in backward
    assert fwd.endswith("cudaStreamSynchronize 0.05 ms (1x), cudaGraphLaunch 0.01 ms (1x), "
                        "cudaLaunchKernel 0.01 ms (2x)"), fwd
    bwd = next(x for x in text.splitlines() if x.startswith("host API calls in backward"))
    assert bwd.endswith("cudaEventSynchronize 0.20 ms (1x), cuLaunchKernel 0.03 ms (1x), "
                        "cudaLaunchKernel 0.01 ms (1x), cudaStreamWaitEvent 0.00 ms (1x)"), bwd
    # the step after fwd+bwd is still the optimizer step's range: the side stream's spill is measured against it
    assert "of it 0.2 ms after the main stream's end" in text
    # without bench/forward: one line for the whole fwd+bwd
    plain = trace_streams.report(_events() + [call("cudaEventSynchronize", 1600, 200)], bin_ms=0.1)
    assert "host API calls in fwd+bwd (most time first): cudaEventSynchronize 0.20 ms (1x)" in plain
    assert "host: forward" not in plain
