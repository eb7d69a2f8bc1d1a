"""benchmarks/sm_contention.py without a GPU: the Muon matrices of a preset, the arms of a round, the medians and
ratios of the table, the target's verdict, and a clear refusal where there is no CUDA."""
from __future__ import annotations

import torch

from tests.support.tools import repo_module

sm = repo_module("benchmarks/sm_contention.py")


def _shapes(preset: str, layers: int = 2) -> list:
    example = repo_module("examples/model.py")
    return sm.preset_matrix_shapes(example.CausalLM, example.PRESETS[preset], layers)


def test_matrix_shapes_are_ds_muons_selection() -> None:
    # 2.9B preset (n_kv_heads == n_heads): q, k, v, o (d, d), gate and up (ffn, d), down (d, ffn) per layer; the
    # embedding and the output head are AdamW's
    assert sorted(_shapes("2.9b")) == sorted([(8, 3072, 3072), (4, 8192, 3072), (2, 3072, 8192)])
    # grouped-query attention (tiny: 4 heads, 2 KV heads of 32): k and v are (64, 128), not (d, d)
    assert sorted(_shapes("tiny")) == sorted([(4, 128, 128), (4, 64, 128), (4, 352, 128), (2, 128, 352)])
    # stacked experts, as ds_muon's matrix views cut them: 8 experts' fused gate_up (2 * expert_hidden, d) as a gate
    # and an up block each, and down (d, expert_hidden) beside q and o (d, d); the router is AdamW's
    assert sorted(_shapes("moe", layers=1)) == sorted([(2 * 8 + 8 + 2, 128, 128), (2, 64, 128)])


def test_arm_names_pair_every_both_arm_with_its_side_arm() -> None:
    names = sm.arm_names([0, 32])
    assert names[:3] == ["main", "side", "both"]
    assert {"side/k32", "both/k32", "side/k32/lt", "both/k32/lt", "side/k0/lt"} <= set(names)
    for n in names:
        if n.startswith("both"):
            assert "side" + n[len("both"):] in names


def _round(main: float, side: float, both_main: float, both_make: float, k_main: float, k_make: float,
           k_side: float) -> dict:
    return {"main": {"main_ms": main}, "side": {"side_ms": side},
            "both": {"main_ms": both_main, "side_ms": side, "makespan_ms": both_make},
            "side/k32": {"side_ms": k_side},
            "both/k32": {"main_ms": k_main, "side_ms": k_side, "makespan_ms": k_make}}


def test_summarize_takes_medians_and_pairs_side_arms() -> None:
    rounds = [_round(100, 50, 120, 130, 105, 125, 60), _round(102, 52, 124, 134, 107, 127, 62),
              _round(300, 90, 500, 900, 400, 900, 99)]  # an outlier round: medians ignore it
    rows = {r["arm"]: r for r in sm.summarize(rounds)}
    assert rows["main"] == {"arm": "main", "main_ms": 102}
    assert rows["both"]["main_slowdown"] == 124 / 102
    assert rows["both"]["hidden_share"] == (102 + 52 - 134) / 52
    # the carveout arm's share is against its own side-alone time (62), not the unlimited one's
    assert rows["both/k32"]["hidden_share"] == (102 + 62 - 127) / 62
    assert "main_slowdown" not in rows["side/k32"]
    text = sm.table(sm.summarize(rounds))
    assert text.splitlines()[0].split()[:2] == ["arm", "main"] and len(text.splitlines()) == 6


def test_verdict_needs_half_the_excess_gone_and_no_longer_makespan() -> None:
    def rows(k_main: float, k_make: float, k_side: float = 50) -> list[dict]:
        return sm.summarize([_round(100, 50, 120, 130, k_main, k_make, k_side)])
    assert sm.verdict(rows(110, 120)).endswith("target met")        # 1.10x against 1.20x, makespan 120 <= 130
    assert sm.verdict(rows(111, 120)).endswith("target not met")    # 1.11x: less than half the excess gone
    assert sm.verdict(rows(105, 140)).endswith("target not met")    # the pair takes longer
    # a carveout that slows Newton-Schulz raises its own side-alone time: its hidden share looks better (0.44 > 0.40)
    # while the pair takes 20 ms longer; not met
    assert sm.verdict(rows(108, 150, k_side=90)).endswith("target not met")


def test_verdict_finds_a_meeting_arm_that_is_not_the_least_slowed() -> None:
    r = _round(100, 50, 120, 130, 109, 125, 55)  # both/k32: 1.09x, makespan 125: meets
    r["side/k66"], r["both/k66"] = {"side_ms": 80}, {"main_ms": 102, "side_ms": 80, "makespan_ms": 170}  # longer
    text = sm.verdict(sm.summarize([r]))
    assert text.startswith("best meeting the target both/k32") and text.endswith("target met"), text


def test_table_pads_missing_cells() -> None:
    lines = sm.table(sm.summarize([_round(100, 50, 120, 130, 110, 120, 50)])).splitlines()
    assert len({len(line) for line in lines}) == 1, lines  # every line as wide as the header


def test_side_settings_restore_on_error() -> None:
    calls = []

    class Blas:
        def preferred_blas_library(self, lib=None):
            if lib is None:
                return "cublas"
            calls.append(("lib", lib))
            if lib == "cublaslt":
                raise RuntimeError("no cuBLASLt")

    class FakeTorch:
        class _C:
            @staticmethod
            def _get_sm_carveout_experimental():
                return None

            @staticmethod
            def _set_sm_carveout_experimental(k):
                calls.append(("k", k))

        class backends:
            cuda = Blas()

    try:
        with sm.side_settings(FakeTorch, 32, cublaslt=True):
            pass
    except RuntimeError:
        pass
    assert calls == [("k", 32), ("lib", "cublaslt"), ("k", None), ("lib", "cublas")], calls


def test_refuses_without_cuda(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sm.main(["--model", "tiny"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_refuses_a_preset_its_shapes_do_not_fit(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sm.main(["--model", "moe-1.5b"]) == 2
    assert "dense preset" in capsys.readouterr().err
