"""No code runs from a checkpoint file (ds_muon.checkpoint.safe_load).

A crafted file is a ``torch.save`` of a dict whose ``"payload"`` pickles as a call of ``os.system`` (``__reduce__``)
that would create a marker file. Read through :func:`safe_load` it is refused naming the file and the global, and
the marker never appears; with ``DS_MUON_TRUST_CHECKPOINT=1`` (the documented opt-out) the same file runs its
command, which shows the payload is live and the test would catch a loader that executes it.
"""
from __future__ import annotations

import os

import pytest
import torch

from ds_muon.checkpoint.safe_load import ALLOWED_GLOBALS, TRUST_ENV, check_files, safe_load, unsafe_globals
from ds_muon.errors import CheckpointError


class Payload:
    """Pickles as ``os.system("touch <marker>")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _crafted(tmp_path, protocol: int = 2) -> tuple[str, str]:
    marker = str(tmp_path / "marker")
    path = str(tmp_path / "crafted.pt")
    torch.save({"param": torch.ones(3), "payload": Payload(marker)}, path, pickle_protocol=protocol)
    return path, marker


@pytest.mark.parametrize("protocol", [2, 4], ids=["GLOBAL", "STACK_GLOBAL"])
def test_crafted_file_is_refused_and_never_runs(tmp_path, monkeypatch, protocol):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    path, marker = _crafted(tmp_path, protocol)
    with pytest.raises(CheckpointError) as err:
        safe_load(path)
    assert path in str(err.value) and TRUST_ENV in str(err.value)
    if protocol == 2:  # disassembled: the global is named
        assert "system" in str(err.value)
    with pytest.raises(CheckpointError):
        check_files([str(tmp_path)])  # a folder is searched recursively
    assert not os.path.exists(marker)


def test_trust_opt_out_loads_as_deepspeed_does(tmp_path, monkeypatch):
    path, marker = _crafted(tmp_path)
    monkeypatch.setenv(TRUST_ENV, "1")
    check_files([path])  # nothing checked
    safe_load(path)
    assert os.path.exists(marker), "the payload is live: without the check it runs"


def test_tensors_containers_and_deepspeed_scalers_load(tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    path = str(tmp_path / "ok.pt")
    state = {"param": torch.arange(4.0), "groups": [{"lr": 0.02, "betas": (0.9, 0.95)}], "step": 3,
             "loss_scaler": DynamicLossScaler(init_scale=2 ** 8, scale_window=1000, min_scale=1, delayed_shift=2,
                                                     consecutive_hysteresis=False), "zero_stage": ZeroStageEnum(2)}
    torch.save(state, path)
    assert unsafe_globals(path) == []
    got = safe_load(path, mmap=True)
    assert torch.equal(got["param"], state["param"]) and got["groups"] == state["groups"] and got["step"] == 3
    assert got["loss_scaler"].cur_scale == 2 ** 8 and got["zero_stage"] == ZeroStageEnum(2)


def test_allowlist_is_deepspeeds_names():
    """Each allowed global exists in the installed DeepSpeed under that name (a rename would refuse real files)."""
    import importlib
    for name in ALLOWED_GLOBALS:
        module, _, attr = name.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), name


def test_a_damaged_file_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    path = tmp_path / "damaged.pt"
    path.write_bytes(b"not a zip archive")
    with pytest.raises(CheckpointError, match="damaged.pt"):
        safe_load(str(path))


class _Reduces:
    """Pickles as whatever ``__reduce__`` tuple it is given (protocol 2: GLOBAL, then REDUCE; or, through
    ``copyreg.__newobj__``, NEWOBJ, and BUILD when a state follows)."""

    def __init__(self, reduced: tuple) -> None:
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


def _neighbours():
    """``(id, the global refused, object to pickle)``: globals next to :data:`ALLOWED_GLOBALS` (same module, same
    package; functions, an enum, classes), one per code path the weights-only unpickler accepts: REDUCE (a call),
    NEWOBJ + BUILD (``cls.__new__``, then ``__setstate__`` / ``__dict__`` update)."""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.zero import config, offload_config
    import importlib
    logging = importlib.import_module("deepspeed.utils.logging")
    tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")  # (deepspeed.utils re-exports a class)
    return [
        # same module as LossScaler/DynamicLossScaler: a function, called through REDUCE
        ("reduce-same-module-function", "deepspeed.runtime.fp16.loss_scaler.to_python_float",
         _Reduces((loss_scaler.to_python_float, (1.0,)))),
        # same module as fragment_address: the class whose method getattr fetches, called through REDUCE
        ("reduce-same-module-method", "deepspeed.utils.tensor_fragment.tensor_fragment",
         _Reduces((tensor_fragment.tensor_fragment.get_hp_fragment_address, (None,)))),
        # same package as ZeroStageEnum (deepspeed.runtime.zero): an enum of the same kind, REDUCE (how Enums pickle)
        ("reduce-same-package-enum", "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
         offload_config.OffloadDeviceEnum("cpu")),
        # same package as fragment_address (deepspeed.utils), another module: a function
        ("reduce-same-package-function", "deepspeed.utils.logging.log_dist", _Reduces((logging.log_dist, ("x", [0])))),
        # same module as LossScaler, their base class: NEWOBJ, then BUILD with its __dict__
        ("newobj-build-same-module-base-class", "deepspeed.runtime.fp16.loss_scaler.LossScalerBase",
         loss_scaler.LossScalerBase(1.0)),
        # same module as ZeroStageEnum: a pydantic model, NEWOBJ, then BUILD through its __setstate__
        ("newobj-build-same-module-config", "deepspeed.runtime.zero.config.DeepSpeedZeroConfig",
         config.DeepSpeedZeroConfig()),
    ]


CASES = ["reduce-same-module-function", "reduce-same-module-method", "reduce-same-package-enum",
         "reduce-same-package-function", "newobj-build-same-module-base-class", "newobj-build-same-module-config"]


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_a_global_next_to_allowed_ones_is_refused_by_the_file_check(tmp_path, monkeypatch, case):
    """A global that is not on the list but sits next to allowed ones (same module, same package; a function, an
    enum, a class built through NEWOBJ and BUILD) is refused by the file check on its own -- the check that runs
    before DeepSpeed loads a file with ``weights_only=False`` -- and by :func:`safe_load`, naming the file and the
    global; each protocol-2 path that reaches code (REDUCE, NEWOBJ, BUILD). (Fails with the list widened to a
    package, a module or a name prefix.)"""
    from ds_muon.checkpoint.safe_load import check_file, file_code_problems
    monkeypatch.delenv(TRUST_ENV, raising=False)
    ident, name, payload = _neighbours()[case]
    assert ident == CASES[case]
    path = str(tmp_path / f"{ident}.pt")
    torch.save({"param": torch.ones(2), "payload": payload}, path)
    assert name in unsafe_globals(path), (name, unsafe_globals(path))
    with pytest.raises(CheckpointError) as err:
        check_file(path)
    assert path in str(err.value) and name in str(err.value), str(err.value)
    problems = file_code_problems([str(tmp_path)])
    assert len(problems) == 1 and name in problems[0], problems
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        safe_load(path)
