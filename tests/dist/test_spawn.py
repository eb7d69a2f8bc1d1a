"""The shared spawn helper's forkserver hands its ranks what :mod:`tests.support.rank_preload` loaded.

A rank forked from it starts with torch.compile's modules imported and every DeepSpeed op that is built already
loaded (DeepSpeed's ``OpBuilder._loaded_ops``), so its first engine does not ask ``cpuinfo`` for compiler flags or
import inductor again (5.7 s of CPU per rank before), and with those imports' objects frozen out of its garbage
collections (``gc.freeze``). A typo in ``PRELOAD`` would not fail anything else: the
forkserver ignores a preload module that does not import, and every test would only get slower; so would a variable
an earlier test left changed in ``os.environ`` (every later group then starts fresh interpreters): this test, run in
the middle of the suite, fails on either.
"""
from __future__ import annotations

import os
import sys

from tests.support.spawn import changed_env, run_distributed, start_method

MODULES = ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer", "ds_muon.integration.zero3")


def _loaded_ops_table() -> dict:
    """DeepSpeed's table of loaded ops (``OpBuilder._loaded_ops``: op name -> module), found through a builder."""
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    return next(k.__dict__["_loaded_ops"] for k in type(builder).__mro__ if "_loaded_ops" in k.__dict__)


def _at_start(rank: int, world_size: int) -> dict:
    """What a rank has before it builds anything (``deepspeed.init_distributed`` aside)."""
    import gc
    preload = sys.modules.get("tests.support.rank_preload")
    return {"ops": sorted(_loaded_ops_table()), "modules": [m for m in MODULES if m in sys.modules],
            "frozen": gc.get_freeze_count(), "preloaded": None if preload is None else list(preload.LOADED_OPS),
            "op_names": {n: _op_name(n) for n in ([] if preload is None else preload.LOADED_OPS)}}


def _op_name(builder: str) -> str:
    """The op name (``fused_adam``) of a DeepSpeed op builder class name (``FusedAdamBuilder``)."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().create_op_builder(builder).name


def test_forked_ranks_start_with_the_preloaded_ops_and_modules() -> None:
    got = run_distributed(_at_start, 2)
    if os.environ.get("DS_MUON_TEST_FORKSERVER") == "0":  # fresh interpreters by request, which load nothing early
        assert start_method(_at_start, None) == "spawn"
        for r in got:
            assert "fused_adam" not in r["ops"] and "torch._dynamo" not in r["modules"] and not r["frozen"], r
        return
    # Run mid-suite: an earlier test that left a variable changed in os.environ would have turned every later group
    # into fresh interpreters (as inductor's TORCHINDUCTOR_CACHE_DIR once did: 3 s more per rank, silently)
    assert start_method(_at_start, None) == "forkserver", f"os.environ changed since the session started: {changed_env()}"
    for rank, r in enumerate(got):
        assert r["preloaded"] is not None, f"rank {rank}: the forkserver did not import tests.support.rank_preload"
        # FusedAdam (DeepSpeed's AdamW on the CPU, every ZeRO engine's) at least: scripts/test.sh builds the ops
        # before pytest starts; a plain `pytest` on a fresh checkout builds them in the first ranks instead
        assert "FusedAdamBuilder" in r["preloaded"], (
            f"rank {rank}: the preload loaded {r['preloaded']}; FusedAdam was not built when the forkserver started "
            f"(python -m ds_muon.integration.jit_ops builds the ops)")
        assert set(r["op_names"].values()) <= set(r["ops"]), (rank, r["op_names"], r["ops"])
        assert r["modules"] == list(MODULES), (rank, r["modules"])
        # the imports' objects are in the permanent generation: a rank's gc.collect() walks only its own
        assert r["frozen"] > 100_000, (rank, r["frozen"])
