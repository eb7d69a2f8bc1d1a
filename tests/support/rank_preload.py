"""What the test ranks' forkserver loads once, so that no forked rank pays for it again (tests/support/spawn.py).

A rank that builds its first DeepSpeed engine on the CPU spent about 5.7 s of CPU on work that is the same in
every rank of every test (measured with cProfile on this 2-core machine, one W=2 group, parity model, before this
module existed):

* 2.3 s: DeepSpeed's FusedAdam op builder, loading its already built extension, asks ``cpuinfo.get_cpu_info()``
  for the compiler flags (``OpBuilder.cxx_args`` -> ``cpu_arch``/``simd_width``), a subprocess of about 1.1 s,
  twice; the other ops (shared-memory comm, CPU Adam, async I/O, pinned memory) do the same on first use;
* 1.6 s: ``import torch._dynamo`` (``torch.optim.Optimizer.__init__`` imports it on the first optimizer built);
* 1.4 s: DeepSpeed's ZeRO optimizer check imports ``deepspeed.runtime.zero.muon``, whose module-level
  ``torch.compile`` imports inductor;
* the rest: ds_muon's and DeepSpeed's runtime modules.

Then ``gc.freeze()``: the 430,000 objects those imports leave move to the permanent generation, so a rank's full
garbage collections (DeepSpeed calls ``gc.collect()`` in every ZeRO-3 engine's construction, ``defragment``) walk
only what the rank made: 0.23 s for each before, nothing after (Python's documented use for a pre-forking server:
https://docs.python.org/3/library/gc.html#gc.freeze).

Loaded ops stay loaded in a forked rank (``OpBuilder._loaded_ops``), so ``load()`` there returns at once.
Nothing here depends on a rank's environment (rank, world size, port): ranks still initialise their process
group, build their engines and load any op not listed here themselves. Whatever fails here (an op that is not
built, or is being built: :func:`_load_ops`; a module that does not import) is left to the rank that needs it,
which fails or builds as it would have: past ``import torch, deepspeed`` this module never raises (the forkserver
would die with it).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import io
import os

import torch  # noqa: F401
import deepspeed  # noqa: F401

#: Imported here in this order; one that fails is skipped (left to the rank), the others still load.
MODULES = ("transformers", "torch._dynamo", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3",
           "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.muon.muon_optimizer", "ds_muon",
           "ds_muon.integration.zero3", "ds_muon.integration.zero12")
for _name in MODULES:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)


def _load_ops() -> list[str]:
    """Load every DeepSpeed op ds_muon's CPU runs use (:data:`ds_muon.integration.jit_ops.OPS`) whose extension is
    built and whose build directory holds no ``lock``; the names of those loaded. ``load`` takes that lock and runs
    ninja (a no-op for an up-to-date build): with a lock left by a killed build it would wait forever, here, outside
    every test's time-out (the rank that needs the op waits under its time-out instead, and
    ``python -m ds_muon.integration.jit_ops`` clears stale locks). An extension older than its sources (another
    torch) is rebuilt here as a rank would rebuild it."""
    from deepspeed.accelerator import get_accelerator
    from ds_muon.integration.jit_ops import OPS, _build_dir
    accel = get_accelerator()
    loaded = []
    for name in OPS.get(accel.device_name(), ()):
        with contextlib.suppress(Exception):
            builder = accel.create_op_builder(name)
            if builder is None or not builder.is_compatible(verbose=False):
                continue
            folder = _build_dir(builder.name)
            if not os.path.exists(os.path.join(folder, f"{builder.name}.so")) or os.path.exists(
                    os.path.join(folder, "lock")):
                continue  # a build belongs to scripts/test.sh's op step or to the rank, with its time-out
            with contextlib.redirect_stdout(io.StringIO()):
                builder.load(verbose=False)
            loaded.append(name)
    return loaded


LOADED_OPS: list[str] = []
with contextlib.suppress(Exception):
    LOADED_OPS = _load_ops()
gc.collect()
gc.freeze()
