"""Where ``overlap_backward`` "auto" runs, and the reduce bucket ds_muon picks for the overlapped step
(``ds_muon.integration.overlap``), from DeepSpeed's own ZeRO config model and ds_muon's parsed params."""
from __future__ import annotations

import pytest
from deepspeed.runtime.zero.config import get_zero_config

from ds_muon.config.muon import parse_muon_params
from ds_muon.integration.overlap import OVERLAP_REDUCE_BUCKET_SIZE, overlap_auto_applies, overlap_reduce_bucket_size

SMALL = OVERLAP_REDUCE_BUCKET_SIZE


def _bucket(zero: dict, params: dict, device: str = "cuda", world: int = 1):
    zc = get_zero_config({"zero_optimization": zero})
    return overlap_reduce_bucket_size(zc, parse_muon_params({"lr": 0.02, **params}), zc.stage, device, world)


@pytest.mark.parametrize("device, offloaded, world, graphs, on", [
    ("cuda", False, 1, True, True),
    ("cuda", False, 2, True, False),  # eager launches on backward's host thread: measured slower
    ("cuda", True, 1, True, False),
    ("cuda", False, 1, False, False),
    ("cpu", False, 1, True, False),
])
def test_auto_applies(device, offloaded, world, graphs, on):
    assert overlap_auto_applies(device, offloaded, world, graphs) is on


@pytest.mark.parametrize("zero, params, device, world, want", [
    ({"stage": 3}, {}, "cuda", 1, SMALL),                                   # "auto" on, key unset
    ({"stage": 3, "reduce_bucket_size": 5e8}, {}, "cuda", 1, None),          # set by the user (even to the default)
    ({"stage": 3, "reduce_bucket_size": 2e8}, {"overlap_backward": True}, "cuda", 1, None),
    ({"stage": 3}, {}, "cuda", 2, None),                                    # "auto" off at W=2
    ({"stage": 3}, {}, "cpu", 1, None),                                     # "auto" off on the CPU
    ({"stage": 3}, {"overlap_backward": False}, "cuda", 1, None),
    ({"stage": 3}, {"overlap_cuda_graphs": False}, "cuda", 1, None),         # "auto" needs the graphs
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {"overlap_backward": True}, "cuda", 1, None),
    ({"stage": 3, "offload_optimizer": {"device": "none"}}, {}, "cuda", 1, SMALL),
    ({"stage": 2}, {}, "cuda", 1, None),                                    # "auto" is off at ZeRO-1/2
    ({"stage": 2}, {"overlap_backward": True}, "cuda", 2, SMALL),           # true: wherever it runs
    ({"stage": 3}, {"overlap_backward": True}, "cpu", 4, SMALL),
    ({"stage": 1, "overlap_comm": True}, {"overlap_backward": True}, "cuda", 1, SMALL),
    ({"stage": 1, "overlap_comm": False}, {"overlap_backward": True}, "cuda", 1, None),  # refused: nothing to set
    ({"stage": 3, "reduce_bucket_size": 1e7}, {}, "cuda", 1, None),          # a smaller set value: kept too
])
def test_reduce_bucket_for_overlap(zero, params, device, world, want):
    assert _bucket(zero, params, device, world) == want


def test_no_ds_muon_params_keeps_the_config():
    zc = get_zero_config({"zero_optimization": {"stage": 3}})
    assert overlap_reduce_bucket_size(zc, None, 3, "cuda", 1) is None


@pytest.mark.parametrize("speculative, said", [(object(), "starts early in backward"), (None, "does not run")])
def test_the_log_says_whether_the_overlap_runs(monkeypatch, speculative, said):
    """The line rank 0 logs after the ZeRO optimizer is built names the bucket, DeepSpeed's default it replaced and
    whether the overlapped step it was chosen for runs (it may not: no Muon sub-group, expert-parallel groups)."""
    import logging
    import types

    from ds_muon.integration import hooks
    monkeypatch.setattr(hooks.dist, "get_rank", lambda: 0)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    hooks.ds_logger.addHandler(handler)
    level = hooks.ds_logger.level
    hooks.ds_logger.setLevel(logging.INFO)
    try:
        engine = types.SimpleNamespace(zero_reduce_bucket_size=lambda: SMALL)
        hooks._say_overlap_bucket(engine, types.SimpleNamespace(speculative=speculative), 500_000_000)
        hooks._say_overlap_bucket(engine, types.SimpleNamespace(speculative=speculative), None)  # nothing replaced
    finally:
        hooks.ds_logger.removeHandler(handler)
        hooks.ds_logger.setLevel(level)
    assert len(lines) == 1 and f"{SMALL:.0e} elements instead of DeepSpeed's default 5e+08" in lines[0], lines
    assert said in lines[0], lines


def test_the_docs_state_the_bucket_the_code_picks():
    """The option's description (and so the schemas and docs/configuration.md), README.md and docs/design.md give
    the reduce bucket :data:`OVERLAP_REDUCE_BUCKET_SIZE` holds, written as they write it (``1e8``)."""
    from pathlib import Path

    from ds_muon.config.muon import MuonOptimizerParams
    written = f"{SMALL:.0e}".replace("e+0", "e").replace("e+", "e")  # 100_000_000 -> "1e8"
    repo = Path(__file__).resolve().parents[2]
    assert f"gives DeepSpeed {written} elements instead of its 5e8" in \
        MuonOptimizerParams.model_fields["overlap_backward"].description
    assert f"a reduce bucket of {written} elements" in (repo / "README.md").read_text()
    assert f"`OVERLAP_REDUCE_BUCKET_SIZE` = {written} before DeepSpeed builds" in (repo / "docs/design.md").read_text()
