"""The CPU count of would-be host syncs (``tests/support/host_reads.py: HostReads``) counts a host read of a device
tensor and nothing that reads host memory only: ``HostCopy``'s values (``ds_muon/sharded/host_copy.py``) are read
without a count, the copy that brought them there is not counted either."""
from __future__ import annotations

import pytest
import torch

from ds_muon.sharded.host_copy import HostCopy
from tests.support.host_reads import HostReads

pytestmark = pytest.mark.unit


def _kinds(reads: HostReads) -> list[str]:
    return [kind for kind, _, _ in reads.events]


def test_host_reads_of_device_tensors_are_counted():
    device = torch.device("cpu")  # the accelerator's device, as ds_muon passes it
    t = torch.ones(4, device=device)
    with HostReads() as reads:
        bool(t.all())
        t.sum().item()
        t.tolist()
        t.cpu()
        torch.nonzero(t)
        torch.tensor(-1.0, device=device)  # DeepSpeed's sentinel: a copy from pageable host memory
        host = torch.empty(4)
        host.copy_(t)  # a blocking copy to the host
        host.to(device)  # and back, blocking
        host.to(device, non_blocking=True)  # not a wait
    assert _kinds(reads) == ["__bool__", "item", "tolist", "cpu", "nonzero", "tensor(device=)",
                             "copy_(blocking, host<->device)", "to(device) from the host, blocking"], reads.sources()
    assert all(where.endswith("test_host_reads.py:" + where.split(":")[-1]) for _, where, _ in reads.events)


def test_reads_of_a_host_copy_are_not_counted():
    flags = torch.tensor([1, 0, 1], dtype=torch.uint8, device=torch.device("cpu"))
    with HostReads() as reads:
        copy = HostCopy(flags.bool())
        had = copy.get().narrow(0, 0, 3)
        assert not bool(had.all())
        assert torch.nonzero(~had).flatten().tolist() == [1]
        host = torch.empty(3, dtype=torch.bool)
        host.copy_(flags.bool(), non_blocking=True)  # no wait on an accelerator either
        assert bool(host.any())
    assert reads.count == 0, reads.sources()
    assert torch.equal(copy.get(), flags.bool()) and copy.get().data_ptr() != flags.data_ptr()
