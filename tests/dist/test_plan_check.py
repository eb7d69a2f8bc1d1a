"""Every rank's owner plan is checked against the others' when the optimizer is built
(``ds_muon.sharded.plan_check.check_plans_agree``, called by both ZeRO subclasses).

W=2 on gloo, one process group. Rank 1 is perturbed as a model built differently or a nondeterministic order
would: another owner for one matrix (ZeRO-3 and ZeRO-2), another name for one parameter (ZeRO-3). Both ranks
must raise the same error, naming the matrix with each rank's name, shape and owner, and nothing hangs (the
spawn has a deadline). Unperturbed builds at both stages pass the check.
"""
from __future__ import annotations

import pytest

from tests.support.harness import build_engine, ds_config
from tests.support.spawn import run_distributed

RENAMED = "up.weight"  # a Muon matrix of ParityNet


def _flip_one_owner(flipped: list[str]):
    """``ownership._assign_owners`` that moves the last matrix (by index) to the next rank; its name is recorded."""
    from ds_muon.sharded import ownership
    assign = ownership._assign_owners

    def flipped_owners(infos, world_size, policy):
        owners = assign(infos, world_size, policy)
        last = max(infos, key=lambda t: t.index)
        owners[last.index] = (owners[last.index] + 1) % world_size
        flipped.append(last.param.name)
        return owners
    return flipped_owners


def _worker(rank: int, world_size: int) -> dict:
    import contextlib
    import unittest.mock as mock

    from ds_muon.integration.zero3 import MuonZeroOptimizer
    from ds_muon.sharded import ownership
    out: dict = {}

    def build(label: str, cfg: dict) -> None:
        try:
            engine, _ = build_engine(cfg)
            out[label] = "built"
            engine.destroy()
        except RuntimeError as err:
            out[label] = str(err)

    for stage in (3, 2):
        build(f"same@{stage}", ds_config(stage=stage))
        flipped: list[str] = []
        with (mock.patch.object(ownership, "_assign_owners", _flip_one_owner(flipped)) if rank == 1
              else contextlib.nullcontext()):
            build(f"owner@{stage}", ds_config(stage=stage))
        out[f"flipped@{stage}"] = flipped
    name_of = MuonZeroOptimizer._name

    def renamed(self, p):
        name = name_of(self, p)
        return name + ".on_rank_1" if name == RENAMED else name
    with mock.patch.object(MuonZeroOptimizer, "_name", renamed) if rank == 1 else contextlib.nullcontext():
        build("name@3", ds_config())
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 2, timeout=600)


@pytest.mark.parametrize("stage", [3, 2])
def test_same_plans_build(results, stage: int) -> None:
    assert [r[f"same@{stage}"] for r in results] == ["built", "built"], results


@pytest.mark.parametrize("stage", [3, 2])
def test_another_owner_on_rank_1_fails_on_both_ranks_naming_the_matrix(results, stage: int) -> None:
    flipped = results[1][f"flipped@{stage}"]
    assert flipped and results[0][f"flipped@{stage}"] == [], results
    errors = [r[f"owner@{stage}"] for r in results]
    assert errors[0] == errors[1], errors  # the same message on every rank
    text = errors[0]
    assert text.startswith("ds_muon: the Muon owner plan differs between ranks"), text
    assert f"rank 0: '{flipped[0]}'" in text and f"rank 1: '{flipped[0]}'" in text, text
    assert "owner rank 0" in text and "owner rank 1" in text, text
    assert "built differently on one rank" in text and "nondeterministic parameter order" in text, text
    assert ("ZeRO sub-group" if stage == 3 else "ZeRO param group") in text, text


def test_another_parameter_name_on_rank_1_fails_on_both_ranks(results) -> None:
    errors = [r["name@3"] for r in results]
    assert errors[0] == errors[1], errors
    text = errors[0]
    assert f"rank 0: '{RENAMED}' shape" in text and f"rank 1: '{RENAMED}.on_rank_1' shape" in text, text
