"""Host probes (ds_muon.integration.probes): what this machine lacks for a config, named before anything starts."""
from __future__ import annotations

import os

import pytest

from ds_muon.config import ConfigError
from ds_muon.integration.probes import _async_io_available, _o_direct_problem
from ds_muon.integration.validation import validate as validate_ds_config
from tests.unit.test_config import muon_config, nvme_config


def test_nvme_path_without_o_direct(tmp_path, monkeypatch):
    """tmpfs refuses O_DIRECT; simulated here (this machine's /tmp supports it)."""
    from ds_muon.integration import probes as config
    real_open = config.os.open

    def open_without_o_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(config.os, "open", open_without_o_direct)
    cfg = nvme_config(tmp_path)
    with pytest.raises(ConfigError, match=r"cannot open files there with O_DIRECT \(Invalid argument\).*tmpfs.*"
                                          r"point nvme_path at a directory on a local disk"):
        validate_ds_config(cfg)


def test_o_direct_probe_leaves_nothing_behind(tmp_path):
    assert _o_direct_problem(str(tmp_path)) is None and list(tmp_path.iterdir()) == []


def test_nvme_path_not_writable_access_denied(tmp_path, monkeypatch):
    """The writability check asks the OS (``os.access``); CI runs as root, for whom every directory is
    writable, so the denial is simulated."""
    from ds_muon.integration import probes as config
    monkeypatch.setattr(config.os, "access", lambda path, mode: False)
    cfg = nvme_config(tmp_path)
    with pytest.raises(ConfigError, match=rf"offload_optimizer\.nvme_path: '{tmp_path}' is not writable by this "
                                          r"process.*fix its permissions, or choose a writable directory"):
        validate_ds_config(cfg)


def test_nvme_without_libaio_names_the_package(tmp_path, monkeypatch):
    from ds_muon.integration import probes as config
    monkeypatch.setattr(config, "_async_io_available", lambda: False)
    cfg = nvme_config(tmp_path)
    with pytest.raises(ConfigError, match=r"offload_optimizer\.device: 'nvme' needs DeepSpeed's async_io op.*"
                                          r"apt-get install libaio-dev"):
        validate_ds_config(cfg)


def test_async_io_is_available_here():
    """CI installs libaio-dev (scripts/test.sh), so the NVMe tests run rather than skip."""
    assert _async_io_available()


def test_nvme_path_that_is_a_file(tmp_path):
    f = tmp_path / "swapfile"
    f.write_text("")
    cfg = muon_config()
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(f)}
    with pytest.raises(ConfigError, match=r"is not a directory"):
        validate_ds_config(cfg)
