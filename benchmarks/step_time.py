"""Step time, optimizer-step time, peak memory and bytes per step: ds_muon vs. DeepSpeed's built-in
Muon vs. AdamW (FusedAdam), ZeRO-3, same model, data and GPUs, in one invocation.

    python benchmarks/step_time.py --nproc 2 [--model 934m] [--steps 20] [--out results.json]
    python benchmarks/step_time.py --nproc 2 --model moe-1.5b   # MoE flavour: 8 stacked experts per layer, top 2
    python benchmarks/step_time.py --nproc 1 --stage 2 --optimizers adamw,builtin_muon,ds_muon   # ZeRO-2
    python benchmarks/step_time.py --nproc 1 --rounds 3 --optimizers adamw,ds_muon:reduce_scatter=false --out r.json

The driver launches one ``torchrun`` worker group per optimizer (a fresh process each, so peak
memory is per optimizer), then prints a table and the ratios against AdamW and the built-in.
An arm is an optimizer with optional ``zero_optimization`` overrides, ``name:key=value:key=value`` (e.g.
``adamw:reduce_scatter=false``; values are JSON: true, false, numbers); the table states every arm's ZeRO
settings. ``--rounds N`` runs the arms in rounds, ``A B C A B C ...`` (``--rotate``: ``A B C B C A ...``), one
fresh worker group per arm per round, so a drift of the machine over the run touches every arm alike (and with
``--rotate`` and N equal to the number of arms, the arm's place in the round too); each timing column is the median
over all timed steps of all rounds with its spread (the min-max of the per-round medians; with one round,
the quartiles of the steps). On CUDA every step is timed with CUDA events as well as the wall clock
(both are reported). ``--out`` is rewritten after every arm of every round, so a run cut short keeps
what finished, and ``--resume`` that file runs only the rounds it lacks (a run longer than one device call).
``--taskset CPUS`` pins every worker group to the same cores (the fwd+bwd at W=1 is host-bound, and its speed varies
between worker processes).

Targets (issue 14, 2xH200, micro-batch 4 x 1024, bf16): at 2.9B optimizer step <= 0.6x and step
<= 0.8x the built-in's; at 934M optimizer step <= 0.45x the built-in's; ds_muon step - AdamW step
<= 1.0x the Newton–Schulz floor (NS FLOPs per rank / measured bf16 matmul rate); peak memory <=
the built-in's with momentum_dtype "bfloat16" (ds_muon_bf16mom); Newton–Schulz kernels at >= 85%
of the matmul rate and at least as fast as torch.optim.Muon's and heavyball's on the same shapes at
equal or better orthogonality error; no torch.compile recompile-limit fallback (graphs counted).
The table reports what is reached.

Targets at ZeRO stage 2 (issue 24, one H200 and 2xH200 where lent, 934M): ds_muon's step at most the built-in's
(whole steps: at stages 1/2 the built-in runs Newton–Schulz inside the last backward, so its "optimizer step"
excludes it and the two optimizer-step columns do not measure the same work), peak memory at most 1.05x the
built-in's (fp32 momentum against its bf16 one).

Targets of issue 27 (one H200, W=1, measured with ``--rounds``): ds_muon's fwd+bwd at most 1.02x AdamW's with the
same ZeRO settings, in one run; its whole step at most 0.85x the built-in's at 934M, 2.9B and MoE-1.5B (each arm in
its best valid setting, said in the table); Adam-mini's optimizer step at most 1.1x AdamW's (FusedAdam) on 934M
and its peak memory at most AdamW's (the shard step alone: ``benchmarks/adam_mini_step.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ds_muon_eager: ns_compile false; ds_muon_gram: ns_method "gram" (Gram Newton–Schulz, fp16, bf16 exchange);
# ds_muon_bf16mom: momentum_dtype "bfloat16" (half the momentum memory, as the built-in keeps it)
# ds_muon_autotune: ns_autotune true (Newton-Schulz compiled with max-autotune, static shapes)
# ds_muon_nooverlap: overlap_backward false (the Muon step after backward, not speculated in it)
# ds_muon_overlap: overlap_backward true (the Muon step speculated in the last backward, committed at the step)
# adam_mini: ds_muon's ZeRO-3 Adam-mini ("type": "AdamMini", AdamW's hyperparameters), against adamw
OPTIMIZERS = ("adamw", "builtin_muon", "ds_muon", "ds_muon_eager", "ds_muon_gram", "ds_muon_bf16mom", "ds_muon_autotune",
              "ds_muon_nooverlap", "ds_muon_overlap", "adam_mini")


def parse_arm(spec: str) -> tuple[str, dict]:
    """``"adamw:reduce_scatter=false:overlap_comm=false"`` -> ``("adamw", {"reduce_scatter": False, ...})``: an
    optimizer of ``OPTIMIZERS`` and ``zero_optimization`` overrides (values JSON, else strings).

    Raises:
        ValueError: an unknown optimizer or an override without ``=``.
    """
    kind, *items = spec.strip().split(":")
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r} in arm {spec!r}; choose from {OPTIMIZERS}")
    zero = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"arm {spec!r}: {item!r} is not key=value (a zero_optimization key)")
        try:
            zero[key] = json.loads(value)
        except json.JSONDecodeError:
            zero[key] = value
    return kind, zero


def worker_env(kind: str) -> dict:
    """The environment of an arm's worker: this process's, with ``DS_MUON=0`` for ``builtin_muon``, so that ds_muon's
    zero-code activation (``ds_muon_autoload.pth``, where ds_muon is pip-installed) leaves DeepSpeed's own ``"Muon"``
    to it (without this an installed ds_muon would run in the built-in's arm)."""
    return dict(os.environ, DS_MUON="0") if kind == "builtin_muon" else dict(os.environ)


def check_engine_optimizer(kind: str, optimizer) -> None:
    """Raise SystemExit where an arm's engine does not run the optimizer it is named for: ``builtin_muon`` runs
    DeepSpeed's (no class of ds_muon's), every ``ds_muon*`` and ``adam_mini`` arm ds_muon's."""
    ours = type(optimizer).__module__.startswith("ds_muon")
    if kind == "builtin_muon" and ours:
        raise SystemExit(f"builtin_muon: the engine runs ds_muon's {type(optimizer).__name__}, not DeepSpeed's "
                         "built-in Muon (start the worker with DS_MUON=0: worker_env)")
    if (kind.startswith("ds_muon") or kind == "adam_mini") and not ours:
        raise SystemExit(f"{kind}: the engine runs {type(optimizer).__module__}.{type(optimizer).__name__}, "
                         "not ds_muon's optimizer")


def bench_options(spec: str) -> dict:
    """The arm's benchmark options (keys ``bench.*`` of its overrides, not ZeRO keys): ``bench.gc_freeze=true``
    runs ``gc.collect(); gc.freeze()`` in the worker after the warm-up steps (a diagnostic: how much of fwd+bwd is
    Python's cyclic garbage collector walking long-lived objects, such as the ones torch.compile leaves);
    ``bench.clip=X`` sets ``gradient_clipping`` to X (default 1.0; 0 turns clipping off: the regime where the
    overlapped Muon step commits what it speculated); ``bench.alternate_overlap=true`` (a ds_muon arm whose
    overlapped step runs) pauses the overlapped step on every second step, warm-up included
    (``OverlapHooks.overlap_paused``), and reports the timed paused steps apart, each against the overlapped steps
    around it (:func:`paired_overlap`; the arm's columns hold the overlapped steps only);
    ``bench.reduce_events=N`` sets DeepSpeed's ZeRO-3 ``max_param_reduce_events`` (2 in 0.19.8): backward's host
    waits (``Event.synchronize``) for the oldest reduced gradient bucket once more than N are in flight on the
    reduce stream, a back-pressure that a small ``reduce_bucket_size`` (ds_muon's 1e8 under the overlapped step, 5e7
    before) meets more often than DeepSpeed's 5e8; ``bench.reduce_stream_priority=P`` (a negative integer, CUDA's higher
    priorities; ZeRO-3 with ``overlap_comm``) replaces DeepSpeed's ZeRO-3 reduce stream, before the first step,
    with a stream of priority P (:func:`reduce_stream_at_priority`): its gradient copies, which the back-pressure
    above makes backward's host wait for, then take the SMs ahead of the speculative Newton–Schulz's pending
    blocks on the side stream (and of backward's own kernels) instead of after them;
    ``bench.split_groups=true`` (an adamw arm) builds the engine with two parameter groups, the Muon engines'
    split (:func:`model_parameters`); ``bench.compile_probe=true`` (an adamw arm) runs ds_muon's compiled
    Newton–Schulz once on the device before the engine is built (:func:`compile_probe`), so that torch.compile,
    inductor and a Triton kernel have run in AdamW's process as in the Muon engines' (issue 40: the forward's
    host surcharge that both Muon engines pay at MoE-1.5B and AdamW with their parameter groups does not);
    ``bench.matmul_burst_s=S`` (any arm) keeps the device busy with bf16 matmuls for about S seconds before every
    step of the warm-up and the timed steps, outside the timed window (:func:`matmul_burst`): an AdamW arm then
    starts each forward on a GPU that has just run dense matmuls, as the Muon engines' forward follows their
    Newton–Schulz (a test of whether that state, such as a lowered clock, makes MoE-1.5B's forward, which waits on
    the GPU at its ``torch.where`` syncs, slower); the loop column runs without it;
    ``bench.stream_priority=P`` (a negative integer; any arm) makes a CUDA stream of priority P the worker's current
    stream before the engine is built (:func:`use_priority_stream`), so forward, backward and the step launch at a
    higher priority than the default of DeepSpeed's own streams and of ds_muon's side stream (0, CUDA's lowest):
    the block scheduler then takes backward's blocks ahead of the speculated Newton–Schulz's pending ones, which
    fill the SMs backward leaves (a test of how much of backward's waiting on the GPU that removes, and how much
    spill it adds);
    ``bench.memory_peak=P`` (P ``"fwd_bwd"`` or ``"step"``; any arm) records the CUDA caching allocator's history
    from before the engine is built (:func:`start_memory_history`), runs one more step after the timed ones and the
    loop, and reports every block held at phase P's peak in that step, the engine's own buffers included, by the
    line of ds_muon, DeepSpeed, the model or the benchmark that allocated it (:func:`recorded_peak`,
    :func:`peak_allocations`; the history costs host time on every allocation, so read this arm's memory, not its
    timings);
    ``bench.quintic_form=F`` (a ds_muon arm; F in ``QUINTIC_FORMS``, e.g. ``sym4``) runs Newton–Schulz in that
    form (``ds_muon.core.newton_schulz.QUINTIC_FORM`` set in the worker before the engine is built), so that a
    form the microbenchmark favours is timed end to end against the default in the same run. Keys ``opt.*`` set
    the optimizer's params (``ds_muon_overlap:opt.overlap_cuda_graphs=false``).

    Raises:
        ValueError: ``bench.alternate_overlap`` or ``bench.quintic_form`` on an arm that is not ds_muon's,
            ``bench.split_groups`` or ``bench.compile_probe`` on one that is not adamw;
            ``bench.matmul_burst_s`` not a number > 0; ``bench.memory_peak`` not in ``MEMORY_PHASES``;
            ``bench.reduce_events`` not an integer >= 1;
            ``bench.reduce_stream_priority`` or ``bench.stream_priority`` not a negative integer;
            ``bench.quintic_form`` not in ``QUINTIC_FORMS``.
    """
    kind, overrides = parse_arm(spec)
    options = {k[len("bench."):]: v for k, v in overrides.items() if k.startswith("bench.")}
    if options.get("alternate_overlap") and not kind.startswith("ds_muon"):
        raise ValueError(f"arm {spec!r}: bench.alternate_overlap pauses ds_muon's overlapped Muon step; use it on a "
                         "ds_muon arm")
    events = options.get("reduce_events")
    if events is not None and (isinstance(events, bool) or not isinstance(events, int) or events < 1):
        raise ValueError(f"arm {spec!r}: bench.reduce_events={events!r} is not an integer >= 1 (DeepSpeed's ZeRO-3 "
                         "max_param_reduce_events)")
    priority = options.get("reduce_stream_priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or priority >= 0):
        raise ValueError(f"arm {spec!r}: bench.reduce_stream_priority={priority!r} is not a negative integer (a "
                         "CUDA stream priority above the default stream's 0)")
    if options.get("split_groups") and kind != "adamw":
        raise ValueError(f"arm {spec!r}: bench.split_groups gives AdamW the Muon engines' two parameter groups; use "
                         "it on an adamw arm")
    if options.get("compile_probe") and kind != "adamw":
        raise ValueError(f"arm {spec!r}: bench.compile_probe runs ds_muon's compiled Newton-Schulz in AdamW's process; "
                         "use it on an adamw arm (the Muon engines compile their own)")
    main_priority = options.get("stream_priority")
    if main_priority is not None and (isinstance(main_priority, bool) or not isinstance(main_priority, int)
                                      or main_priority >= 0):
        raise ValueError(f"arm {spec!r}: bench.stream_priority={main_priority!r} is not a negative integer (a CUDA "
                         "stream priority above the default stream's 0)")
    if options.get("memory_peak") is not None and options["memory_peak"] not in MEMORY_PHASES:
        raise ValueError(f"arm {spec!r}: bench.memory_peak={options['memory_peak']!r} is not one of {MEMORY_PHASES}")
    burst = options.get("matmul_burst_s")
    if burst is not None and (isinstance(burst, bool) or not isinstance(burst, (int, float)) or not burst > 0):
        raise ValueError(f"arm {spec!r}: bench.matmul_burst_s={burst!r} is not a number of seconds > 0")
    form = options.get("quintic_form")
    if form is not None:
        sys.path.insert(0, REPO)  # this checkout's ds_muon, as the worker imports it
        from ds_muon.core.newton_schulz import QUINTIC_FORMS
        if not kind.startswith("ds_muon"):
            raise ValueError(f"arm {spec!r}: bench.quintic_form sets ds_muon's Newton-Schulz form; use it on a "
                             "ds_muon arm")
        if form not in QUINTIC_FORMS:
            raise ValueError(f"arm {spec!r}: bench.quintic_form={form!r} is not one of {QUINTIC_FORMS}")
    return options


def model_parameters(model, options: dict):
    """What an arm's engine is built with: ``model.parameters()``, or with ``bench.split_groups=true`` (an adamw arm)
    two parameter groups, the parameters ds_muon trains with Muon (``ds_muon.model.selection.select_muon_params``)
    and the rest, as ds_muon groups them (the built-in's split differs in MoE routers, which it gives Muon and
    ds_muon AdamW; the same AdamW on each group here): whether the grouping itself changes ZeRO-3's fwd+bwd
    (issue 40: at MoE-1.5B both Muon engines' forward and backward took more host time than AdamW's, with the same
    Python calls in the forward)."""
    if not options.get("split_groups"):
        return model.parameters()
    from ds_muon.model.selection import select_muon_params
    muon = select_muon_params(model).use_muon
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if muon.get(n)]}, {"params": [p for n, p in named if not muon.get(n)]}]


def use_priority_stream(device, priority: int):
    """``bench.stream_priority``: a new stream on ``device`` at priority ``priority`` (lower is higher; PyTorch
    clamps it to the few levels it keeps, e.g. −3 at most on an H100 whose CUDA range is [−5, 0]: the worker
    records the stream's effective ``priority``), made the current stream; returned. Everything the worker
    launches after this, the engine's build included, goes to it unless code picks another stream: DeepSpeed's
    overlap streams and ds_muon's side stream wait on the current stream; ds_muon still allocates its stashes on
    the default stream (their blocks then serve no activation on this one, so ``peak_reserved_gib`` may read
    higher; the allocated peaks do not change) and its commit waits on the side stream from the current one, as
    in any run. With ``overlap_comm`` false DeepSpeed's reduce and gather streams are the default stream, not
    this one."""
    import torch
    stream = torch.cuda.Stream(device=device, priority=priority)
    torch.cuda.set_stream(stream)
    return stream


#: The phases ``bench.memory_peak`` records: the forward and backward, or the optimizer step (``engine.step()``).
MEMORY_PHASES = ("fwd_bwd", "step")
#: Frames ``peak_allocations`` names an allocation by: the innermost one in a file under one of these folders.
MEMORY_OWNERS = ("/ds_muon/", "/deepspeed/", "/examples/", "/benchmarks/")
#: Entries the allocator's history keeps (a ring: past it the oldest are overwritten, which ``recorded_peak`` flags).
MEMORY_HISTORY_ENTRIES = 5_000_000
#: Bytes of the one-byte-element block ``recorded_peak`` allocates and frees right before the recorded phase, an odd
#: size no tensor of the run requests, to find where the phase starts in the history.
MEMORY_MARKER_BYTES = 7 * 2**20 + 1
#: The site of a block allocated with neither a Python frame nor an autograd node in its frames (the fwd+bwd phase
#: records C++ frames too, so backward's autograd thread's blocks are named by their node instead).
NO_PYTHON_FRAME = "no Python frame (autograd's backward thread)"


def _allocation_site(frames) -> str:
    """Where a block was allocated, from its frames (the allocator's trace, innermost first): the innermost frame in a
    file under one of :data:`MEMORY_OWNERS` (``path:line function``, the path from that folder on); else, for a
    block that backward's autograd thread allocated (no Python frame runs there), the innermost autograd node among
    its C++ frames (``autograd <node>``); else the innermost Python frame's file (basename), line and function;
    else :data:`NO_PYTHON_FRAME`."""
    frames = list(frames or ())
    for f in frames:
        name = f.get("filename", "")
        for owner in MEMORY_OWNERS:
            if owner in name:
                return f"{owner.strip('/')}/{name.split(owner, 1)[1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if "Backward" in f.get("name", ""):
            return f"autograd {f['name']}"
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{os.path.basename(f['filename'])}:{f.get('line')} {f.get('name')}"
    return NO_PYTHON_FRAME


def peak_allocations(trace: list, baseline: int = 0, start: int = 0, top: int = 15) -> dict:
    """Every block held at one phase's peak, from the CUDA caching allocator's history.

    ``trace``: one device's ``torch.cuda.memory._snapshot()["device_traces"]`` entries (dicts with ``action``,
    ``addr``, ``size``, ``frames``, innermost first), recorded from before the engine existed; the allocator records
    ``alloc`` and the frees with the requested size in bytes (not the rounded block size that ``memory_allocated``
    counts), and its ``requested_bytes`` statistic drops at ``free_completed`` (the block is reusable;
    ``free_requested`` comes earlier where other streams still use it). ``baseline``: requested bytes held when the
    recording started (0 where it started before any allocation). ``start``: the entry at which the phase begins.
    Replays ``alloc`` and ``free_completed`` (``free_requested`` where the trace has no ``free_completed``) over the
    whole trace, finds the first entry at or after ``start`` at which the held bytes peak, and groups the blocks
    live there by :func:`_allocation_site`.

    Returns:
        ``{"baseline_gib", "peak_gib"`` (baseline + the replay's held bytes at the peak; equal to the allocator's
        ``requested_bytes.all.peak`` over the phase where the history is whole), ``"at_start_gib"`` (held when the
        phase began), ``"phase_live_gib"`` (of the peak's blocks, those allocated in the phase), ``"groups"``:
        ``[[site, GiB, blocks, GiB of them allocated in the phase], ...]`` largest first, at most ``top``,
        ``"other_gib"``: the rest, ``"entry"``: the index of the entry after which the peak is held (``start - 1``
        where nothing in the phase rises above its start, the last entry where ``start`` is past the trace)}.
    """
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in trace) else "free_requested"
    total = 0
    at_start = best = None
    best_at = -1
    for i, e in enumerate(trace):
        if i == start:  # the phase's peak is at least what it starts with
            at_start, best, best_at = total, total, i - 1
        if e.get("action") == "alloc":
            total += e["size"]
        elif e.get("action") == free_action:
            total -= e["size"]
        if best is not None and total > best:
            best, best_at = total, i
    if at_start is None:  # the phase has no entry (start at the trace's end): its peak is what the trace ends with
        at_start, best, best_at = total, total, len(trace) - 1
    live: dict = {}
    for i, e in enumerate(trace[:best_at + 1]):
        if e.get("action") == "alloc":
            live[e["addr"]] = (i, e)
        elif e.get("action") == free_action:
            live.pop(e["addr"], None)
    groups: dict = {}
    for i, e in live.values():
        site = _allocation_site(e.get("frames"))
        size, count, new = groups.get(site, (0, 0, 0))
        groups[site] = (size + e["size"], count + 1, new + (e["size"] if i >= start else 0))
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"baseline_gib": baseline / 2**30, "peak_gib": (baseline + best) / 2**30,
            "at_start_gib": (baseline + at_start) / 2**30,
            "phase_live_gib": sum(e["size"] for i, e in live.values() if i >= start) / 2**30,
            "groups": [[site, size / 2**30, count, new / 2**30] for site, (size, count, new) in ranked[:top]],
            "other_gib": sum(size for _, (size, _, _) in ranked[top:]) / 2**30, "entry": best_at}


def _requested_bytes(device, key: str) -> int:
    """The caching allocator's ``requested_bytes.all.<key>`` on ``device`` (``"current"`` or ``"peak"``), bytes."""
    import torch
    return int(torch.cuda.memory_stats(device).get(f"requested_bytes.all.{key}", 0))


def start_memory_history(device) -> int:
    """``bench.memory_peak``: start recording the caching allocator's history on ``device`` (Python frames, up to
    :data:`MEMORY_HISTORY_ENTRIES` entries), before the engine is built, so that its buffers are named too; returns
    the requested bytes already held (the replay's baseline). CUDA only."""
    import torch
    held = _requested_bytes(device, "current")
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=MEMORY_HISTORY_ENTRIES, clear_history=True)
    return held


def recorded_peak(engine, x, device, phase: str, baseline: int) -> dict:
    """``bench.memory_peak``: one step of ``engine`` on the batch ``x`` (token ids ``[micro_batch, seq + 1]``), with
    the history :func:`start_memory_history` started (``baseline``: what it returned, bytes), marked at the start
    of ``phase`` (:data:`MEMORY_PHASES`): a :data:`MEMORY_MARKER_BYTES` block allocated and freed, the phase
    starting at the history's entry after its ``free_completed`` (found by its address and size), the peak
    statistics reset after it; for the fwd+bwd the recording takes C++ frames from there on too (``stacks="all"``,
    the history kept), so that backward's autograd-thread blocks are named by their node. Then the history is taken
    and the recording stopped (also where the phase raises). Returns :func:`peak_allocations` of the phase with
    ``requested_peak_gib`` (the allocator's own ``requested_bytes`` peak over the phase: the replay's ``peak_gib``
    should equal it), ``max_allocated_gib`` (its peak in rounded blocks, as the table's peak columns count),
    ``held_at_start_gib`` (the allocator's requested bytes after the marker: the replay's ``at_start_gib`` should
    equal it, else the history is incomplete or the baseline wrong) and ``wrapped`` (the history reached
    :data:`MEMORY_HISTORY_ENTRIES`: its oldest entries may be lost). CUDA only.

    Raises:
        RuntimeError: the marker's free is not in the history (recording was stopped or cleared, or the phase alone
            wrote more than :data:`MEMORY_HISTORY_ENTRIES` entries).
    """
    import torch
    record = torch.cuda.memory._record_memory_history

    def fwd_bwd():
        engine.backward(engine(x[:, :-1], x[:, 1:]))

    def mark() -> tuple[int, int]:
        torch.cuda.synchronize()
        if phase == "fwd_bwd":
            record(enabled="all", context="alloc", stacks="all", max_entries=MEMORY_HISTORY_ENTRIES,
                   clear_history=False)
        marker = torch.empty(MEMORY_MARKER_BYTES, dtype=torch.uint8, device=device)
        addr = marker.data_ptr()
        del marker
        torch.cuda.reset_peak_memory_stats(device)
        return addr, _requested_bytes(device, "current")

    try:
        if phase == "fwd_bwd":
            addr, held = mark()
            fwd_bwd()
        else:
            fwd_bwd()
            addr, held = mark()
            engine.step()
        torch.cuda.synchronize()
        requested_peak, max_allocated = _requested_bytes(device, "peak"), torch.cuda.max_memory_allocated(device)
        traces = torch.cuda.memory._snapshot(device)["device_traces"]
    finally:
        record(enabled=None)
    if phase == "fwd_bwd":
        engine.step()
        torch.cuda.synchronize()
    trace = traces[device.index if device.index is not None else torch.cuda.current_device()]
    freed = [i for i, e in enumerate(trace) if e.get("action") == "free_completed" and e.get("addr") == addr
             and e.get("size") == MEMORY_MARKER_BYTES]
    if not freed:
        raise RuntimeError(f"bench.memory_peak: the {phase} phase's marker is not in the allocator's history "
                           f"({len(trace)} entries): recording was stopped or cleared, or the phase alone wrote more "
                           f"than MEMORY_HISTORY_ENTRIES ({MEMORY_HISTORY_ENTRIES})")
    return dict(peak_allocations(trace, baseline, start=freed[-1] + 1), phase=phase,
                requested_peak_gib=requested_peak / 2**30, max_allocated_gib=max_allocated / 2**30,
                held_at_start_gib=held / 2**30, wrapped=len(trace) >= MEMORY_HISTORY_ENTRIES)


def matmul_burst(device, seconds: float, size: int = 4096) -> int:
    """``bench.matmul_burst_s``: bf16 matmuls of ``size`` x ``size`` on ``device``, one after another, until about
    ``seconds`` of wall time have passed, then wait for the device; the inputs are freed on return (the caching
    allocator keeps their blocks). Returns the number of matmuls run (> 0)."""
    import torch
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(8):
            a @ b
        n += 8
        _sync(device)
        if time.perf_counter() - t0 >= seconds:
            return n


def compile_probe(device, backend: str = "inductor") -> None:
    """``bench.compile_probe``: run ds_muon's compiled Newton–Schulz
    (``ds_muon.core.ns_compile.compiled_orthogonalize``, 5 steps, bf16) once on a (2, 256, 512) bf16 batch on
    ``device`` and wait for it (the finiteness check reads the result on the host): torch.compile, inductor and
    (on CUDA) a Triton kernel have then run in the process, as in every Muon engine's, with no other change to an
    AdamW arm. Raises RuntimeError where the result has another shape or a non-finite value. ``backend``
    ``"eager"`` for the CPU tests (inductor needs a C++ compiler there)."""
    import torch
    from ds_muon.core.ns_compile import compiled_orthogonalize
    fn = compiled_orthogonalize(steps=5, dtype=torch.bfloat16, backend=backend, mode=None)
    out = fn(torch.randn(2, 256, 512, device=device, dtype=torch.bfloat16))
    if out.shape != (2, 256, 512) or not torch.isfinite(out.float()).all():
        raise RuntimeError(f"bench.compile_probe: the compiled Newton-Schulz returned {tuple(out.shape)}, "
                           "or a non-finite value")


def build_engine(kind: str, model, cfg: dict, options: dict):
    """The arm's DeepSpeed engine for ``model``: ``ds_muon.initialize`` for every ``ds_muon*`` and ``adam_mini`` arm
    (after :func:`use_quintic_form`), ``deepspeed.initialize`` with :func:`model_parameters` for the others, then
    :func:`check_engine_optimizer` (SystemExit where the engine runs another optimizer than the arm's)."""
    if kind.startswith("ds_muon") or kind == "adam_mini":
        import ds_muon
        use_quintic_form(options)
        engine = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    else:
        import deepspeed
        engine = deepspeed.initialize(model=model, model_parameters=model_parameters(model, options), config=cfg)[0]
    check_engine_optimizer(kind, engine.optimizer)
    return engine


def use_quintic_form(options: dict) -> str:
    """Set ``ds_muon.core.newton_schulz.QUINTIC_FORM`` to the arm's ``bench.quintic_form`` where it has one (the
    engine reads it when it builds its Newton–Schulz functions: call this before ``ds_muon.initialize``); the
    form the arm runs."""
    from ds_muon.core import newton_schulz
    if options.get("quintic_form") is not None:
        newton_schulz.QUINTIC_FORM = options["quintic_form"]
    return newton_schulz.QUINTIC_FORM


def ns_loads(plans, world_size: int, steps: int, method: str, form: str) -> list[int]:
    """Newton–Schulz matmul FLOPs per rank per step over the owner plans, counted in quintic ``form``
    (``MatrixView.cost`` of each owned batch; the plans' own ``load()`` counts the default form, ``auto``, which runs
    ``sym2`` at 2.9B's shapes: a ``sym`` form cuts ``plain``'s FLOPs there by 15-23%)."""
    from ds_muon.core.matrix import matrix_view
    loads = [0] * world_size
    for plan in plans:
        for bucket in getattr(plan, "buckets", (plan,)):
            for rank in range(world_size):
                for b in bucket.batches[rank]:
                    view = b.view if b.view is not None else matrix_view(b.ns_shape)
                    loads[rank] += b.count * view.cost(steps, method, form)
    return loads


def arm_settings(spec: str, micro_batch: int, stage: int = 3) -> str:
    """What an arm runs, for the table: its ZeRO settings (stage, reduce_scatter, overlap_comm and every
    override), bf16, clipping, micro-batch, and the optimizer's params that set it apart (ns_method, ...)."""
    kind, _ = parse_arm(spec)
    cfg = ds_config(spec, micro_batch, stage)
    zero = cfg["zero_optimization"]
    text = [f"ZeRO {zero['stage']}"] + [f"{k}={json.dumps(v)}" for k, v in zero.items() if k != "stage"]
    params = cfg["optimizer"]["params"]
    base = ds_config("adamw" if kind in ("adamw", "adam_mini") else "ds_muon", micro_batch, stage)["optimizer"]["params"]
    text += [f"{k}={json.dumps(v)}" for k, v in params.items() if base.get(k) != v]
    text += [f"bench.{k}={json.dumps(v)}" for k, v in bench_options(spec).items()]
    return ", ".join(text + [f"bf16, clip {cfg['gradient_clipping']}, micro-batch {micro_batch}"])


def ds_config(kind: str, micro_batch: int, stage: int = 3) -> dict:
    """The DeepSpeed config of an arm (``kind``: an optimizer of ``OPTIMIZERS``, or an arm spec with
    ``zero_optimization`` overrides, :func:`parse_arm`)."""
    kind, zero = parse_arm(kind)
    clip = zero.get("bench.clip", 1.0)
    opt = {k[len("opt."):]: v for k, v in zero.items() if k.startswith("opt.")}
    zero = {k: v for k, v in zero.items() if not k.startswith(("bench.", "opt."))}
    # The built-in refuses reduce_scatter with Muon at stage 3 ("Muon and reduce scatter cannot be used together");
    # at stages 1/2 it takes it.
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "bf16": {"enabled": True},
        "steps_per_print": 1_000_000,
        "zero_optimization": {"stage": stage, "overlap_comm": True,
                              "reduce_scatter": kind != "builtin_muon" or stage < 3},
    }
    if kind in ("adamw", "adam_mini"):
        cfg["optimizer"] = {"type": "AdamW" if kind == "adamw" else "AdamMini",
                            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    else:
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1,
                                                       "adam_lr": 3e-4}}
        if kind == "ds_muon_eager":
            cfg["optimizer"]["params"]["ns_compile"] = False
        if kind == "ds_muon_gram":  # bf16 on the wire like the default (auto would pick fp32 for fp16 NS)
            cfg["optimizer"]["params"].update(ns_method="gram", exchange_dtype="bfloat16")
        if kind == "ds_muon_bf16mom":
            cfg["optimizer"]["params"]["momentum_dtype"] = "bfloat16"
        if kind == "ds_muon_autotune":
            cfg["optimizer"]["params"]["ns_autotune"] = True
        if kind == "ds_muon_nooverlap":
            cfg["optimizer"]["params"]["overlap_backward"] = False
        if kind == "ds_muon_overlap":
            cfg["optimizer"]["params"]["overlap_backward"] = True
    cfg["optimizer"]["params"].update(opt)
    cfg["zero_optimization"].update(zero)
    return cfg


def matmul_tflops(device, size: int = 8192, dtype=None) -> float:
    """Measured dense matmul rate (TFLOP/s) on ``size``^3 in ``dtype`` (default bf16) on ``device``."""
    import torch
    device = torch.device(device)
    dtype = torch.bfloat16 if dtype is None else dtype
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        a @ b
    _sync(device)
    return 2 * size**3 * n / (time.perf_counter() - t) / 1e12


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


NS_SHAPES = ((16, 2048, 2048), (16, 5440, 2048), (16, 2048, 5440))  # (batch, rows, cols) of the 934M model
#: What ``--ns-micro`` times by default, in this order (the GPU run's priorities first). ``method[opts]``
#: is ds_muon's ``orthogonalize(method)`` with ``opts`` (see ``ns_variant``); other names are peers.
NS_VARIANTS = ("standard", "heavyball", "torch.optim.Muon", "standard[autotune]", "standard[autotune,dynamic]",
               "standard[fused,autotune]", "polar_express[autotune]", "gram[autotune]", "standard[fused]",
               "standard[static]")
PEERS = ("heavyball", "torch.optim.Muon")
AUTOTUNE = "max-autotune-no-cudagraphs"  # heavyball's torch.compile mode for its Newton-Schulz; ds_muon's ns_autotune (test_ns_micro)


def _peer_kernel(name: str, steps: int):
    """Another project's Newton–Schulz on a ``(b, m, n)`` batch: torch.optim.Muon's own iteration
    (eager, one matrix at a time, as torch.optim.Muon runs it) or heavyball's (compiled by heavyball
    itself: ``max-autotune-no-cudagraphs``, static shapes). Raises ImportError if not installed."""
    import torch
    if name == "torch.optim.Muon":
        from torch.optim import _muon
        coeffs = getattr(_muon, "DEFAULT_NS_COEFFICIENTS", (3.4445, -4.775, 2.0315))
        fn = _muon._zeropower_via_newtonschulz
        return lambda x: torch.stack([fn(m, coeffs, steps, 1e-7) for m in x])
    if name == "heavyball":
        from heavyball.utils import zeropower_via_newtonschulz5
        return lambda x: zeropower_via_newtonschulz5(x, steps)
    raise ValueError(f"unknown peer {name!r}; peers: {PEERS}")


def _quintic_form(form: str):
    """Other ways to write ds_muon's standard quintic (same normalization and orientation as
    ``orthogonalize``), kept for the microbenchmark: ``baddbmm`` is ds_muon's form before 2026-12-01
    (``X <- baddbmm(X, baddbmm(A, A, A), X)``: the sums in the matmuls' fp32 epilogues), ``hybrid``
    computes ``bA + cA^2`` in one baddbmm on the small side and the long-side product as a plain
    matmul (half the bf16 deviation of the plain form, tests/unit/test_newton_schulz.py). ds_muon's own forms
    (``QUINTIC_FORMS``: ``auto``, ``plain``, ``fused``, ``sym2``, ``sym4``) run through ``orthogonalize``'s ``form``
    instead. Returns ``run(x, dtype, steps)``."""
    import torch
    from ds_muon.core.newton_schulz import QUINTIC_COEFFS, frobenius_normalize as _normalize

    def baddbmm(X, a, b, c):
        A = torch.bmm(X, X.mT)
        return torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)

    def hybrid(X, a, b, c):
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        B.diagonal(dim1=-2, dim2=-1).add_(a)
        return torch.bmm(B, X)

    step = {"baddbmm": baddbmm, "hybrid": hybrid}[form]

    def run(x, dtype, steps):
        X = _normalize(x, 1.0).to(dtype)
        tall = X.shape[-2] > X.shape[-1]
        X = X.mT if tall else X
        for _ in range(steps):
            X = step(X, *QUINTIC_COEFFS)
        return X.mT if tall else X

    return run


_OPTS = ("eager", "static", "dynamic", "autotune", "auto", "fused", "plain", "baddbmm", "hybrid", "sym2", "sym4",
         "cublaslt")


def _with_cublaslt(fn):
    """``fn`` run (and compiled, on its first call) with cuBLASLt as torch's preferred BLAS library
    (``torch.backends.cuda.preferred_blas_library``; batched bf16 matmuls then go through cublasLt's heuristics
    instead of cublas's), the previous preference restored after each call; CUDA only."""
    import torch

    def run(x):
        if x.device.type != "cuda":
            return fn(x)
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return fn(x)
        finally:
            torch.backends.cuda.preferred_blas_library(before)

    return run


def ns_variant(name: str, steps: int, device, backend: str = "inductor"):
    """See ``_ns_variant``; option ``cublaslt`` wraps its function in ``_with_cublaslt``."""
    fn, method, dtype = _ns_variant(name, steps, device, backend)
    if "cublaslt" in name.partition("[")[2]:
        fn = _with_cublaslt(fn)
    return fn, method, dtype


def _variant_opts(name: str) -> tuple[str, str, list[str]]:
    """``method[opt,...]`` -> ``(method, "opt,...]", [opt, ...])`` (options stripped; none without brackets)."""
    method, _, rest = name.partition("[")
    return method, rest, [o.strip() for o in rest.rstrip("]").split(",") if o.strip()] if rest else []


def _ns_variant(name: str, steps: int, device, backend: str = "inductor"):
    """``(fn, flops_method, dtype)`` for a microbenchmark variant ``name``.

    ``name`` is a peer (``PEERS``) or ``method[opt,...]`` with ``method`` in ds_muon's ``NS_METHODS``
    and options: ``eager`` (not compiled), ``static`` (``dynamic=False``), ``dynamic``
    (``dynamic=True``), ``autotune`` (``mode="max-autotune-no-cudagraphs"``, static unless
    ``dynamic``), ``auto``/``fused``/``plain``/``sym2``/``sym4`` (``QUINTIC_FORMS``: ``sym2``/``sym4`` take the
    quintic's two symmetric products from their upper blocks, ``symmetric_product``; ``auto``, the default, picks
    ``sym2`` or ``plain`` by shape; compare against ``plain`` by naming it), ``baddbmm``/``hybrid`` (other forms of the
    standard quintic, ``_quintic_form``), ``cublaslt`` (cuBLASLt as the preferred BLAS library, CUDA
    only). No options: ``compiled_orthogonalize(method)`` as ds_muon runs it (``COMPILE_MODE``,
    ``COMPILE_DYNAMIC``, ``QUINTIC_FORM``). Compute dtype: bf16 (gram: fp16, as ``resolve_ns_dtype``'s ``auto``);
    float32 on CPU. ``backend`` other than inductor (tests: ``"eager"``) drops ``autotune``."""
    import functools

    import torch
    from ds_muon.core.newton_schulz import NS_METHODS, QUINTIC_FORMS, orthogonalize
    from ds_muon.core.ns_compile import compiled_orthogonalize
    from ds_muon.core.dtypes import resolve_ns_dtype
    if name in PEERS:
        return _peer_kernel(name, steps), "standard", torch.bfloat16
    method, rest, opts = _variant_opts(name)
    if method not in NS_METHODS or not rest.endswith("]") and rest or any(o not in _OPTS for o in opts):
        raise ValueError(f"bad Newton-Schulz variant {name!r}: a peer {PEERS} or method[opt,...] with method in "
                         f"{NS_METHODS} and opts in {_OPTS}")
    dtype = resolve_ns_dtype("auto", method, "cuda") if torch.device(device).type != "cpu" else torch.float32
    forms = [o for o in opts if o in QUINTIC_FORMS or o in ("baddbmm", "hybrid")]
    form = forms[0] if forms else None
    if form in ("baddbmm", "hybrid") and method != "standard":
        raise ValueError(f"bad Newton-Schulz variant {name!r}: {form} is a form of the standard quintic")
    if "eager" in opts:
        if form in ("baddbmm", "hybrid"):
            return functools.partial(_quintic_form(form), dtype=dtype, steps=steps), method, dtype
        return functools.partial(orthogonalize, method=method, steps=steps, dtype=dtype, form=form), method, dtype
    kw = {}
    if "autotune" in opts and backend == "inductor":
        kw["mode"] = AUTOTUNE
    if "dynamic" in opts:
        kw["dynamic"] = True
    elif "static" in opts or "autotune" in opts:
        kw["dynamic"] = False
    if form in ("baddbmm", "hybrid"):
        fn = torch.compile(functools.partial(_quintic_form(form), dtype=dtype, steps=steps), backend=backend,
                           dynamic=kw.get("dynamic", True), mode=kw.get("mode"))
        return fn, method, dtype
    return compiled_orthogonalize(method, steps, dtype, backend, form=form, **kw), method, dtype


def orthogonality_error(out, x) -> float:
    """``||O - U V^T||_F / ||U V^T||_F`` on the first matrix of the batch (``x = U S V^T``, fp32 SVD)."""
    import torch
    u, _, vt = torch.linalg.svd(x[0].float(), full_matrices=False)
    polar = u @ vt
    return float(torch.linalg.matrix_norm(out[0].float() - polar) / torch.linalg.matrix_norm(polar))


def ns_microbenchmark(out_path: str, steps: int = 5, shapes=NS_SHAPES, variants=NS_VARIANTS, device=None,
                      iters: int = 10, backend: str = "inductor") -> dict:
    """Achieved TFLOP/s of Newton–Schulz (batched) per shape and variant (``ns_variant``: ds_muon's
    kernels compiled several ways, and the peers' kernels), against the dense matmul rate measured in
    the same process, with each output's orthogonality error, the first call's seconds (compile and
    autotune) and the torch.compile graphs it added; one device. The input is a captured-like
    momentum: a random matrix with a decaying spectrum (singular values 1/(1+i)), bf16. Rows go to
    stdout and ``out_path`` (JSON) as they are measured, so a run cut short keeps what it measured.
    A variant that fails (e.g. a peer not installed) is reported as a row with ``error``."""
    import torch
    from torch._dynamo.utils import counters
    sys.path.insert(0, REPO)
    from ds_muon.core.newton_schulz import QUINTIC_FORM
    from ds_muon.core.ns_cost import QUINTIC_FORMS, ns_flops
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = device.type == "cpu"
    rate = matmul_tflops(device, 256 if cpu else 8192, torch.float32 if cpu else torch.bfloat16)
    result = {"matmul_tflops": rate, "device": str(device), "torch": torch.__version__, "rows": []}
    print(f"dense matmul rate {rate:.3g} TFLOP/s on {device}", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = {}
    for b, m, n in shapes:
        k = min(m, n)
        u = torch.linalg.qr(torch.randn(b, m, k, device=device, generator=gen)).Q
        v = torch.linalg.qr(torch.randn(b, n, k, device=device, generator=gen)).Q
        s = 1.0 / (1.0 + torch.arange(k, device=device, dtype=torch.float32))
        inputs[b, m, n] = ((u * s) @ v.mT).to(torch.bfloat16)
    # variants outer, shapes inner: a run cut short (--ns-timeout) keeps the first variants on every shape
    for name in variants:
        for (b, m, n), x in inputs.items():
            row = dict(method=name, shape=[b, m, n])
            try:
                graphs0 = int(counters["stats"].get("unique_graphs", 0))
                fn, flops_method, _ = ns_variant(name, steps, device, backend)
                # the variant's own FLOPs: a sym form does fewer (its time, not its rate, is what to compare); a
                # variant without a form runs QUINTIC_FORM, a peer the plain quintic
                form = next((o for o in _variant_opts(name)[2] if o in QUINTIC_FORMS),
                            "plain" if name in PEERS else QUINTIC_FORM)
                flops = ns_flops(m, n, steps, flops_method, batch=b, form=form)
                t0 = time.perf_counter()
                out = fn(x)
                _sync(device)
                row["first_call_s"] = time.perf_counter() - t0
                for _ in range(2):
                    out = fn(x)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(x)
                _sync(device)
                sec = (time.perf_counter() - t0) / iters
                row.update(seconds=sec, tflops=flops / sec / 1e12, fraction_of_matmul=flops / sec / 1e12 / rate,
                           ortho_error=orthogonality_error(out, x),
                           graphs=int(counters["stats"].get("unique_graphs", 0)) - graphs0)
            except Exception as err:  # noqa: BLE001 - one broken variant must not lose the others' rows
                row["error"] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            result["rows"].append(row)
            print(_ns_row_text(row), flush=True)
            with open(out_path, "w") as f:
                json.dump(result, f)
    return result


def _ns_row_text(r: dict) -> str:
    shape = "x".join(map(str, r["shape"]))
    if "error" in r:
        return f"| {r['method']} | {shape} | failed: {r['error']} | | | | | |"
    return (f"| {r['method']} | {shape} | {r['seconds'] * 1e3:.2f} | {r['tflops']:.3g} | {r['fraction_of_matmul']:.0%} | "
            f"{r['ortho_error']:.3f} | {r['first_call_s']:.1f} | {r['graphs']} |")


NS_TABLE_HEADER = ("| variant | shape | ms | TFLOP/s | of matmul rate | orthogonality error | first call s | graphs |\n"
                   "|---|---|---|---|---|---|---|---|")


def profile_steps(engine, vocab: int, args, g, device, steps: int = 3) -> str:
    """torch.profiler over the fwd+bwd of ``steps`` training steps (the optimizer steps run between them, outside
    the profiler); returns two key_averages tables of rank 0: the top kernels and operators by self device time,
    and by self CPU time (fwd+bwd at ZeRO-3 is bound by the host's Python work, so both matter)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True)
    for _ in range(steps):
        x = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
        torch.cuda.synchronize()
        prof.start()
        with record_function("bench/forward_backward"):
            engine.backward(engine(x[:, :-1], x[:, 1:]))
        torch.cuda.synchronize()
        prof.stop()
        engine.step()
    table = prof.key_averages()
    return (f"fwd+bwd only, {steps} steps; by self device time:\n"
            + table.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70)
            + "\nby self CPU time:\n" + table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def trace_steps(engine, vocab: int, args, g, device, path: str, steps: int = 2) -> None:
    """A Chrome trace (``path``, rank 0 only) of ``steps`` whole training steps (forward, backward, optimizer step,
    no sync between them, as a training loop runs), with every stream and the host threads: where the GPU idles in
    backward, and whether work on a side stream (the overlapped Muon step) runs alongside backward's kernels."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function
    batches = [torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
               for _ in range(steps)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x in batches:
            with record_function("bench/forward_backward"):
                with record_function("bench/forward"):
                    loss = engine(x[:, :-1], x[:, 1:])
                engine.backward(loss)
            with record_function("bench/optimizer_step"):
                engine.step()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        prof.export_chrome_trace(path)


def trace_path(trace_dir: str, arm: str) -> str:
    """Where ``--trace`` keeps ``arm``'s Chrome trace: ``trace_dir/<arm>.json``, the arm's characters other than
    letters, digits, ``_``, ``.`` and ``-`` written as ``_``."""
    return os.path.join(trace_dir, re.sub(r'[^A-Za-z0-9_.-]', '_', arm) + ".json")


def report_traces(trace_dir: str, arms: list[str], results: dict) -> None:
    """Each arm's trace (``trace_dir/<arm>.json``) read by ``benchmarks/trace_streams.py``, printed and written next to
    it as ``<arm>.txt``, with the Newton-Schulz floor of the first arm that has one (``ns_floor_s``): on an AdamW or
    built-in trace, an estimate of how much of ds_muon's Newton-Schulz backward's idle GPU time could absorb.
    An arm whose rounds all failed (``"error"``) is passed over (a trace left from an earlier run may lie there), and
    a report that fails or takes over 300 s is printed as such: the tables above are never lost to it."""
    floors = [results[a]["ns_floor_s"] for a in arms if results.get(a, {}).get("ns_floor_s")]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_streams.py")
    for arm in arms:
        path = trace_path(trace_dir, arm)
        if not os.path.exists(path) or "error" in results.get(arm, {"error": "no result"}):
            continue
        cmd = [sys.executable, script, path, *(["--ns-floor-ms", f"{floors[0] * 1e3:.3f}"] if floors else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            text = proc.stdout if proc.returncode == 0 else f"trace_streams failed (exit {proc.returncode}):\n{proc.stderr}"
            with open(path[:-len(".json")] + ".txt", "w") as f:
                f.write(text)
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"trace_streams not reported: {type(exc).__name__}: {exc}"
        print(f"\n{arm}, trace ({path}):\n{text}", flush=True)


def _optimizer_state_bytes(engine) -> int:
    """Bytes of this rank's optimizer state (Adam moments, Muon momentum, Adam-mini block moments; not the fp32
    master weights or gradients), wherever it lives (accelerator or CPU)."""
    import torch
    return sum(v.numel() * v.element_size() for state in engine.optimizer.optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


class GcClock:
    """Seconds Python's cyclic garbage collector has run in this process since construction (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


class WaitClock:
    """Seconds and calls of the host's explicit waits on the GPU since construction: every call of
    ``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize`` and ``torch.cuda.synchronize`` (DeepSpeed's
    ZeRO-3 waits for its oldest reduced gradient bucket and parameter fetch with the first two once more than 2 are
    in flight, and for its reduce stream at backward's end), timed around the call, from any thread. Implicit waits
    (a copy to the host, ``.item()``) are not counted. ``targets``: ``(owner, attribute name)`` pairs to time (tests
    give stand-ins); :meth:`close` puts the originals back.

    Issue 40: the overlapped step's backward takes more host time the more Newton–Schulz work the side stream does
    (docs/benchmarks.md, "The defaults beside AdamW and the built-in"); this measures how much of it is the host
    waiting on the GPU."""

    def __init__(self, targets=None) -> None:
        import torch
        self.seconds, self.calls, self._originals = 0.0, 0, []
        for owner, name in targets or ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                                       (torch.cuda, "synchronize")):
            original = getattr(owner, name)
            self._originals.append((owner, name, original))
            setattr(owner, name, self._timed(original))

    def _timed(self, original):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1
        return timed

    def close(self) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)
        self._originals = []


def host_counters(stat: str = "/proc/stat", cpus=None) -> dict:
    """CPU counters of the cores this process may run on (``cpus``, default its ``sched_getaffinity``: with
    ``--taskset`` the pinned ones), for the fwd+bwd diagnostics (a per-step delta of each): ``busy_s``, the
    seconds those CPUs together spent not idle (user, nice, system, irq, softirq: the ``cpuN`` lines of
    ``/proc/stat``, proc(5), in clock ticks of 1/``SC_CLK_TCK`` s, 10 ms on most kernels, per CPU); ``steal_s``,
    the seconds a hypervisor ran something else on them; ``nivcsw``, this process's involuntary context switches
    (all threads; ``getrusage``). Empty where ``stat`` cannot be read (not Linux): no host diagnostics then."""
    cpus = set(os.sched_getaffinity(0) if cpus is None else cpus)
    busy = steal = 0
    try:
        with open(stat) as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    user, nice, system, _idle, _iowait, irq, softirq, st = (int(t) for t in fields[:8])
                    busy += user + nice + system + irq + softirq
                    steal += st
    except (OSError, ValueError):
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    return {"busy_s": busy / hz, "steal_s": steal / hz, "nivcsw": resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw}


def _device_allocs(device) -> int:
    """cudaMalloc calls of the caching allocator so far (``num_device_alloc``; 0 where torch does not count them)."""
    import torch
    return int(torch.cuda.memory_stats(device).get("num_device_alloc", 0))


def zero3_trace_complete(engine) -> float | None:
    """1.0 where DeepSpeed's ZeRO-3 parameter coordinator holds a complete module trace, 0.0 where it does not
    (recording one, or invalidated: a module ran out of the recorded order); None below ZeRO-3. Read after a
    backward: the trace only becomes complete in ``reset_step`` at the next forward's start, so 1.0 there means
    the whole fwd+bwd ran with it, prefetching each module's parameters ahead of its use; 0.0 means some of it
    fetched each module's parameters only when the module ran."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None:
        return None
    return 1.0 if offload.get_param_coordinator().is_complete_trace() else 0.0


def reduce_stream_at_priority(optimizer, priority: int) -> None:
    """``bench.reduce_stream_priority``: DeepSpeed 0.19.8's ZeRO-3 reduce stream (``reduce_and_partition_stream``,
    read at each use) replaced by ``torch.cuda.Stream(priority=priority)`` (torch clamps it to the priorities it
    has; the stream comes from torch's pool of that priority). Only the reduce stream: at one rank the parameter
    all-gather stream runs no kernel (``NoGatherHandle``), and at more ranks the all-gather runs on NCCL's stream.
    Call before the first step (no work is queued on the old stream then).

    Raises:
        SystemExit: ``optimizer`` has no side reduce stream (not ZeRO-3's, or ``overlap_comm`` false: DeepSpeed
            then reduces on the default stream).
    """
    import torch
    stream = getattr(optimizer, "reduce_and_partition_stream", None)
    if (getattr(optimizer, "parameter_offload", None) is None or not isinstance(stream, torch.cuda.Stream)
            or stream == torch.cuda.default_stream(stream.device)):
        raise SystemExit("bench.reduce_stream_priority: no ZeRO-3 reduce stream of its own to replace (ZeRO-3 with "
                         "overlap_comm true only)")
    optimizer.reduce_and_partition_stream = torch.cuda.Stream(device=stream.device, priority=priority)


def step_medians(samples: dict) -> tuple[dict, dict]:
    """A worker's ``{timing: [seconds per step]}`` without the timings it did not take (``loop_step_s`` without
    ``--loop-steps``), and ``{timing: median}`` of the rest."""
    taken = {k: v for k, v in samples.items() if v}
    return taken, {k: statistics.median(v) for k, v in taken.items()}


def training_loop_seconds(engine, vocab: int, args, g, device) -> float:
    """Seconds per step of ``args.loop_steps`` steps run as a training loop runs them: forward, backward and
    ``engine.step()`` back to back with no device sync between the phases or the steps (the batches are made on
    the device first), timed from one sync to the next. What the optimizer enqueues on the GPU can then overlap
    the host's work for the next forward (ZeRO-3's hooks), which the per-phase columns, synced around each
    phase, cannot show."""
    import torch
    batches = [torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
               for _ in range(args.loop_steps)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x in batches:
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / args.loop_steps


def sync_points(fn) -> dict:
    """Run ``fn()`` with CUDA's sync debug mode on (``torch.cuda.set_sync_debug_mode("warn")``) and return
    ``{"file:line": count}`` of the lines that made the host wait for the device (an ``.item()``, a
    ``bool(tensor)``, a copy to the CPU ...): for each such warning, the innermost frame of its stack in ds_muon,
    DeepSpeed, examples/ or benchmarks/ (else the innermost frame)."""
    import traceback
    import warnings
    import torch
    found: dict = {}
    mine = ("/ds_muon/", "/deepspeed/", "/examples/", "/benchmarks/")
    depth = len(traceback.extract_stack())  # the frames down to this one; fn's are the ones below

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[depth:-1] if not f.filename.endswith("warnings.py")]
        frame = next((f for f in reversed(stack) if any(m in f.filename for m in mine)), stack[-1])
        name = frame.filename.split("/site-packages/")[-1].replace(REPO + "/", "")
        where = f"{name}:{frame.lineno}"
        found[where] = found.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(REPO, "examples"))
    sys.path.insert(0, REPO)
    from model import CausalLM, ModelConfig
    from tests.support.comm_counter import by_op, counting, install
    install()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    kind, _ = parse_arm(args.optimizer)
    cfg, options = ds_config(args.optimizer, args.micro_batch, args.stage), bench_options(args.optimizer)
    torch.manual_seed(0)
    # no per-head max-logit recording (MuonClip): its cost is measured apart, by benchmarks/max_logit_cost.py
    model = CausalLM(ModelConfig.preset(args.model, max_seq_len=args.seq_len, record_max_logits=False))
    n_params = sum(p.numel() for p in model.parameters())
    if options.get("compile_probe"):
        compile_probe(device)
    memory_baseline = start_memory_history(device) if options.get("memory_peak") else None
    stream_priority = None
    if options.get("stream_priority") is not None:
        stream_priority = use_priority_stream(device, options["stream_priority"]).priority
    engine = build_engine(kind, model, cfg, options)
    vocab = model.cfg.vocab_size
    reduce_events = options.get("reduce_events")
    if reduce_events is not None:
        if not hasattr(engine.optimizer, "max_param_reduce_events"):
            raise SystemExit(f"{args.optimizer}: bench.reduce_events sets DeepSpeed's ZeRO-3 "
                             "max_param_reduce_events, which this optimizer does not have (ZeRO-3 only)")
        engine.optimizer.max_param_reduce_events = reduce_events
    priority = options.get("reduce_stream_priority")
    if priority is not None:
        reduce_stream_at_priority(engine.optimizer, priority)
    g = torch.Generator(device="cpu").manual_seed(rank)
    samples = {k: [] for k in TIMINGS + DIAGNOSTICS}
    # bench.alternate_overlap: every second step, warm-up included (so that the first timed pairs do not meet the
    # allocator's first change of pattern), runs with the overlapped Muon step paused; the timed ones are kept
    # apart (paired_overlap), out of the arm's columns; each timed overlapped step records whether it captured a
    # CUDA graph or fell back (a pair with such a step is left out of the pairing)
    alternate = bool(options.get("alternate_overlap"))
    paused_samples = {k: [] for k in TIMINGS + DIAGNOSTICS if k != "loop_step_s"}
    overlapped_flags: dict = {"captures": [], "fallbacks": []}
    if alternate and getattr(engine.optimizer, "speculative", None) is None:
        raise SystemExit(f"{args.optimizer}: bench.alternate_overlap needs the overlapped Muon step running "
                         "(a ds_muon arm with overlap_backward true, or \"auto\" where it applies)")
    losses = []
    peak_fwd_bwd = peak_step = peak_reserved = 0
    comm = None
    gc_clock, waits = GcClock(), WaitClock()
    for i in range(args.warmup + args.steps):
        if i == args.warmup and options.get("gc_freeze"):
            gc.collect()
            gc.freeze()
        x = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
        paused = alternate and (i - args.warmup) % 2 == 1  # the first timed step is an overlapped one
        pause = contextlib.ExitStack()
        if paused:
            pause.enter_context(engine.optimizer.overlap_paused())
        stats0 = dict(engine.optimizer.overlap_stats) if alternate else None
        if options.get("matmul_burst_s"):
            matmul_burst(device, options["matmul_burst_s"])
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # start, backward's end, step, forward
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        allocs0, gc0, cpu0, host0 = _device_allocs(device), gc_clock.seconds, time.process_time(), host_counters()
        wait0 = waits.seconds
        t0 = time.perf_counter()
        events[0].record()
        counter = counting() if i == args.warmup else None
        records = counter.__enter__() if counter else None
        loss = engine(x[:, :-1], x[:, 1:])
        events[3].record()
        t_fwd, wait_fwd = time.perf_counter(), waits.seconds
        engine.backward(loss)
        t_bwd, wait_bwd = time.perf_counter(), waits.seconds
        events[1].record()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        cpu, host = time.process_time() - cpu0, host_counters()
        trace_complete = zero3_trace_complete(engine)
        # the host's seconds in forward and in backward (no sync between them: where the host runs ahead of the
        # device they are its launch time, else the phase's), the forward's on the main stream (CUDA events)
        diagnostics = {"fwd_bwd_cpu_s": cpu, "fwd_bwd_gc_s": gc_clock.seconds - gc0,
                       "fwd_bwd_device_allocs": _device_allocs(device) - allocs0,
                       "fwd_host_s": t_fwd - t0, "bwd_host_s": t_bwd - t_fwd,
                       "fwd_wait_s": wait_fwd - wait0, "bwd_wait_s": wait_bwd - wait_fwd}
        if trace_complete is not None:
            diagnostics["zero3_trace_complete"] = trace_complete
        if host and host0:  # what else ran on this worker's CPUs meanwhile (its other ranks included): other
            # processes' and the kernel's CPU seconds (at clock-tick resolution: a step's value moves in steps of
            # 10 ms and can be below 0), the hypervisor's steal, this process's threads pushed off their CPU
            diagnostics.update(fwd_bwd_other_cpu_s=host["busy_s"] - host0["busy_s"] - cpu,
                               fwd_bwd_steal_s=host["steal_s"] - host0["steal_s"],
                               fwd_bwd_nivcsw=host["nivcsw"] - host0["nivcsw"])
        peak_fwd_bwd = max(peak_fwd_bwd, torch.cuda.max_memory_allocated(device))
        peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved(device))
        torch.cuda.reset_peak_memory_stats(device)
        engine.step()
        events[2].record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        pause.close()
        if alternate and not paused and i >= args.warmup:
            stats1 = engine.optimizer.overlap_stats
            overlapped_flags["captures"].append(stats1["graph_captures"] - stats0["graph_captures"])
            overlapped_flags["fallbacks"].append(sum(stats1[k] - stats0[k] for k in stats1
                                                     if k.startswith("fallback_")))
        peak_step = max(peak_step, torch.cuda.max_memory_allocated(device))
        peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved(device))
        if counter:
            counter.__exit__(None, None, None)
            comm = dict(by_op(records))
        losses.append(loss.item())
        if i >= args.warmup:
            fwd_bwd, opt = events[0].elapsed_time(events[1]) / 1e3, events[1].elapsed_time(events[2]) / 1e3
            diagnostics["fwd_s_events"] = events[0].elapsed_time(events[3]) / 1e3
            for key, value in (("step_s", t2 - t0), ("fwd_bwd_s", t1 - t0), ("opt_step_s", t2 - t1),
                               ("step_s_events", fwd_bwd + opt), ("fwd_bwd_s_events", fwd_bwd),
                               ("opt_step_s_events", opt), *diagnostics.items()):
                (paused_samples if paused else samples)[key].append(value)
    if alternate and args.steps % 2 == 0:  # the last timed step was paused: one overlapped step before the loop,
        x = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
        engine.backward(engine(x[:, :-1], x[:, 1:]))  # the trace and the profile, so that none of them starts
        engine.step()                                  # with the step after a pause
        torch.cuda.synchronize()
    if args.loop_steps:
        samples["loop_step_s"] = [training_loop_seconds(engine, vocab, args, g, device)]
    syncs = None
    if args.sync_debug:  # one more step, the lines that make the host wait for the GPU, per phase
        x = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
        torch.cuda.synchronize()
        syncs = {"fwd_bwd": sync_points(lambda: engine.backward(engine(x[:, :-1], x[:, 1:]))),
                 "step": sync_points(engine.step)}
    if args.trace:
        trace_steps(engine, vocab, args, g, device, trace_path(args.trace, args.optimizer))
    profile = None
    if args.profile:  # every arm: AdamW's profile is the fwd+bwd baseline
        profile = profile_steps(engine, vocab, args, g, device)
    memory_peak = None
    if options.get("memory_peak"):
        x = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
        memory_peak = recorded_peak(engine, x, device, options["memory_peak"], memory_baseline)
    samples, medians = step_medians(samples)
    result = dict(optimizer=args.optimizer, samples=samples, **medians,
                  peak_gib=max(peak_fwd_bwd, peak_step) / 2**30, peak_fwd_bwd_gib=peak_fwd_bwd / 2**30,
                  peak_step_gib=peak_step / 2**30, profile=profile, sync_points=syncs, comm_bytes=comm, comm_total=sum(comm.values()), params=n_params,
                  first_loss=losses[0], last_loss=losses[-1], world=dist.get_world_size(),
                  opt_state_gib=_optimizer_state_bytes(engine) / 2**30,
                  # what the caching allocator held (a block cached for one stream serves no other), and how often
                  # it had to free its cache and retry a cudaMalloc (memory pressure: a device sync each time)
                  peak_reserved_gib=peak_reserved / 2**30,
                  alloc_retries=torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    if memory_peak is not None:
        result["memory_peak"] = memory_peak
    if stream_priority is not None:
        result["stream_priority"] = stream_priority  # the effective one (PyTorch clamps the requested priority)
    result["cpu_affinity"] = sorted(os.sched_getaffinity(0))  # the cores this worker may run on (--taskset)
    if alternate:
        result["paused_samples"], result["overlapped_flags"] = paused_samples, overlapped_flags
    result["reduce_bucket_size"] = int(engine.zero_reduce_bucket_size())  # elements: as set, or ds_muon's choice
    from torch._dynamo.utils import counters
    # every arm's torch.compile activity (the built-in compiles its Newton-Schulz too: its optimizer step moved
    # between sessions, 0.130 to 0.233 s at 934M, with its state and peak unchanged): graphs built, frames seen
    # (total) and compiled (ok), graph breaks
    result["dynamo_counters"] = {k: dict(counters[k]) for k in ("stats", "frames") if k in counters}
    breaks = counters["graph_break"] if "graph_break" in counters else {}
    result["dynamo_counters"]["graph_breaks"] = sum(breaks.values())
    if kind.startswith("ds_muon"):
        result["compiled_graphs"] = int(counters["stats"].get("unique_graphs", 0))
        plans = engine.optimizer.muon_plans.values()
        result["imbalance"] = max(p.imbalance() for p in plans)
        calls: dict = {}  # this rank's Newton-Schulz batches per step: "count x (batch, rows, cols)" -> how many
        for plan in plans:
            for bucket in getattr(plan, "buckets", (plan,)):
                for batch in bucket.batches[rank]:
                    key = f"{batch.count}x{tuple(batch.ns_shape)}"
                    calls[key] = calls.get(key, 0) + 1
        result["ns_batches"] = calls
        result["exchange_pool_peak_gib"] = engine.optimizer._pool.peak_nbytes / 2**30
        result["overlap_stats"] = engine.optimizer.overlap_stats  # Muon sub-group steps: commits, fallbacks by reason
        # counted in the arm's quintic form (bench.quintic_form): the plans' load() counts the plain form's FLOPs
        group = next(g for g in engine.optimizer.optimizer.param_groups if g.get("use_muon"))
        from ds_muon.core.newton_schulz import QUINTIC_FORM as form  # the arm's: build_engine set it
        result["quintic_form"] = form
        loads = ns_loads(plans, dist.get_world_size(), group["ns_steps"], group["ns_method"], form)
        result["ns_gflop_per_rank_max"] = max(loads) / 1e9
        result["matmul_tflops"] = matmul_tflops(device)
        result["ns_floor_s"] = max(loads) / (result["matmul_tflops"] * 1e12)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    # every rank done, then the process group torn down while Python is fully alive (docs/troubleshooting.md: a gloo
    # worker thread finishing after interpreter finalization began aborts the process; tests/e2e/test_clean_exit.py)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", help=argparse.SUPPRESS)  # the worker's arm (parse_arm)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                    help="the arms, comma-separated: optimizers of OPTIMIZERS, each with optional zero_optimization "
                         "overrides name:key=value:... (e.g. adamw:reduce_scatter=false)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the arms this many times in rounds (A B C A B C ...), a fresh worker group each time")
    ap.add_argument("--rotate", action="store_true",
                    help="rotate the arms' order by one place each round (A B C, B C A, C A B): with --rounds equal "
                         "to the number of arms, every arm runs once in every place of the round")
    ap.add_argument("--resume", default=None, metavar="FILE",
                    help="continue a run cut short (a device call's time limit): FILE is its --out; the rounds it "
                         "holds are kept, in their places, and only the rest run. Every option that sets what a "
                         "round measures (model, stage, steps, ...) must equal the first run's")
    ap.add_argument("--taskset", default=None, metavar="CPUS",
                    help="run every worker group under taskset -c CPUS (e.g. 0-7), so that each round's host-bound "
                         "fwd+bwd runs on the same cores: a test of whether the per-process spread between rounds "
                         "comes from where the scheduler puts the process (Linux, util-linux's taskset)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="934m", help="an examples/model.py preset (934m, 2.9b, moe-1.5b, ...)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=3,
                    help="ZeRO stage of every optimizer (ds_muon at 1/2: MuonZero12Optimizer)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--loop-steps", type=int, default=0,
                    help="after the timed steps, this many more run as a training loop does (no sync between the "
                         "phases): the 'loop s/step' column")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sync-debug", action="store_true",
                    help="after the timed steps, list the lines where fwd+bwd and the optimizer step make the host "
                         "wait for the GPU (torch.cuda.set_sync_debug_mode)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the fwd+bwd of 3 steps of every arm (round 1) with torch.profiler and print "
                         "the summary tables")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="after the timed steps of round 1, write a Chrome trace of 2 whole steps of each arm to "
                         "DIR/<arm>.json (rank 0), and at the end benchmarks/trace_streams.py's report of each to "
                         "DIR/<arm>.txt (streams, the GPU's idle time in fwd+bwd against the Newton-Schulz floor)")
    ap.add_argument("--ns-micro", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the Newton-Schulz microbenchmark (one GPU)")
    ap.add_argument("--ns-shapes", default=",".join("x".join(map(str, s)) for s in NS_SHAPES),
                    help="Newton-Schulz microbenchmark shapes BxMxN, comma-separated (CPU smoke test: 2x64x64,...)")
    ap.add_argument("--ns-variants", default=",".join(NS_VARIANTS),
                    help="what the microbenchmark times, in order: peers (heavyball, torch.optim.Muon) and "
                         "ds_muon's method[opt,...] with opts eager/static/dynamic/autotune/fused/plain/baddbmm/hybrid/cublaslt "
                         "(see ns_variant); variant names contain commas inside [], so separate them with ';' "
                         "when any has more than one option")
    ap.add_argument("--ns-iters", type=int, default=10, help="timed calls per variant and shape (after 3 untimed)")
    ap.add_argument("--ns-device", default=None, help="device of the microbenchmark (default: cuda if available)")
    ap.add_argument("--ns-timeout", type=float, default=None,
                    help="stop the microbenchmark after this many seconds and report the rows measured so far")
    ap.add_argument("--ns-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    ns_args = dict(shapes=parse_shapes(args.ns_shapes), variants=split_variants(args.ns_variants),
                   device=args.ns_device, iters=args.ns_iters)
    if args.ns_worker:
        ns_microbenchmark(args.out, **ns_args)
        return

    arms = [a.strip() for a in args.optimizers.split(",") if a.strip()]
    for arm in arms:
        options, cfg = bench_options(arm), ds_config(arm, args.micro_batch, args.stage)  # a bad arm fails here
        zero = cfg["zero_optimization"]  # the arm's own stage= counts
        if options.get("alternate_overlap"):
            overlap = cfg["optimizer"]["params"].get("overlap_backward", "auto")
            if overlap is False or (overlap == "auto" and zero["stage"] < 3):
                raise ValueError(f"arm {arm!r}: bench.alternate_overlap pauses the overlapped Muon step, which this "
                                 f"arm does not run (overlap_backward {json.dumps(overlap)} at ZeRO {zero['stage']}); "
                                 "use ds_muon_overlap, or opt.overlap_backward=true")
        comm = zero.get("overlap_comm") is not False
        for key, what, applies in (("reduce_events", "max_param_reduce_events", "ZeRO 3"),
                                   ("reduce_stream_priority", "reduce stream", "ZeRO 3 with overlap_comm true")):
            here = f"ZeRO {zero['stage']}" + ("" if key == "reduce_events"
                                              else f" with overlap_comm {str(comm).lower()}")
            if options.get(key) is not None and here != applies:
                raise ValueError(f"arm {arm!r}: bench.{key} sets DeepSpeed's ZeRO-3 {what}, which {here} lacks "
                                 f"(run it at {applies}, or leave the option out)")
    if args.taskset:
        if shutil.which("taskset") is None:
            raise SystemExit("--taskset needs util-linux's taskset on PATH; install it or leave --taskset out")
        parse_cpus(args.taskset, allowed=os.sched_getaffinity(0))  # a bad list fails here, not in every round
    results: dict = {}
    run = run_options(args, arms)
    done = load_resume(args.resume, arms, run, args.rounds) if args.resume else None

    def publish(raw: dict) -> None:  # the aggregate of every arm so far, to --out (a run cut short keeps it)
        results.update(aggregate_arms(raw, args.micro_batch, args.stage, run))
        if args.out:
            write_json(args.out, results)

    if done:  # a resumed run: what it holds is published before any worker runs (all of it, if nothing is missing)
        publish(done)

    with tempfile.TemporaryDirectory() as tmp:
        def run_arm(arm: str, rnd: int) -> dict:
            out = os.path.join(tmp, f"arm{arms.index(arm)}-round{rnd}.json")
            pin = ["taskset", "-c", args.taskset] if args.taskset else []
            cmd = [*pin, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), __file__,
                   "--worker", "--optimizer", arm, "--model", args.model, "--micro-batch", str(args.micro_batch),
                   "--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--stage", str(args.stage), "--loop-steps", str(args.loop_steps),
                   *(["--sync-debug"] if args.sync_debug and rnd == 0 else []),
                   *(["--trace", args.trace] if args.trace and rnd == 0 else []),
                   "--out", out] + (["--profile"] if args.profile and rnd == 0 else [])
            print(f">> round {rnd + 1}/{args.rounds}:", " ".join(cmd), flush=True)
            proc = subprocess.run(cmd, env=worker_env(parse_arm(arm)[0]))
            if proc.returncode == 0 and os.path.exists(out):
                with open(out) as f:
                    return json.load(f)
            return {"error": f"exit {proc.returncode}"}

        run_rounds(arms, args.rounds, run_arm, publish, rotate=args.rotate, done=done)
        if args.ns_micro:
            out = os.path.join(tmp, "ns.json")
            print(NS_TABLE_HEADER, flush=True)
            cmd = [sys.executable, __file__, "--ns-worker", "--out", out, "--ns-shapes", args.ns_shapes,
                   "--ns-variants", args.ns_variants, "--ns-iters", str(args.ns_iters)]
            # its own process group, so a timeout also ends inductor's compile workers (they share stdout)
            proc = subprocess.Popen(cmd + (["--ns-device", args.ns_device] if args.ns_device else []),
                                    start_new_session=True)
            try:
                status = f"exit {proc.wait(timeout=args.ns_timeout)}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = f"stopped after --ns-timeout {args.ns_timeout:g} s"
            if os.path.exists(out):  # also what a run cut short measured
                with open(out) as f:
                    results["ns_micro"] = json.load(f)
                if status != "exit 0":
                    results["ns_micro"]["error"] = status
                if args.out:
                    write_json(args.out, results)
    print_table({k: v for k, v in results.items() if k != "ns_micro"})
    places = place_table({k: v for k, v in results.items() if k != "ns_micro"})
    if places:
        print("\nEach arm's rounds by its place in the round (--rotate): medians of the round's timed steps, s")
        print("\n".join(places))
    for arm, v in results.items():
        for phase, lines in (v.get("sync_points") or {}).items():
            print(f"\n{arm}, {phase}: {sum(lines.values())} host-device syncs: " +
                  ", ".join(f"{k} x{n}" for k, n in sorted(lines.items(), key=lambda kv: -kv[1])))
    for arm, v in results.items():  # every profiled arm, overrides included ("adamw:bench.clip=0")
        if v.get("profile"):
            print(f"\ntorch.profiler, 3 {arm} steps, rank 0:\n" + v["profile"])
    if "ns_micro" in results:
        print_ns_table(results["ns_micro"])
    if args.trace:  # last: what it prints comes after every measured table
        report_traces(args.trace, arms, results)


TIMINGS = ("step_s", "fwd_bwd_s", "opt_step_s", "step_s_events", "fwd_bwd_s_events", "opt_step_s_events",
           "loop_step_s")
#: Per-step diagnostics of fwd+bwd, aggregated like TIMINGS: the process's CPU seconds (all threads: autograd runs
#: backward on its own thread), the seconds of Python's garbage collector, cudaMalloc calls, and what else ran on the
#: worker's CPUs meanwhile (:func:`host_counters`: other processes' and the kernel's CPU seconds at clock-tick
#: resolution, steal, involuntary context switches), to test whether a slow step is one whose host thread was
#: crowded out.
#: Then the phases apart: the host's seconds in forward (``fwd_host_s``) and in backward (``bwd_host_s``), the
#: forward's CUDA-event seconds on the main stream (``fwd_s_events``), and whether DeepSpeed's ZeRO-3 module trace
#: was complete through the step's fwd+bwd (``zero3_trace_complete``, 1 or 0: :func:`zero3_trace_complete`), and
#: of each phase's host seconds those spent waiting on the GPU (``fwd_wait_s``, ``bwd_wait_s``: :class:`WaitClock`).
DIAGNOSTICS = ("fwd_bwd_cpu_s", "fwd_bwd_gc_s", "fwd_bwd_device_allocs", "fwd_bwd_other_cpu_s", "fwd_bwd_steal_s",
               "fwd_bwd_nivcsw", "fwd_host_s", "bwd_host_s", "fwd_s_events", "zero3_trace_complete", "fwd_wait_s",
               "bwd_wait_s")


def round_order(arms, rnd: int, rotate: bool = False) -> list:
    """The arms in the order round ``rnd`` (0-based) runs them: as given, or with ``rotate`` shifted left by ``rnd``
    (``A B C``, ``B C A``, ``C A B``), so that over ``len(arms)`` rounds every arm runs once in every place of the
    round and an effect of the place (a warm GPU clock, the page cache, what the previous worker left) touches
    every arm alike."""
    shift = rnd % len(arms) if rotate and arms else 0
    return list(arms[shift:]) + list(arms[:shift])


def run_rounds(arms, rounds: int, run_arm, on_result=None, rotate: bool = False, done: dict | None = None) -> dict:
    """Run every arm ``rounds`` times, in rounds (``A B C A B C ...``, or rotated: :func:`round_order`):
    ``run_arm(arm, round)`` returns one worker result (or ``{"error": ...}``), to which the arm's 0-based place in
    its round is added as ``round_position``; ``on_result(raw)`` is called after every arm of every round.
    ``done`` (``--resume``: :func:`load_resume`) holds each arm's results of its first rounds, kept as they are;
    only the rounds an arm lacks run, in the order and places they would have had.
    Returns ``{arm: [its result per round so far]}``."""
    raw: dict = {arm: list((done or {}).get(arm, ())) for arm in arms}
    for rnd in range(rounds):
        for position, arm in enumerate(round_order(arms, rnd, rotate)):
            if len(raw[arm]) > rnd:
                continue
            raw[arm].append(dict(run_arm(arm, rnd), round_position=position))
            if on_result is not None:
                on_result(raw)
    return raw


def aggregate_rounds(rounds: list) -> dict:
    """One arm's worker results of several rounds as one result.

    Each timing of :data:`TIMINGS` (seconds; ``*_events``: CUDA events, else wall clock with a device sync
    around each phase) becomes the median over all timed steps of all rounds (``samples``; a result without
    them counts as one step of its median), with ``spread[key]``: the per-round medians, their ``min``/``max``,
    and the quartiles ``q1``/``q3`` of all steps. Peaks are the largest of any round; every other field is
    the first successful round's. Rounds that failed are counted (``round_errors``); none succeeded:
    ``{"error": ...}``. ``zero3_trace_incomplete_steps``: ``[steps whose fwd+bwd ran without a complete ZeRO-3
    module trace, steps with the flag]`` over the arm's samples (of a ``bench.alternate_overlap`` arm, its
    overlapped steps).
    """
    ok = [r for r in rounds if "error" not in r]
    errors = [r["error"] for r in rounds if "error" in r]
    if not ok:
        return {"error": "; ".join(errors) or "no round ran", "rounds": len(rounds)}
    out = {k: v for k, v in ok[0].items() if k not in ("samples", "round_position")}
    out.update(rounds=len(rounds), rounds_ok=len(ok), spread={})
    if errors:
        out["round_errors"] = errors
    for key in TIMINGS + DIAGNOSTICS:
        per_round = [r["samples"][key] if r.get("samples", {}).get(key) else [r[key]] for r in ok if key in r]
        if not per_round:
            continue
        pooled = sorted(v for steps in per_round for v in steps)
        q1, _, q3 = statistics.quantiles(pooled, n=4, method="inclusive") if len(pooled) > 1 else pooled * 3
        medians = [statistics.median(steps) for steps in per_round]
        out[key] = statistics.median(pooled)
        out["spread"][key] = {"round_medians": medians, "min": min(medians), "max": max(medians), "q1": q1, "q3": q3,
                              "steps": len(pooled)}
        if key == "zero3_trace_complete":  # a flag: how many timed steps ran without a complete trace, of how many
            out["zero3_trace_incomplete_steps"] = [sum(1 for v in pooled if v < 1), len(pooled)]
    for key in ("peak_gib", "peak_fwd_bwd_gib", "peak_step_gib", "peak_reserved_gib", "alloc_retries"):
        if all(key in r for r in ok):
            out[key] = max(r[key] for r in ok)
    out.pop("paused_samples", None)
    out.pop("overlapped_flags", None)
    paired = paired_overlap(ok)
    if paired:
        out["paired_overlap"] = paired
    return out


#: The timings a step with the overlapped Muon step paused is compared by (``bench.alternate_overlap``).
PAIRED_TIMINGS = ("step_s", "fwd_bwd_s", "opt_step_s", "step_s_events", "fwd_bwd_s_events", "opt_step_s_events",
                  "fwd_bwd_cpu_s", "fwd_host_s", "bwd_host_s", "fwd_s_events", "bwd_wait_s")


def paired_overlap(rounds: list) -> dict:
    """What the overlapped Muon step costs backward and saves the step, from ``bench.alternate_overlap`` rounds.

    In each round the timed steps alternate: overlapped ``o0, p0, o1, p1, ...`` (``samples``: the overlapped ones,
    ``paused_samples``: the paused ones). Each paused step ``p_j`` is compared with the mean of the overlapped steps
    around it, ``(o_j + o_{j+1}) / 2`` (``o_j`` alone after the last), so that a steady drift of the host within
    the process cancels; a pair is left out where one of those overlapped steps captured a CUDA graph or fell back
    to the ordinary step (``overlapped_flags``: a capture lengthens its backward, a fallback is not the overlapped
    step). Per timing of :data:`PAIRED_TIMINGS`: ``diff`` (the median of overlapped minus paused, seconds), its
    quartiles ``q1``/``q3``, and the medians ``on``/``paused`` over the kept pairs; ``pairs`` kept and
    ``pairs_left_out``. Empty where no round paused.

    What "paused" measures: the ordinary Muon step with the overlap's settings kept (its reduce bucket, its
    owner-plan bucket order, the graphs' memory pool), not an arm with ``overlap_backward`` false; and the
    fwd+bwd of an overlapped step includes the speculation's work past backward's end (the timing syncs the device
    after backward), which a training loop would partly hide behind the step.
    """
    out: dict = {}
    for key in PAIRED_TIMINGS:
        on, off, left_out = [], [], 0
        for r in rounds:
            paused = (r.get("paused_samples") or {}).get(key) or []
            over = (r.get("samples") or {}).get(key) or []
            flags = r.get("overlapped_flags") or {}
            captures = flags.get("captures") or [0] * len(over)
            fallbacks = flags.get("fallbacks") or [0] * len(over)
            clean = [not captures[k] and not fallbacks[k] for k in range(len(over))]
            for j, p in enumerate(paused):
                around = [k for k in (j, j + 1) if k < len(over)]
                if not around:
                    continue
                if not all(clean[k] for k in around):
                    left_out += 1
                    continue
                on.append(sum(over[k] for k in around) / len(around))
                off.append(p)
        if not off:
            continue
        diffs = sorted(a - b for a, b in zip(on, off))
        q1, _, q3 = statistics.quantiles(diffs, n=4, method="inclusive") if len(diffs) > 1 else diffs * 3
        out[key] = {"diff": statistics.median(diffs), "q1": q1, "q3": q3, "on": statistics.median(on),
                    "paused": statistics.median(off)}
        if key == "step_s":  # every round has it (a resumed file's older rounds may lack the later keys)
            out["pairs"], out["pairs_left_out"] = len(diffs), left_out
    return out


def aggregate_arms(raw: dict, micro_batch: int, stage: int, run: dict | None = None) -> dict:
    """``{arm: aggregate_rounds(its rounds) + settings + its round results}`` for :func:`print_table` and ``--out``,
    for the arms that ran at least once; ``run`` (:func:`run_options`) is stored with each, for ``--resume``."""
    return {arm: dict(aggregate_rounds(rounds), settings=arm_settings(arm, micro_batch, stage), round_results=rounds,
                      **({"run": run} if run is not None else {}))
            for arm, rounds in raw.items() if rounds}


#: The options that set what one round of an arm measures: a resumed run must repeat them.
RUN_OPTIONS = ("model", "nproc", "stage", "micro_batch", "seq_len", "warmup", "steps", "loop_steps", "rotate",
               "taskset")
#: Options recorded in ``run`` after ``--resume`` first shipped, with the value a file without them was run at
#: (``arms``: the arms in their order, which sets each round's places; not recorded then, so not checked).
ADDED_OPTIONS = {"taskset": None, "arms": None}


def run_options(args, arms: list) -> dict:
    """``{option: value}`` of :data:`RUN_OPTIONS` from the parsed arguments, and ``arms``: the arms in order."""
    return {**{k: getattr(args, k) for k in RUN_OPTIONS}, "arms": list(arms)}


def same_run(saved: dict, run: dict) -> bool:
    """Whether a file's ``run`` (:func:`run_options`) asks for what ``run`` does; an option it lacks
    (:data:`ADDED_OPTIONS`) counts as run at its old value, and lacking ``arms`` as any order."""
    for k, want in run.items():
        if k in saved:
            if saved[k] != want:
                return False
        elif k not in ADDED_OPTIONS or (k != "arms" and want != ADDED_OPTIONS[k]):
            return False
    return True


def write_json(path: str, obj) -> None:
    """``obj`` as indented JSON to ``path``, atomically (a temporary file beside it, then ``os.replace``): a run
    killed mid-write leaves the previous file whole, for ``--resume``."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def parse_cpus(text: str, allowed=None) -> set:
    """``"0-3,8"`` -> ``{0, 1, 2, 3, 8}`` (taskset's list format). Raises ValueError naming the fix for a malformed
    list or, with ``allowed``, for CPUs this process may not run on."""
    cpus = set()
    try:
        for item in filter(None, (t.strip() for t in text.split(","))):
            lo, _, hi = item.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--taskset {text!r}: not a CPU list such as 0-7 or 0,2,4") from None
    if not cpus:
        raise ValueError(f"--taskset {text!r}: no CPU in it")
    if allowed is not None and not cpus <= set(allowed):
        raise ValueError(f"--taskset {text!r}: CPUs {sorted(cpus - set(allowed))} are not among this process's "
                         f"{sorted(allowed)}; pick from those")
    return cpus


def load_resume(path: str, arms: list, run: dict, rounds: int) -> dict:
    """Each arm's round results from ``path``, an earlier ``--out`` of this script cut short, for
    :func:`run_rounds`' ``done``: ``{arm: [result of round 1, round 2, ...]}``.

    Raises ValueError naming the fix where the file holds an arm not in ``arms``, more rounds than ``rounds``, or
    was measured with other :data:`RUN_OPTIONS` or arms' order than ``run`` (:func:`same_run`; or without them:
    written before ``--resume`` existed); OSError where it cannot be read. A failed round in the file is kept
    as failed (a worker that exited with an error; a driver killed mid-round never wrote that round).
    """
    with open(path) as f:
        saved = json.load(f)
    saved = {arm: v for arm, v in saved.items() if arm != "ns_micro"}
    missing = [arm for arm in saved if arm not in arms]
    if missing:
        raise ValueError(f"--resume {path}: its arms {missing} are not in --optimizers; pass the same arms")
    done = {}
    for arm, v in saved.items():
        if v.get("run") is None or not same_run(v["run"], run):
            raise ValueError(f"--resume {path}: arm {arm!r} was measured with {v.get('run')}, this run asks for "
                             f"{run}; pass the same options")
        if len(v["round_results"]) > rounds:
            raise ValueError(f"--resume {path}: arm {arm!r} has {len(v['round_results'])} rounds, more than "
                             f"--rounds {rounds}")
        done[arm] = v["round_results"]
    return done


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"16x2048x2048,2x64x96"`` -> ``((16, 2048, 2048), (2, 64, 96))``; ValueError names a bad entry."""
    shapes = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        dims = item.lower().split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"--ns-shapes: {item!r} is not BxMxN with positive ints (e.g. 16x2048x5440)")
        shapes.append(tuple(int(d) for d in dims))
    return tuple(shapes)


def split_variants(text: str) -> tuple[str, ...]:
    """Split ``--ns-variants`` at ``;`` or at commas outside ``[...]``."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == ";" or (ch == "," and depth == 0):
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return tuple(v for v in out if v)


def print_ns_table(ns: dict) -> None:
    """The microbenchmark's rows as a markdown table, each variant against heavyball's and
    torch.optim.Muon's time on the same shape."""
    print(f"\nNewton-Schulz, 5 steps, bf16 (gram: fp16; CPU: fp32); dense matmul rate {ns['matmul_tflops']:.3g} "
          f"TFLOP/s on {ns.get('device')}, torch {ns.get('torch')}")
    print(NS_TABLE_HEADER.replace("| graphs |", "| graphs | time / heavyball | time / torch.optim.Muon |")
          .replace("|---|---|---|---|---|---|---|---|", "|---|---|---|---|---|---|---|---|---|---|"))
    peers = {(r["method"], tuple(r["shape"])): r["seconds"] for r in ns["rows"] if "error" not in r}
    for r in ns["rows"]:
        ratios = ""
        for peer in PEERS:
            p = peers.get((peer, tuple(r["shape"])))
            ratios += f" {r['seconds'] / p:.3f} |" if p and "error" not in r else " |"
        print(_ns_row_text(r) + ratios)
    if ns.get("error"):
        print(f"(microbenchmark cut short: {ns['error']})")


def timing_cell(result: dict, key: str) -> str:
    """``"0.297 (0.295-0.301)"``: the median of ``key`` and its spread (the min-max of the per-round medians over
    two or more rounds; the quartiles of the steps over one); empty where the result lacks it."""
    if key not in result:
        return ""
    spread = result.get("spread", {}).get(key)
    if not spread:
        return f"{result[key]:.3f}"
    lo, hi = (spread["min"], spread["max"]) if len(spread["round_medians"]) > 1 else (spread["q1"], spread["q3"])
    return f"{result[key]:.3f} ({lo:.3f}-{hi:.3f})"


def place_table(results: dict) -> list[str]:
    """Markdown rows, one per arm and round: the arm's place in its round (``round_position``, 1-based) and the
    medians of that round's timed steps (step, fwd+bwd, optimizer step, loop; seconds), so that an effect of the
    place in the round shows beside the arm's other rounds (``--rotate``). Empty where no round result states its
    place or every arm kept one place."""
    rows, places = [], set()
    for arm, v in results.items():
        for rnd, r in enumerate(v.get("round_results") or ()):
            if "round_position" not in r:
                continue
            places.add((arm, r["round_position"]))
            if "error" in r:
                rows.append(f"| {arm} | {rnd + 1} | {r['round_position'] + 1} | failed: {r['error']} | | | |")
                continue
            cells = []
            for key in ("step_s", "fwd_bwd_s", "opt_step_s", "loop_step_s"):
                steps = (r.get("samples") or {}).get(key) or ([r[key]] if key in r else [])
                cells.append(f"{statistics.median(steps):.3f}" if steps else "")
            rows.append(f"| {arm} | {rnd + 1} | {r['round_position'] + 1} | " + " | ".join(cells) + " |")
    if len(places) == len({arm for arm, _ in places}):  # no arm ran in more than one place
        return []
    return ["| arm | round | place in round | step s | fwd+bwd s | optimizer step s | loop s/step |",
            "|---|---|---|---|---|---|---|"] + rows


def memory_peak_text(m: dict) -> str:
    """One table cell of :func:`recorded_peak`'s result (the first round's)."""
    sites = "; ".join(f"{site} {gib:.2f}" + (f" ({new:.2f} new)" if new else "") + f" [{count}]"
                      for site, gib, count, new in m["groups"])
    held = m.get("held_at_start_gib", m["at_start_gib"])
    return (f"memory at the {m['phase']} peak (one recorded step, requested bytes): {m['peak_gib']:.2f} GiB, "
            f"{m['at_start_gib']:.2f} held when the phase began, {m['phase_live_gib']:.2f} of it allocated in the "
            f"phase, {m['baseline_gib']:.2f} held before the recording began (not named below; the allocator's "
            f"requested peak {m['requested_peak_gib']:.2f}, in rounded blocks {m['max_allocated_gib']:.2f})"
            + ("; HISTORY FULL, the replay may miss its oldest entries" if m.get("wrapped") else "")
            + (f"; REPLAY INCOMPLETE: {held:.3f} GiB held at the phase's start by the allocator's count"
               if abs(held - m["at_start_gib"]) > 2**-10 else "")
            + f"; every block held there by site, GiB (allocated in the phase) [blocks]: {sites}"
            + (f"; other {m['other_gib']:.2f}" if m["other_gib"] else ""))


#: The parts of an arm's step over AdamW's that :func:`gap_by_cause` separates, in the table's order: (key, label).
GAP_CAUSES = (("fwd", "forward host"), ("bwd_waits", "backward's host waiting on the GPU"),
              ("bwd_other", "backward's other host time"),
              ("main_tail", "main stream past backward's host return (fwd+bwd CUDA events less the host's forward "
                            "and backward)"),
              ("spill", "side-stream work past the main stream (fwd+bwd wall clock less its CUDA events)"),
              ("opt", "optimizer step"))

#: Below this gap (s) :func:`gap_text` prints no shares (an arm of AdamW against AdamW: a share of noise).
GAP_SHARE_MIN_S = 1e-3


def gap_by_cause(arm: dict, base: dict) -> Optional[dict]:
    """``arm``'s step over ``base``'s (AdamW's, the same run) split by where the time goes, from the medians (s).

    Per timed step, step = fwd+bwd + optimizer step, and fwd+bwd's wall clock (a device sync at its end) = the host's
    forward + the host's backward (its waits on the GPU apart, ``bwd_wait_s``) + what the main stream still runs
    after backward returns (fwd+bwd's CUDA events less the host's forward and backward; about 0 where backward
    ends by waiting on the GPU, as ZeRO-3's does) + what the side stream (the overlapped Muon step) runs past the
    main stream (the wall clock less the CUDA events). That is exact step by step; each part here is the arm's
    median less ``base``'s, so the parts' sum (``sum``) is close to the medians' gap (``gap``), not equal.

    Args:
        arm, base: :func:`aggregate_arms` entries (medians over all rounds, s).

    Returns:
        ``{"gap": s, "sum": s, **{key: s for key, _ in GAP_CAUSES}}``, or None where either lacks a key (no CUDA
        events on the CPU, results from before the phase split).
    """
    need = ("step_s", "fwd_host_s", "bwd_host_s", "bwd_wait_s", "fwd_bwd_s", "fwd_bwd_s_events", "opt_step_s")
    if any(k not in arm or k not in base for k in need):
        return None

    def parts(v: dict) -> dict:
        return {"fwd": v["fwd_host_s"], "bwd_waits": v["bwd_wait_s"], "bwd_other": v["bwd_host_s"] - v["bwd_wait_s"],
                "main_tail": v["fwd_bwd_s_events"] - v["fwd_host_s"] - v["bwd_host_s"],
                "spill": v["fwd_bwd_s"] - v["fwd_bwd_s_events"], "opt": v["opt_step_s"]}

    mine, theirs = parts(arm), parts(base)
    out = {k: mine[k] - theirs[k] for k, _ in GAP_CAUSES}
    return {"gap": arm["step_s"] - base["step_s"], "sum": sum(out.values()), **out}


def gap_text(name: str, gap: dict) -> str:
    """One line of :func:`print_table`: :func:`gap_by_cause`'s parts in seconds, each with its share of the gap
    (no shares where the gap is under :data:`GAP_SHARE_MIN_S` or under the parts' distance from it)."""
    shares = abs(gap["gap"]) >= max(GAP_SHARE_MIN_S, abs(gap["gap"] - gap["sum"]))
    share = (lambda x: f" ({100 * x / gap['gap']:.0f}%)") if shares else (lambda x: "")
    return (f"{name} - AdamW step {gap['gap']:+.4f} s by cause (medians of this run; the parts sum to "
            f"{gap['sum']:+.4f} s): " + ", ".join(f"{label} {gap[k]:+.4f}{share(gap[k])}" for k, label in GAP_CAUSES))


def print_table(results: dict) -> None:
    ok = {k: v for k, v in results.items() if "error" not in v}
    rounds = max([v.get("rounds", 1) for v in results.values()] or [1])
    print(f"\nTimes in s: median over all timed steps of {rounds} round(s) (A B C A B C ..., a fresh worker group "
          "each), in parentheses the min-max of the per-round medians (one round: the steps' quartiles); wall clock "
          "with a device sync around each phase, and CUDA events of the same phases.")
    print("| arm | settings | step s | fwd+bwd s | optimizer step s | CUDA events: step / fwd+bwd / optimizer step s | "
          "loop s/step | peak GiB (fwd+bwd / step) | optimizer state GiB (rank 0) | bytes/step (rank 0) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, v in ok.items():
        events = " / ".join(timing_cell(v, f"{t}_events") for t in ("step_s", "fwd_bwd_s", "opt_step_s"))
        print(f"| {k} | {v.get('settings', '')} | {timing_cell(v, 'step_s')} | {timing_cell(v, 'fwd_bwd_s')} | "
              f"{timing_cell(v, 'opt_step_s')} | {events if 'step_s_events' in v else ''} | "
              f"{timing_cell(v, 'loop_step_s')} | {v['peak_gib']:.1f} "
              f"({v['peak_fwd_bwd_gib']:.1f} / {v['peak_step_gib']:.1f}) | {v.get('opt_state_gib', 0):.2f} | "
              f"{v['comm_total'] / 2**20:.0f} MiB |")
        if "fwd_bwd_cpu_s" in v:
            print(f"| {k} | fwd+bwd diagnostics: CPU s {timing_cell(v, 'fwd_bwd_cpu_s')}, garbage collector s "
                  f"{timing_cell(v, 'fwd_bwd_gc_s')}, cudaMalloc calls {timing_cell(v, 'fwd_bwd_device_allocs')}"
                  + (f", other processes' CPU s {timing_cell(v, 'fwd_bwd_other_cpu_s')}, steal s "
                     f"{timing_cell(v, 'fwd_bwd_steal_s')}, involuntary context switches "
                     f"{timing_cell(v, 'fwd_bwd_nivcsw')}" if "fwd_bwd_steal_s" in v else "")
                  + (f"; forward: host s {timing_cell(v, 'fwd_host_s')}, CUDA events s "
                     f"{timing_cell(v, 'fwd_s_events')}; backward: host s {timing_cell(v, 'bwd_host_s')}"
                     if "fwd_host_s" in v else "")
                  + (f"; of the host's seconds waiting on the GPU (Event/Stream/device synchronize): forward "
                     f"{timing_cell(v, 'fwd_wait_s')}, backward {timing_cell(v, 'bwd_wait_s')}"
                     if "bwd_wait_s" in v else "")
                  + ("; ZeRO-3 module trace not complete through fwd+bwd (modules fetched without prefetch) in {} of "
                     "{} timed steps".format(*v["zero3_trace_incomplete_steps"])
                     if "zero3_trace_incomplete_steps" in v else "")
                  + " |")
        if v.get("paired_overlap"):
            p = v["paired_overlap"]
            cells = ", ".join(f"{name} {p[key]['diff']:+.3f} ({p[key]['q1']:+.3f} to {p[key]['q3']:+.3f}; "
                              f"{p[key]['on']:.3f} against {p[key]['paused']:.3f})"
                              for key, name in (("fwd_bwd_s", "fwd+bwd"), ("opt_step_s", "optimizer step"),
                                                ("step_s", "step")) if key in p)
            print(f"| {k} | overlapped minus paused, {p['pairs']} paused steps against the overlapped steps around "
                  f"each, in one process ({p.get('pairs_left_out', 0)} left out: a graph capture or a fallback; "
                  f"bench.alternate_overlap; median, quartiles; the medians of both; peaks are over both kinds) s: "
                  f"{cells}" + (f", fwd+bwd CPU s {p['fwd_bwd_cpu_s']['diff']:+.3f}" if "fwd_bwd_cpu_s" in p else "")
                  + "".join(f", {name} {p[key]['diff']:+.3f} ({p[key]['on']:.3f} against {p[key]['paused']:.3f})"
                            for key, name in (("fwd_host_s", "forward host s"), ("fwd_s_events", "forward events s"),
                                              ("bwd_host_s", "backward host s"),
                                              ("bwd_wait_s", "backward's waits on the GPU s")) if key in p)
                  + " |")
        if "peak_reserved_gib" in v:
            print(f"| {k} | memory: peak reserved by the caching allocator {v['peak_reserved_gib']:.1f} GiB, "
                  f"cudaMalloc retries after freeing its cache {v.get('alloc_retries', 0)} |")
        if v.get("memory_peak"):
            print(f"| {k} | {memory_peak_text(v['memory_peak'])} |")
        if v.get("round_errors"):
            print(f"| {k} | {len(v['round_errors'])} of {v['rounds']} rounds failed: {'; '.join(v['round_errors'])} |")
    for k, v in results.items():
        if "error" in v:
            print(f"| {k} | {v.get('settings', '')} | failed: {v['error']} | | | | | | | |")
    base = next((v for k, v in ok.items() if parse_arm(k)[0] == "adamw"), None)
    if base is not None:  # issue 40, item 1: the same fwd+bwd work in every arm at W=1 (target <= 1.02x)
        print("fwd+bwd / AdamW's (wall clock; CUDA events): " + ", ".join(
            f"{k} {v['fwd_bwd_s'] / base['fwd_bwd_s']:.3f}x"
            + (f" ({v['fwd_bwd_s_events'] / base['fwd_bwd_s_events']:.3f}x)" if "fwd_bwd_s_events" in v
               and "fwd_bwd_s_events" in base else "") for k, v in ok.items() if v is not base))
        for k, v in ok.items():  # what each arm's step spends over AdamW's, and where (issue 40's shares)
            gap = gap_by_cause(v, base) if v is not base else None
            if gap is not None:
                print(gap_text(k, gap))
    for k, v in results.items():  # the overlapped Muon step: how often it committed, how often it fell back
        stats = [r["overlap_stats"] for r in v.get("round_results", ()) if r.get("overlap_stats")]
        if stats and any(stats[0].values()):
            total = {key: sum(x[key] for x in stats) for key in stats[0]}
            print(f"{k}: overlapped Muon step over {len(stats)} round(s), sub-group steps: " +
                  ", ".join(f"{key} {n}" for key, n in total.items()))
    named: dict = {}
    for k, v in ok.items():  # the ratios below compare the first arm of each optimizer
        named.setdefault(parse_arm(k)[0], v)
    ok = named
    if "adam_mini" in ok and "adamw" in ok:
        m, a = ok["adam_mini"], ok["adamw"]
        print(f"adam_mini/AdamW: optimizer state {m['opt_state_gib'] / a['opt_state_gib']:.3f}x, step "
              f"{m['step_s'] / a['step_s']:.2f}x, optimizer step {m['opt_step_s'] / a['opt_step_s']:.2f}x, peak "
              f"{m['peak_gib'] / a['peak_gib']:.3f}x, bytes/step +{m['comm_total'] - a['comm_total']} B")
    # ds_muon variants against the default, each differing in one knob: (variant, knob, variant's label, default's)
    for variant, knob, theirs, ours in (("ds_muon_gram", "ns_method", "gram", "standard"),
                                        ("ds_muon_eager", "ns_compile", "eager", "compiled"),
                                        ("ds_muon_autotune", "ns_autotune", "autotuned", "default"),
                                        ("ds_muon_bf16mom", "momentum_dtype", "bfloat16", "float32")):
        if "ds_muon" in ok and variant in ok:
            v, c = ok[variant], ok["ds_muon"]
            print(f"{knob}: optimizer step {c['opt_step_s']:.3f} s {ours} vs {v['opt_step_s']:.3f} s {theirs}; "
                  f"step {c['step_s']:.3f} vs {v['step_s']:.3f} s; peak {c['peak_gib']:.1f} vs {v['peak_gib']:.1f} GiB")
            if variant == "ds_muon_bf16mom" and "builtin_muon" in ok:
                print(f"momentum_dtype bfloat16: peak / built-in {v['peak_gib'] / ok['builtin_muon']['peak_gib']:.3f}x")
    if "ds_muon" in ok:
        d = ok["ds_muon"]
        print(f"\nNS floor {d['ns_floor_s']:.4f} s (max {d['ns_gflop_per_rank_max']:.0f} GFLOP per rank at "
              f"{d['matmul_tflops']:.0f} TFLOP/s measured); owner imbalance max/mean {d['imbalance']:.3f}; "
              f"exchange buffers peak {d.get('exchange_pool_peak_gib', 0):.2f} GiB (released after each step); "
              f"torch.compile graphs {d.get('compiled_graphs', 0)}")
        if "adamw" in ok:
            a = ok["adamw"]
            print(f"ds_muon/AdamW step {d['step_s'] / a['step_s']:.2f}x; ds_muon - AdamW step "
                  f"{d['step_s'] - a['step_s']:.4f} s = {(d['step_s'] - a['step_s']) / d['ns_floor_s']:.2f}x NS floor")
        if "builtin_muon" in ok:
            b = ok["builtin_muon"]
            print(f"ds_muon/built-in: step {d['step_s'] / b['step_s']:.2f}x, optimizer step "
                  f"{d['opt_step_s'] / b['opt_step_s']:.2f}x, peak {d['peak_gib'] / b['peak_gib']:.2f}x, "
                  f"bytes/step {d['comm_total'] / b['comm_total']:.2f}x")
            if "loop_step_s" in d and "loop_step_s" in b:
                print(f"ds_muon/built-in in a training loop (no sync between phases): "
                      f"{d['loop_step_s'] / b['loop_step_s']:.2f}x")


if __name__ == "__main__":
    main()
