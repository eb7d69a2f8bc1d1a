"""How the shared spawn helper starts ranks (tests/support/spawn.py, ``start_method``).

Ranks fork from a forkserver that has run tests/support/rank_preload.py only when nothing they see can differ from
that process: no per-rank ``env`` and the environment of the session's start (aside from pytest's
``PYTEST_CURRENT_TEST``, what ``import deepspeed`` sets in every process, and inductor's cache directory, which
``import torch._dynamo`` writes into ``os.environ``, absolute). Any other group starts fresh
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


def test_inductor_setting_its_default_cache_dir_keeps_the_forkserver(monkeypatch, tmp_path) -> None:
    """torch's inductor writes its cache directory into ``os.environ`` when its modules load (``import
    torch._dynamo``, the first ``torch.optim`` optimizer's, in the test process): its default, or the absolute form
    of a value set before the session, is what a rank would use too, so groups stay forked; another directory is a
    real change."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.delenv("DS_MUON_TEST_FORKSERVER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "recorded")  # so that monkeypatch restores the variable's state
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(spawn, "_BASE_ENV", spawn._environ())
    cache_dir()  # sets TORCHINDUCTOR_CACHE_DIR to the default
    assert "TORCHINDUCTOR_CACHE_DIR" in spawn.os.environ
    assert spawn.changed_env() == {} and spawn.start_method(_fn, None) == "forkserver"
    monkeypatch.chdir(tmp_path)  # a relative value set before the session: cache_dir() makes it absolute
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "relative_cache")
    monkeypatch.setattr(spawn, "_BASE_ENV", spawn._environ())
    cache_dir()
    assert spawn.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "relative_cache")
    assert spawn.changed_env() == {} and spawn.start_method(_fn, None) == "forkserver"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "another"))
    assert spawn.changed_env() == {"TORCHINDUCTOR_CACHE_DIR": (str(tmp_path / "relative_cache"),
                                                              str(tmp_path / "another"))}
    assert spawn.start_method(_fn, None) == "spawn"
