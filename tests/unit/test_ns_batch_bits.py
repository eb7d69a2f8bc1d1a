"""scripts/ns_batch_bits.py: the premise of the CPU overlap tests' bit-for-bit checks, that Newton–Schulz of a
matrix on the CPU does not depend on the other matrices of its batched call, and that the script's comparison
does report a batch-dependent result."""
from __future__ import annotations

import pytest
import torch

from tests.support.tools import repo_module


def _load():
    return repo_module("scripts/ns_batch_bits.py")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_batched_newton_schulz_is_per_matrix(dtype):
    row = _load().compare((24, 24), 3, 1, dtype, torch.device("cpu"))
    assert row["bit_equal"] and row["max_rel_diff"] == 0.0, row


def test_a_batch_dependent_result_is_reported(monkeypatch):
    module = _load()
    real = module.orthogonalize
    # a kernel whose rounding depends on the batch count, as a cuBLAS kernel choice may; scaled by 100 so that the
    # relative difference (about 1e-3) is not the absolute one (about 0.1)
    monkeypatch.setattr(module, "orthogonalize",
                        lambda x, dtype: real(x, dtype=dtype) * 100 * (1 + 1e-3 * x.shape[0]))
    row = module.compare((24, 24), 3, 1, torch.float32, torch.device("cpu"))
    assert not row["bit_equal"] and 1e-4 < row["max_rel_diff"] < 1e-2, row


def test_the_compiled_kernel_on_the_cpu_is_per_matrix_too():
    module = _load()
    row = module.compare((24, 24), 3, 1, torch.float32, torch.device("cpu"),
                         module.compiled_orthogonalize("standard", 5, torch.float32))
    assert row["bit_equal"], row
