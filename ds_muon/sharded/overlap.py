"""The Muon step run speculatively in the last micro-batch's backward, exactly (layer ``sharded``: no DeepSpeed).

docs/design.md, "The overlapped step". As ZeRO reduces each gradient bucket on the last micro-batch, the Muon
parameters whose gradient partitions are final are marked (:meth:`SpeculativeMuon.mark_final`); when every
parameter of an owner-plan bucket is final, that bucket's update is computed without touching the momentum or the
gradient: ``u = lerp(g/s, beta*m + (1-beta)*g/s, beta)`` (Nesterov) or ``beta*m + (1-beta)*g/s`` into a scratch
buffer (``s`` the loss scale, clip coefficient 1 assumed), the owner exchange and Newton–Schulz of the bucket, and
the orthogonalized update ``o`` (this rank's chunks) kept in the bucket's stash. At the step, :meth:`SpeculativeMuon.commit`
applies ``m <- beta*m + (1-beta)*g`` (the same kernel as today) and ``p <- p*(1-lr*wd) - lr*o`` from the stashes,
with the blocks that had no gradient on any rank set aside around it as the ordinary step sets them aside (a
stacked expert without tokens keeps its momentum and weights; an expert that is a parameter of its own gets no
gradient at all and leaves the speculation incomplete); any step where that would not be exact (clipping fired,
the sub-group was not fully speculated, the loss scale changed) is left to the ordinary step, which is exact
because ``g`` and ``m`` are as they were. Every rank marks the same parameters in the same order (ZeRO's
reduce-scatter sequence is the same on every rank), so the buckets' collectives are issued in the same order
everywhere.

Memory per rank: a stash per speculated bucket, this rank's stretch of the shard that the bucket covers in the
exchange dtype (bf16 by default off the CPU), allocated when the bucket is speculated and freed by the commit: at
most the local Muon shard (``shard_numel * exchange_dtype.itemsize`` bytes) at the step and growing in backward as
the activations go. On CUDA it comes from the home (default) stream's blocks, so what the commit frees serves the
next forward's activations: none is held in the forward, where the peak usually is, reserved memory included (a
block of the side stream would stay cached for that stream). Plus, while a bucket is
speculated, an fp32 scratch of this rank's stretch of the shard that the bucket covers (``4 * span`` bytes: a
bucket of consecutive layers is a stretch about its own size) and a momentum copy of at most :data:`RUN_ELEMENTS`
elements at a time, plus the exchange's buffers for that bucket (a :class:`~ds_muon.sharded.exchange.BufferPool`
of the bucket's own, freed after it; at W=1 one buffer of the bucket in the exchange dtype and one batch of
matrices in the compute dtype). With CUDA graphs, also the graphs' output buffer (below): the largest bucket's
stretch in the exchange dtype, held for the optimizer's life.

CUDA graphs (``graphs=True``, a side stream, a sub-group whose exchange is one rank): the W=1 backward is
host-bound, so the speculation's own kernel launches (a few hundred per bucket: the momentum runs, the copies,
Newton–Schulz's iterations per batch of matrices) would lengthen it (docs/benchmarks.md, "Issue 40: why the
overlapped step loses"). Each owner-plan bucket's work is therefore run eagerly once (which compiles its kernels),
captured as one CUDA graph the next time and replayed from then on: one graph launch and one copy per bucket. A
graph reads and writes fixed addresses, so it is captured again whenever the gradient buffer, the momentum or the
loss scale it was captured with changed, and run eagerly once more when the momentum or Newton–Schulz settings
changed. The stash, allocated anew every step, is not one of them: a graph writes ``o`` into the graphs' output
buffer, one buffer of the largest bucket's stretch in the exchange dtype held for the optimizer's life, and an eager
copy after the replay (on the side stream, 2 bytes read and 2 written per bf16 element) moves it into the bucket's
stash. Before, the stash's own address was the graph's; the caching allocator did not hand a bucket the same block
back every step (one H100: 6 of 7 buckets at 934M, 10-11 of 11 at MoE-1.5B), so each such bucket was captured again
and, after two moves, kept its stash across steps, the forward's peak included (likely +1.46 GiB at 934M:
docs/benchmarks.md, "Issue 40: the defaults beside AdamW and the built-in").
Everything a graph allocates (its scratch, its exchange buffers, Newton–Schulz's temporaries) lives in one memory
pool shared by all the graphs, which run one at a time on the side stream: about one bucket's worth, held for the
optimizer's life. Not supported: freeing cuBLAS's workspaces while the graphs live
(``torch._C._cuda_clearCublasWorkspaces``, which torch.compile's ``mode="reduce-overhead"`` calls before its own
captures): the graphs' matrix products use the side stream's workspace, allocated at the eager run; set
``overlap_cuda_graphs: false`` there.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Callable, Iterable, Optional

import torch
from torch.profiler import record_function

from .muon_step import MuonShardStep
from .exchange import BufferPool, OwnerExchange

__all__ = ["SpeculativeMuon", "FALLBACK_REASONS", "RUN_ELEMENTS", "NARROW_GRADS"]

#: the longest stretch of the shard one speculative momentum call covers (elements): its momentum copy, a
#: temporary of ``RUN_ELEMENTS * 4`` bytes at most (64 MiB), lives on the side stream during backward.
RUN_ELEMENTS = 1 << 24
#: Gradient dtypes a commit reads in place, without a float32 copy (ZeRO-3's bf16 or fp16 gradient buffer).
NARROW_GRADS = (torch.bfloat16, torch.float16)

#: why a sub-group's step fell back to the ordinary path: the clip coefficient was not 1, the step was skipped for
#: an fp16 overflow (or never came), the sub-group's speculation was not complete (a parameter without gradient,
#: or a gradient reduced again after its bucket started), the loss scale the step unscales by is not the one the
#: speculation divided by (fp16's dynamic scale grew at this step: DeepSpeed updates it before unscaling). A block
#: without gradient inside a parameter that has one (an expert without tokens) is not a reason: the commit sets it
#: aside (``commits_idle_blocks``).
FALLBACK_REASONS = ("clip", "overflow", "not_ready", "loss_scale")

#: the parts of a graph's key before its settings, in key order: what a recapture is counted by (``stats``).
_KEY_PARTS = ("grad", "momentum", "loss_scale")


class _SubGroupState:
    """One Muon sub-group's speculation in one step: buckets still waiting and each started bucket's stash ``o``."""

    def __init__(self, step: MuonShardStep) -> None:
        self.waiting = [{s.index for s in b.slots} for b in step.plan.buckets]
        self.started = [False] * len(self.waiting)
        self.stale = False
        self.stashes: dict[int, torch.Tensor] = {}  # bucket -> its ``o``: the stretch of the shard its runs span
        self.loss_scale: Optional[float] = None

    @property
    def complete(self) -> bool:
        return not self.stale and all(self.started)


class _Captured:
    """One owner-plan bucket's speculative work as a CUDA graph, with the addresses and loss scale it was captured
    with (``key``) and the view of the graphs' output buffer it writes ``o`` to (``out``)."""

    def __init__(self, key: tuple, graph, out: torch.Tensor) -> None:
        self.key, self.graph, self.out = key, graph, out


class SpeculativeMuon:
    """The speculative Muon step of every Muon sub-group of one optimizer.

    Args:
        steps: ``{sub_group: MuonShardStep}``, the ordinary steps (plans, block maps, the step's exchange).
        exchanges: ``{sub_group: OwnerExchange}`` for the speculative exchange: same plan, its own process group
            where the step's runs on a communicator that may be in use on another stream (CUDA); each bucket runs it
            with a buffer pool of its own (freed after the bucket, or the graph's).
        stream: the side stream the speculative work runs on (CUDA), or None (inline: CPU, or no streams).
        graphs: capture each bucket's work as a graph where its exchange is one rank (see the module docstring;
            the caller sets it on CUDA only, with a side stream), or False.
        capture: how a graph is captured, ``capture(work) -> replay`` (tests give one that replays ``work`` itself
            over the same tensors); None: :func:`torch.cuda.CUDAGraph` capture into one shared pool.

    Attributes:
        commits: sub-group steps that applied a stash; commits_idle_blocks: those of them that set aside blocks
            without gradient; commits_from_grad: those of them that read a narrow gradient in place
            (:data:`NARROW_GRADS`). fallbacks: ``Counter`` over :data:`FALLBACK_REASONS`.
        captures, replays: buckets captured as a graph, and bucket speculations run by replaying one.
    """

    def __init__(self, steps: dict[int, MuonShardStep], exchanges: dict[int, OwnerExchange],
                 stream: Optional[torch.cuda.Stream] = None, graphs: bool = False,
                 capture: Optional[Callable[[Callable[[], None]], Callable[[], None]]] = None) -> None:
        self.steps, self.exchanges, self.stream = steps, exchanges, stream
        self.graphs, self._capture = graphs, capture or self._cuda_graph
        self.commits = self.commits_idle_blocks = self.commits_from_grad = self.captures = self.replays = 0
        self.fallbacks: Counter = Counter({r: 0 for r in FALLBACK_REASONS})
        self._state: dict[int, _SubGroupState] = {}
        self._run_cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._bucket_cache: dict[int, dict[int, tuple[int, ...]]] = {}
        self._captured: dict[tuple[int, int], _Captured] = {}
        self._warm: dict[tuple[int, int], tuple] = {}  # bucket -> the settings it last ran eagerly with
        self._uncovered: dict[int, list[tuple[int, int]]] = {}  # sub-group -> shard runs in no bucket (padding)
        self.recaptures: Counter = Counter({w: 0 for w in _KEY_PARTS})  # a graph captured again: what changed
        self._graph_out: dict[torch.dtype, torch.Tensor] = {}  # exchange dtype -> the graphs' output buffer
        self._pool = None

    def stats(self) -> dict:
        """``{"commits": int, "commits_idle_blocks": int, "commits_from_grad": int (of the commits, those that read
        a narrower gradient in place, :meth:`commit`), "fallback_<reason>": int, ...,
        "graph_captures": int, "graph_replays": int,
        "graph_recaptures_<what>": int, ...}`` since construction (for the monitor and benchmarks). A recapture is a
        capture of a bucket that had a graph whose key changed, counted under each part of the key that did
        (``grad``, ``momentum``: an address; ``loss_scale``); ``graph_captures`` counts it once."""
        return {"commits": self.commits, "commits_idle_blocks": self.commits_idle_blocks,
                "commits_from_grad": self.commits_from_grad,
                **{f"fallback_{r}": n for r, n in self.fallbacks.items()},
                "graph_captures": self.captures, "graph_replays": self.replays,
                **{f"graph_recaptures_{w}": n for w, n in self.recaptures.items()}}

    def active(self) -> bool:
        """Whether some speculation of this step is held (started, not yet committed or discarded)."""
        return bool(self._state)

    @torch.no_grad()
    def mark_final(self, finals: Iterable[tuple[int, int]], grad_of: Callable[[int], torch.Tensor],
                   momentum_of: Callable[[int], Optional[torch.Tensor]], group_of: Callable[[int], dict],
                   loss_scale: float, wait_for: Optional[torch.cuda.Stream] = None) -> None:
        """Record that these parameters' gradient partitions are final and speculate every bucket now complete.

        Collective over each started bucket's partition group (the exchange's all_to_all): every rank must call it
        with the same ``finals`` in the same order.

        Args:
            finals: ``(sub_group, parameter index in the sub-group)`` in ZeRO's reduce order.
            grad_of: sub-group -> its ``(n,)`` gradient partition (any float dtype, before unscaling; read only), or
                None where it is not one resident slice (the sub-group is then left to the ordinary step).
            momentum_of: sub-group -> its momentum (``(n,)``, fp32 or bf16), or None before the first step; read only.
            group_of: sub-group -> its param group (``momentum``, ``nesterov``, NS settings read now).
            loss_scale: the loss scale the gradients carry (1.0 without fp16).
            wait_for: the stream that wrote the gradients (the side stream waits on it), or None.
        """
        ready = []
        for i, index in finals:
            st = self._state.get(i)
            if st is None:
                st = self._state[i] = _SubGroupState(self.steps[i])
            for k in self._buckets_of(i).get(index, ()):  # the buckets holding a matrix of this parameter
                waiting = st.waiting[k]
                if index in waiting:
                    waiting.discard(index)
                    if not waiting:
                        ready.append((i, k))
                elif st.started[k]:
                    st.stale = True  # reduced again after its bucket was speculated: this speculation is void
        if not ready:
            return
        if self.stream is None:
            for i, k in ready:
                self._speculate(i, k, grad_of(i), momentum_of(i), group_of(i), loss_scale)
            return
        writer = wait_for or torch.cuda.current_stream()
        self.stream.wait_stream(writer)
        # the stashes come from the home stream's blocks, which its queued work may still read: the side stream
        # starts after that work too
        home = torch.cuda.default_stream(self.stream.device)
        if home != writer:
            self.stream.wait_stream(home)
        with torch.cuda.stream(self.stream):
            for i, k in ready:
                grad, momentum = grad_of(i), momentum_of(i)
                if grad is not None:
                    grad.record_stream(self.stream)
                self._speculate(i, k, grad, momentum, group_of(i), loss_scale)

    def _speculate(self, i: int, k: int, grad: torch.Tensor, momentum: Optional[torch.Tensor], group: dict,
                   loss_scale: float) -> None:
        st, step = self._state[i], self.steps[i]
        st.started[k] = True
        if grad is None:  # the gradient is not resident as one slice of the shard: leave it to the step
            st.stale = True
        if st.stale:
            return
        if st.loss_scale is None:
            st.loss_scale = loss_scale
        elif st.loss_scale != loss_scale:
            st.stale = True
            return
        exchange = self.exchanges[i]
        graphs = self.graphs and exchange.world_size == 1
        stash = st.stashes[k] = self._alloc_stash(self._stretch(i, k)[1], exchange.exchange_dtype, grad.device)
        orthogonalize = step._orthogonalizer(group)

        def work(out: torch.Tensor) -> None:  # the exchange's buffers: the bucket's own (eager), or the graph's
            self._bucket_update(i, k, grad, momentum, group, loss_scale, out, orthogonalize, BufferPool())

        settings = (group["momentum"], group["nesterov"], group["momentum_dtype"], step._ns_key)
        if not graphs or momentum is None:
            work(stash)
            self._warm[i, k] = settings
            return
        key = (grad.data_ptr(), momentum.data_ptr(), loss_scale, settings)
        captured = self._captured.get((i, k))
        if captured is None or captured.key != key:
            if captured is not None and captured.key[-1] == settings:
                self.recaptures.update(w for w, a, b in zip(_KEY_PARTS, captured.key, key) if a != b)
            self._captured.pop((i, k), None)
            if self._warm.get((i, k)) != settings:  # first run with these settings: eagerly (compiles kernels)
                work(stash)
                self._warm[i, k] = settings
                return
            out = self._graph_output(exchange.exchange_dtype, grad.device).narrow(0, 0, stash.numel())
            try:  # every buffer the graph allocates comes from the graphs' pool
                replay = self._capture(lambda: work(out))
            except RuntimeError as exc:  # e.g. an op that cannot be captured: eager from now on, this step exact
                warnings.warn(f"ds_muon: capturing the overlapped Muon step as a CUDA graph failed "
                              f"({type(exc).__name__}: {exc}); it runs eagerly from now on "
                              f"(optimizer.params.overlap_cuda_graphs false avoids trying)")
                self.graphs, st.stale = False, True  # this sub-group's step falls back to the ordinary path
                self._captured.clear()
                self._graph_out.clear()
                return
            captured = self._captured[i, k] = _Captured(key, replay, out)
            self.captures += 1
        captured.graph()
        self.replays += 1
        # the graph wrote o into the output buffer (its fixed address); the bucket's stash, new this step, takes it
        stash.copy_(captured.out)

    def _graph_output(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The graphs' output buffer for ``dtype``: ``(n,)`` with ``n`` the largest stretch of any bucket whose work
        runs as a graph (every sub-group whose exchange is one rank), allocated once, on the current (side)
        stream, outside any capture, and held for the optimizer's life: a graph writes ``o`` at a fixed address,
        and the graphs run one at a time, so one buffer serves them all."""
        out = self._graph_out.get(dtype)
        if out is None:
            n = max(self._stretch(i, k)[1] for i, step in self.steps.items() if self.exchanges[i].world_size == 1
                    for k in range(len(step.plan.buckets)))
            out = self._graph_out[dtype] = torch.empty(n, dtype=dtype, device=device)
        return out

    def _alloc_stash(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A bucket's stash for this step, ``(numel,)`` uninitialized (the exchange writes every piece of it that the
        commit reads). On CUDA it is allocated on the home stream (the default stream, where the forward and the
        step run), so that its block, freed by the commit, serves the next forward's activations (a block
        allocated on the side stream would stay cached for the side stream only), and marked as used by the side
        stream (``record_stream``), which writes it after waiting on the home stream (:meth:`mark_final`)."""
        if self.stream is None:
            return self._new_stash(numel, dtype, device)
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            stash = self._new_stash(numel, dtype, device)
        stash.record_stream(self.stream)
        return stash

    @staticmethod
    def _new_stash(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh tensor from the caching allocator (its address is none of the graphs': see the module
        docstring)."""
        return torch.empty(numel, dtype=dtype, device=device)

    def _bucket_update(self, i: int, k: int, grad: torch.Tensor, momentum: Optional[torch.Tensor], group: dict,
                       loss_scale: float, stash: torch.Tensor, orthogonalize, pool: BufferPool) -> None:
        """Bucket ``k`` of sub-group ``i``: ``u`` (the speculative momentum and Nesterov blend of this rank's pieces,
        into a scratch of the bucket's stretch of the shard), its owner exchange and Newton–Schulz into ``stash``
        (the same stretch, in the exchange dtype).
        Reads ``grad`` and ``momentum`` only. ``pool``: the exchange's buffers for this bucket (a fresh one: eagerly
        they go back to the caching allocator after the bucket, in a capture they are the graph's)."""
        lo0, span = self._stretch(i, k)
        u = torch.empty(span, dtype=torch.float32, device=grad.device)
        with record_function("ds_muon/speculative_momentum"):
            for lo, length in self._runs(i, k):  # a handful of launches per bucket, not a handful per matrix
                g = u.narrow(0, lo - lo0, length)
                g.copy_(grad.narrow(0, lo, length))
                if loss_scale != 1.0:
                    g.mul_(1. / loss_scale)  # DeepSpeed's unscale, clip coefficient 1 (unscale_and_clip_grads)
                m = (torch.zeros(length, dtype=getattr(torch, group["momentum_dtype"]), device=g.device)
                     if momentum is None else momentum.narrow(0, lo, length).clone())
                out = self.steps[i].prepare(g, m, group)
                if out.data_ptr() != g.data_ptr():
                    g.copy_(out)
        with record_function("ds_muon/speculative_exchange_and_newton_schulz"):
            self.exchanges[i].run(self.steps[i].plan.buckets[k], u, stash, orthogonalize, u_offset=lo0,
                                  out_offset=lo0, pool=pool)

    def _cuda_graph(self, work: Callable[[], None]) -> Callable[[], None]:
        """Capture ``work`` on the current (side) stream as a CUDA graph in the graphs' shared pool; returns its
        replay. Capture does not run the work: the caller replays it at once. ``"thread_local"``: backward's other
        threads (DeepSpeed's, NCCL's watchdog) may keep using CUDA meanwhile; this thread makes no sync in ``work``."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        try:
            work()
        except BaseException:
            self._end_capture(graph)
            raise
        self._end_capture(graph, reraise=True)
        return graph.replay

    def _end_capture(self, graph, reraise: bool = False) -> None:
        """End a capture. When the capture was invalidated, ``capture_end`` raises before it tells the caching
        allocator to stop routing this thread's allocations to the graphs' pool (PyTorch's ``CUDAGraph::capture_end``
        checks ``cudaStreamEndCapture`` first), which would leave the allocator mid-capture for the rest of the run
        (``empty_cache`` asserts, other streams' freed blocks never come back): end that too."""
        try:
            graph.capture_end()
        except RuntimeError:
            try:
                torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), self._pool)
            except (AttributeError, RuntimeError):  # not this torch's API, or already ended
                pass
            if reraise:
                raise

    def _buckets_of(self, i: int) -> dict[int, tuple[int, ...]]:
        """Sub-group ``i``'s ``{parameter index: the owner-plan buckets holding a matrix of it, ascending}`` (the plan
        is fixed: computed once), so that :meth:`mark_final` visits those buckets alone."""
        buckets = self._bucket_cache.get(i)
        if buckets is None:
            found: dict[int, list[int]] = {}
            for k, b in enumerate(self.steps[i].plan.buckets):
                for index in {s.index for s in b.slots}:
                    found.setdefault(index, []).append(k)
            buckets = self._bucket_cache[i] = {index: tuple(ks) for index, ks in found.items()}
        return buckets

    def _runs(self, i: int, k: int) -> list[tuple[int, int]]:
        """``[(shard offset, length), ...]``: this rank's pieces of bucket ``k`` of sub-group ``i``, adjacent pieces
        merged (a bucket of consecutive layers is a few runs), each at most :data:`RUN_ELEMENTS` long (the momentum
        copy of a run is a temporary), built once. Element-wise work on a run equals the same work piece by piece."""
        key = (i, k)
        runs = self._run_cache.get(key)
        if runs is None:
            rank = self.exchanges[i].rank
            pieces = sorted((s.pieces[rank].shard_offset, s.pieces[rank].sent)
                            for s in self.steps[i].plan.buckets[k].slots if s.pieces[rank].sent)
            merged: list[tuple[int, int]] = []
            for lo, length in pieces:
                if merged and merged[-1][0] + merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((lo, length))
            runs = [(lo + start, min(RUN_ELEMENTS, length - start))
                    for lo, length in merged for start in range(0, length, RUN_ELEMENTS)]
            self._run_cache[key] = runs
        return runs

    def _stretch(self, i: int, k: int) -> tuple[int, int]:
        """``(shard offset, elements)``: the stretch of sub-group ``i``'s shard that bucket ``k``'s runs span on this
        rank (its scratch ``u`` and its stash cover it; ``(0, 0)`` where this rank holds no piece of the bucket)."""
        runs = self._runs(i, k)
        return (runs[0][0], runs[-1][0] + runs[-1][1] - runs[0][0]) if runs else (0, 0)

    def _uncovered_runs(self, i: int) -> list[tuple[int, int]]:
        """``[(shard offset, length), ...]``: the stretches of sub-group ``i``'s shard that no bucket's piece covers
        on this rank (the partition's padding), built once; the commit writes 0 there (where the ordinary step's
        ``o`` keeps ``u``, which is 0 on padding: its gradient and momentum are)."""
        runs = self._uncovered.get(i)
        if runs is None:
            covered = sorted(r for k in range(len(self.steps[i].plan.buckets)) for r in self._runs(i, k))
            runs, at = [], 0
            for lo, n in covered + [(self.steps[i].plan.shard_numel, 0)]:
                if lo > at:
                    runs.append((at, lo - at))
                at = max(at, lo + n)
            self._uncovered[i] = runs
        return runs

    def would_commit(self, i: int, clipped: bool, loss_scale: float) -> bool:
        """Whether :meth:`commit` of sub-group ``i`` would apply its speculation with these arguments (complete,
        not clipped, the loss scale it divided by), asked before the step builds the gradient it reads; counts
        nothing."""
        return self._fallback_reason(self._state.get(i), clipped, loss_scale) is None

    @staticmethod
    def _fallback_reason(st: Optional[_SubGroupState], clipped: bool, loss_scale: float) -> Optional[str]:
        """Why a sub-group with speculation ``st`` (None: none) cannot commit (one of :data:`FALLBACK_REASONS`), or
        None where it can: complete, not clipped, the loss scale it divided by."""
        if st is None or not st.complete:
            return "not_ready"
        if clipped:
            return "clip"
        if st.loss_scale is not None and st.loss_scale != loss_scale:
            return "loss_scale"
        return None

    def join(self) -> None:
        """Make the current stream wait for the speculative work (call before the first commit)."""
        if self.stream is not None and self._state:
            torch.cuda.current_stream().wait_stream(self.stream)

    @torch.no_grad()
    def commit(self, i: int, fp32: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor,
               had: Optional[torch.Tensor], clipped: bool, group: dict, loss_scale: float = 1.0) -> bool:
        """Apply sub-group ``i``'s speculation if that is exact, else count why not and leave the step to the caller.

        Exact when the speculation is complete, ``clipped`` is False and ``loss_scale`` is the scale the speculation
        divided by (DeepSpeed's combined scale was that loss scale): then ``m <- beta*m + (1-beta)*g`` (the same
        kernel as :meth:`MuonShardStep.prepare`, on the final ``g``) and ``p <- p*(1-lr*wd) - lr*o`` with the stash
        (:meth:`MuonShardStep.finalize`, lr and weight decay read now), the blocks that had no gradient set aside
        around both (:meth:`MuonShardStep.set_aside`, as the ordinary step does). The same decision on every rank
        (its inputs are agreed: the global norm, the agreed flags, the same reduce sequence).

        Where ``grad`` is narrower than ``fp32`` (ZeRO-3's bf16 gradient slice, read in place: no float32 copy of
        it is made for such a commit) the momentum reads it and the update reads ``o`` from the stashes, both upcast
        exactly (:meth:`MuonShardStep.momentum_step`, :meth:`MuonShardStep.finalize`), and ``grad`` is left as is.

        Args:
            fp32: ``(n,)`` float32 partition. grad: ``(n,)`` final gradient: float32 (overwritten), or bfloat16 /
                float16 (:data:`NARROW_GRADS`; read only; then the momentum must be float32).
            momentum: ``(n,)`` momentum. had: the agreed no-gradient flags (None: all had).
            clipped: whether the gradient clipping fired this step.
            loss_scale: the loss scale the step unscaled ``grad`` by (1.0 without fp16).

        Returns:
            True: committed (the caller must not step); False: the caller runs the ordinary step.

        Raises:
            ValueError: ``grad`` is neither ``fp32``'s dtype nor one of :data:`NARROW_GRADS`; from
                :meth:`MuonShardStep.momentum_step`, a narrow ``grad`` with momentum that is not float32.
        """
        st = self._state.pop(i, None)
        reason = self._fallback_reason(st, clipped, loss_scale)
        if reason is not None:
            self.fallbacks[reason] += 1
            return False
        narrow = grad.dtype in NARROW_GRADS
        if not narrow and grad.dtype != fp32.dtype:
            raise ValueError(f"ds_muon: the commit of sub-group {i} got a {grad.dtype} gradient for a {fp32.dtype} "
                             f"partition; it reads {fp32.dtype} or, in place, a narrower one ({NARROW_GRADS})")
        if had is not None and not bool(had.any()):  # as the ordinary step: nothing changes, no exchange
            self.commits += 1
            self.commits_idle_blocks += 1
            self.commits_from_grad += narrow
            return True
        step, spans, stashed = self.steps[i], [], []  # every bucket's runs of the shard, and their o in its stash
        put_back = step.set_aside(had, momentum, fp32)  # None where every block had a gradient
        for k, stash in st.stashes.items():
            if self.stream is not None:  # read on the step's stream (a no-op where that is the home stream)
                stash.record_stream(torch.cuda.current_stream())
            lo0, runs = self._stretch(i, k)[0], self._runs(i, k)
            spans += runs
            stashed += [stash.narrow(0, lo - lo0, n) for lo, n in runs]
        if narrow:
            # the gradient as accumulated (bf16), read in place: the momentum from it, o straight from the stashes
            # (both upcast exactly), no float32 copy of either: the ordinary path's values bit for bit
            step.momentum_step(grad, momentum, group)
            for (lo, n), o in zip(spans, stashed):
                step.finalize(fp32.narrow(0, lo, n), o, group)
            for lo, n in self._uncovered_runs(i):  # the partition's padding: o = 0 there, as in the ordinary step
                step.finalize(fp32.narrow(0, lo, n), fp32.new_zeros(n), group)
            self.commits_from_grad += 1
        else:
            step.prepare(grad, momentum, group)
            for lo, n in self._uncovered_runs(i):
                grad.narrow(0, lo, n).zero_()
            # o: the fp32 values the ordinary exchange writes (the stashes hold the wire dtype's); one launch
            torch._foreach_copy_([grad.narrow(0, lo, n) for lo, n in spans], stashed)
            step.finalize(fp32, grad, group)
        if put_back is not None:
            put_back()
            self.commits_idle_blocks += 1
        self.commits += 1
        return True

    def discard(self, reason: Optional[str]) -> None:
        """Drop every held speculation (a skipped step, a backward that never reached a step); count it as
        ``reason`` per sub-group (None: not counted)."""
        if reason is not None:
            self.fallbacks[reason] += len(self._state)
        self._state.clear()
