"""How the shared spawn helper starts ranks (tests/support/spawn.py, ``start_method``).

Ranks fork from a forkserver that has imported torch, deepspeed and transformers only when nothing they see can
differ from that process: no per-rank ``env`` and the environment of the session's start (aside from pytest's
``PYTEST_CURRENT_TEST`` and what ``import deepspeed`` sets in every process). Any other group starts fresh
interpreters, and ``DS_MUON_TEST_FORKSERVER=0`` makes every group do so.
"""
from __future__ import annotations

from tests.support import spawn


def _fn(rank: int, world_size: int) -> None:  # a rank function; never run here
    raise AssertionError("not called")


def test_forkserver_only_under_the_session_environment(monkeypatch) -> None:
    monkeypatch.delenv("DS_MUON_TEST_FORKSERVER", raising=False)
    monkeypatch.setattr(spawn, "_BASE_ENV", spawn._environ())
    assert spawn.start_method(_fn, None) == "forkserver"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # changes per test phase; no rank reads it
    assert spawn.start_method(_fn, None) == "forkserver"
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setattr(spawn, "_BASE_ENV", spawn._environ())
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # what `import deepspeed` sets, here and in the forkserver
    assert spawn.start_method(_fn, None) == "forkserver"
    assert spawn.start_method(_fn, {"DS_MUON_TRUST_CHECKPOINT": "1"}) == "spawn"  # per-rank env: fresh interpreters
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # set since the session started: forked ranks would miss it
    assert spawn.start_method(_fn, None) == "spawn"
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    assert spawn.start_method(_fn, None) == "forkserver"
    monkeypatch.setenv("DS_MUON_TEST_FORKSERVER", "0")
    monkeypatch.setattr(spawn, "_BASE_ENV", spawn._environ())
    assert spawn.start_method(_fn, None) == "spawn"
