"""Checkpoints: same-world-size resume, resume at another world size, load errors, zero_to_fp32.

Same world size (W=2, with and without CPU optimizer offload): N continuous steps vs. N/2 steps,
save, a fresh process group, load, N/2 steps. Compared on every rank, bit for bit
(``torch.equal``): the fp32 master partitions, every optimizer state tensor (Muon momentum, Adam
moments), the Adam step counters and ``muon_step_count``, both right after loading and after the
resumed steps. The AdamW betas are (0.5, 0.75) here because DeepSpeed's CPU Adam kernel
(``csrc/includes/cpu_adam.h``, used by FusedAdam on the CPU accelerator and by DeepSpeedCPUAdam)
keeps ``beta^t`` as a running product in a live process but recomputes it with ``std::pow`` in a
fresh one: with betas like 0.9/0.999 the two differ in the last bit of the bias correction, so a
resumed run drifts from a continuous one by an ulp. Powers of 0.5 and 0.75 (= 3^t / 4^t, exact while
3^t < 2^24, i.e. t <= 15) are exact in fp32 either way, so any remaining difference would be a real
resume bug. The drift itself is asserted with the default betas (0.9, 0.999), without and with CPU
offload, in the same process groups (``DRIFT``): loading is still bit-exact; the resumed run does
differ from the continuous one (the 1-ulp bias-correction difference of step 3 reaches the Muon
weights through the next forward); every weight and state tensor stays within ``DRIFT_RTOL`` = 1e-6
relative of the continuous run's, except the zero-initialised LayerNorm biases, whose norms are ~0.03
after 4 steps: within 1e-5 (measured after 2 resumed steps: 4.4e-6 for those, <= 6.3e-7 elsewhere).

Another world size (W=2 -> 1, 2 -> 3 and 3 -> 2, mixing CPU offload and none): N/2 steps at W_a,
``save_checkpoint``, ``python -m ds_muon.checkpoint to-universal``, load at W_b with
``"checkpoint": {"load_universal": true}``, N/2 more steps. The full (gathered, padding-free) state
right after loading equals the saved one bit for bit. The final parameters are compared with the
single-device oracle ``ds_muon.MuonAdamW`` trained N steps on the same data: every step's global
batch is the same 6 rows at every W (:func:`tests.models.shared_batch`: W=1 x 6 = 2 x 3 = 3 x 2
rows per rank), so only the reduction order differs. Tolerance as in test_zero3_parity:
``PARITY_RTOL`` = 1e-5 relative to each parameter's norm and 1e-3 relative to how far it moved
(measured: at most 1.7e-6 and 1.8e-5).

Errors: loading a checkpoint that does not fit raises ``CheckpointError`` on every rank, naming the
parameter (other shape, Muon <-> AdamW, no momentum) or the conversion command (other world size).
"""
from __future__ import annotations

import copy
import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.spawn import run_distributed
from tests.support.harness import (assert_same_state, resume_phase, state_snapshot, train_steps, PARITY_RTOL, build_engine, clone_tags, compare, ds_config, gathered_params,
                           reference_model, swap_dir_for, train_reference)
from tests.support.models import GLOBAL_BATCH, ParityNet, batch, shared_batch, use_extra, wide_parity_net
from tests.support.tools import REPO as REPO_PATH

REPO = str(REPO_PATH)
STEPS = 4
HALF = STEPS // 2
TAG = "half"
EXACT_BETAS = [0.5, 0.75]  # powers exact in fp32: see the module docstring
OFFLOAD = {"none": {}, "cpu": {"offload_optimizer": {"device": "cpu"}},
           # NVMe runs use wide_parity_net, whose sub-groups are large enough to be swapped (asserted)
           "nvme": {"offload_optimizer": {"device": "nvme"}},
           "nvme_mem": {"offload_optimizer": {"device": "nvme"}, "save_muon_momentum_buffer_in_memory": True}}
# Runs with DeepSpeed's default AdamW betas (0.9, 0.999), by offload mode: the 1-ulp drift after resume.
DRIFT = {"none_default_betas": "none", "cpu_default_betas": "cpu"}
DRIFT_RTOL = 1e-6
DRIFT_RTOL_SMALL = {"norm1.bias": 1e-5, "norm2.bias": 1e-5}  # zero-initialised, small norm


def _zero(offload: str, swap_dir: str) -> dict:
    """zero_optimization keys of an offload mode; NVMe ones swap to ``swap_dir`` (created)."""
    zero = copy.deepcopy(OFFLOAD[offload])
    if offload.startswith("nvme"):
        swap_dir = swap_dir_for(swap_dir)
        os.makedirs(swap_dir, exist_ok=True)
        zero["offload_optimizer"]["nvme_path"] = swap_dir
    return zero


def _model_fn(offload: str):
    return wide_parity_net if offload.startswith("nvme") else ParityNet


def _swapped(engine) -> list[tuple[str, bool]]:
    """``(algorithm, NVMe-swapped)`` per ZeRO sub-group."""
    opt = engine.optimizer
    return [(opt.sub_group_algorithm(i), bool(opt._swappable_optimizer_subgroup(i))) for i in range(len(opt.fp16_groups))]


def _nvme_exercised(swapped: list[tuple[str, bool]]) -> bool:
    """Every Muon sub-group and at least one AdamW sub-group is swapped (the no-decay AdamW sub-group of norms and
    biases is below the swapper's 1 MiB minimum and stays in memory, as DeepSpeed keeps any small sub-group)."""
    return (all(s for alg, s in swapped if alg == "muon") and any(alg == "muon" for alg, _ in swapped)
            and any(s for alg, s in swapped if alg == "adamw"))


_train_range = train_steps  # the steps a resumed run trains (tests/support/harness.py)


# ---- same world size ---------------------------------------------------------------------------
def _same_w_config(offload: str, swap_dir: str = "", exact_betas: bool = True) -> dict:
    cfg = ds_config(gas=2, clip=0.5, **_zero(offload, swap_dir))
    if exact_betas:
        cfg["optimizer"]["params"]["betas"] = list(EXACT_BETAS)
    return cfg


def resume_worker(rank: int, world_size: int, mode: str, root: str, runs: tuple = (*OFFLOAD, *DRIFT)) -> dict:
    """Per offload mode (and ``DRIFT`` run) in ``runs``: ``continuous`` (N steps), ``save`` (N/2 steps,
    save) or ``load`` (load, N/2 steps)."""
    out = {}
    for run in runs:
        offload = DRIFT.get(run, run)
        cfg = _same_w_config(offload, os.path.join(root, f"swap-{mode}-{run}"), exact_betas=run not in DRIFT)
        engine, _ = build_engine(cfg, model_fn=_model_fn(offload))
        ckpt = os.path.join(root, run)
        out[run] = resume_phase(engine, rank, mode, ckpt, TAG, HALF, STEPS, 2, state_snapshot)
        out[f"{run}/swapped"] = _swapped(engine)
        engine.destroy()
    return out


def test_same_world_size_resume_is_bit_exact(tmp_path) -> None:
    """No offload, CPU offload, NVMe, NVMe with the Muon momentum in memory: bit for bit. For NVMe the
    load goes to a fresh swap directory, and zero_to_fp32 on the NVMe checkpoint gives the saved
    fp32 weights exactly (DeepSpeed alone saves empty partitions there)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    W = 2
    continuous = run_distributed(resume_worker, W, "continuous", str(tmp_path))
    saved = run_distributed(resume_worker, W, "save", str(tmp_path))
    resumed = run_distributed(resume_worker, W, "load", str(tmp_path))
    for rank in range(W):
        for offload in OFFLOAD:
            where = f"rank {rank} offload={offload}"
            loaded, final = resumed[rank][offload]
            assert saved[rank][offload]["steps"] and set(saved[rank][offload]["steps"].values()) == {HALF}
            assert saved[rank][offload]["muon_steps"] == HALF
            assert_same_state(loaded, saved[rank][offload], f"{where}, right after loading:")
            want = continuous[rank][offload]
            assert want["steps"] and set(want["steps"].values()) == {STEPS} and want["muon_steps"] == STEPS
            assert any(key == "momentum_buffer" for _, key in want["tensors"]), "no Muon momentum in the state"
            assert_same_state(final, want, f"{where}, resumed vs. continuous:")
            swapped = resumed[rank][f"{offload}/swapped"]
            assert _nvme_exercised(swapped) if offload.startswith("nvme") else not any(s for _, s in swapped), (where, swapped)
    for run in DRIFT:  # default betas: loading exact, continuing within DRIFT_RTOL, and the drift happens
        drifted = []
        for rank in range(W):
            loaded, final = resumed[rank][run]
            assert_same_state(loaded, saved[rank][run], f"rank {rank} {run}, right after loading:")
            want = continuous[rank][run]
            assert final["steps"] == want["steps"] and final["muon_steps"] == want["muon_steps"] == STEPS
            for key, x in want["tensors"].items():
                rel = ((final["tensors"][key] - x).norm() / x.norm().clamp_min(1e-30)).item()
                bound = DRIFT_RTOL_SMALL.get(key[0], DRIFT_RTOL)
                assert rel <= bound, f"rank {rank} {run} {key}: resumed vs. continuous {rel:.2e} > {bound}"
                if key[1] == "fp32" and not torch.equal(final["tensors"][key], x):
                    drifted.append(key[0])
        assert any(name in ("embed.weight", "norm1.weight") for name in drifted), (
            f"{run}: no AdamW drift with the default betas; the README's note on it is stale")
    for offload in ("nvme", "nvme_mem"):
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / offload), tag=TAG)
        for (name, key), want in saved[0][offload]["tensors"].items():
            if key == "fp32":
                assert torch.equal(fp32[name], want), f"zero_to_fp32 on the {offload} checkpoint: {name}"


# ---- another world size: universal checkpoint ---------------------------------------------------
def _cross_config(world_size: int, offload: str, universal: bool = False, swap_dir: str = "") -> dict:
    cfg = ds_config(gas=1, clip=0.5, micro_batch=GLOBAL_BATCH // world_size, **_zero(offload, swap_dir))
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def save_worker(rank: int, world_size: int, ckpt_dir: str, offload: str) -> dict | None:
    """N/2 steps on the shared data, save; rank 0 returns the initial weights, tags and the full state."""
    engine, model = build_engine(_cross_config(world_size, offload, swap_dir=ckpt_dir + "-swap"),
                                 model_fn=_model_fn(offload))
    init, tags = gathered_params(model), clone_tags(model)
    _train_range(engine, rank, 0, HALF, 1, shared_batch, GLOBAL_BATCH // world_size)
    engine.save_checkpoint(ckpt_dir, tag=TAG)
    snap = state_snapshot(engine)
    return {"init": init, "tags": tags, "saved": snap} if rank == 0 else None


def universal_resume_worker(rank: int, world_size: int, universal_dir: str, offload: str,
                            plain_dir: str) -> dict | None:
    """Load the universal checkpoint, N/2 steps; then loading the plain one at this W must fail."""
    from ds_muon.checkpoint import CheckpointError
    swap = universal_dir + f"-swap{world_size}"
    engine, model = build_engine(_cross_config(world_size, offload, universal=True, swap_dir=swap),
                                 model_fn=_model_fn(offload))
    engine.load_checkpoint(universal_dir)  # the tag from latest_universal
    loaded = state_snapshot(engine)
    swapped = _swapped(engine)
    _train_range(engine, rank, HALF, STEPS, 1, shared_batch, GLOBAL_BATCH // world_size)
    final = gathered_params(model)
    engine.destroy()
    # without conversion: a clear error on every rank (a rank with no file of its own included)
    engine, _ = build_engine(_cross_config(world_size, offload, swap_dir=swap), model_fn=_model_fn(offload))
    with pytest.raises(CheckpointError, match=r"saved at data-parallel world size \d, this run has "
                                              rf"{world_size}.*python -m ds_muon\.checkpoint to-universal"):
        engine.load_checkpoint(plain_dir, tag=TAG)
    return {"loaded": loaded, "final": final, "swapped": swapped} if rank == 0 else None


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory) -> dict:
    """W=2 (no offload) and W=3 (CPU offload) checkpoints after N/2 steps, converted to universal ones:
    W=2 through the command line, W=3 through :func:`ds_muon.checkpoint.convert_to_universal`."""
    from ds_muon.checkpoint import convert_to_universal
    root = tmp_path_factory.mktemp("ckpt")
    runs = {}
    for W, offload in ((2, "none"), (3, "cpu"), ("2-nvme", "nvme")):
        w = int(str(W)[0])
        plain, universal = str(root / f"w{W}"), str(root / f"w{W}_universal")
        runs[W] = dict(run_distributed(save_worker, w, plain, offload)[0], plain=plain, universal=universal)
    proc = subprocess.run([sys.executable, "-m", "ds_muon.checkpoint", "to-universal", runs[2]["plain"],
                           runs[2]["universal"]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert convert_to_universal(runs[3]["plain"], runs[3]["universal"], TAG) == os.path.join(runs[3]["universal"], TAG)
    convert_to_universal(runs["2-nvme"]["plain"], runs["2-nvme"]["universal"], TAG)
    return runs


def _oracle(run: dict, model_fn) -> dict:
    """The single-device oracle after N steps on the shared data, from the run's initial weights."""
    import ds_muon
    cfg = _cross_config(1, "none")
    model = reference_model(run["init"], run["tags"], model_fn)
    opt = ds_muon.MuonAdamW(model.parameters(), **cfg["optimizer"]["params"])
    train_reference(model, opt, STEPS, 1, 1, cfg["gradient_clipping"], micro_batch=GLOBAL_BATCH, data=shared_batch)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def oracle(saved_runs) -> dict:
    return _oracle(saved_runs[2], ParityNet)


@pytest.mark.parametrize("w_from,w_to,offload", [(2, 1, "none"), (2, 3, "cpu"), (3, 2, "none"),
                                                 ("2-nvme", 3, "nvme_mem")])
def test_resume_at_another_world_size(saved_runs, oracle, w_from, w_to: int, offload: str) -> None:
    """The NVMe case: saved at W=2 with NVMe offload (wide model, both sub-groups swapped), resumed at
    W=3 with NVMe and the momentum in memory (the Muon sub-group swapped there)."""
    src = saved_runs[w_from]
    res = run_distributed(universal_resume_worker, w_to, src["universal"], offload, src["plain"])[0]
    assert_same_state(res["loaded"], src["saved"], f"W={w_from} -> {w_to}, right after loading:")
    assert any(key == "momentum_buffer" for _, key in res["loaded"]["tensors"])
    want = oracle
    if offload.startswith("nvme"):
        assert any(s for _, s in res["swapped"]), res["swapped"]
        want = _oracle(src, wide_parity_net)
    for name, err in compare(res["final"], want, src["init"]).items():
        if name.startswith("frozen"):
            continue
        assert err["rel"] <= PARITY_RTOL, f"{name}: rel error {err['rel']:.2e}"
        assert err["moved"] > 0 and err["rel_update"] <= 1e-3, f"{name}: update rel error {err['rel_update']:.2e}"


# ---- loads that do not fit -------------------------------------------------------------------
def _pad_a_6x7(model) -> None:
    model.pad_a = torch.nn.Linear(7, 6, bias=False)


def _pad_a_transposed(model) -> None:  # same numel: DeepSpeed alone would load it silently
    model.pad_a = torch.nn.Linear(5, 7, bias=False)


def _o_on_adamw(model) -> None:
    model.o.weight.use_muon = False


def load_errors_worker(rank: int, world_size: int, cases: list) -> None:
    from ds_muon.checkpoint import CheckpointError
    for load_dir, universal, before, pattern in cases:
        engine, _ = build_engine(_cross_config(world_size, "none", universal), before=before)
        with pytest.raises(CheckpointError, match=pattern):
            engine.load_checkpoint(load_dir, tag=None if universal else TAG)
        engine.destroy()


def _drop_momentum(src: str, dst: str, rank: int) -> None:
    """A copy of ``src`` whose rank-``rank`` optimizer file lost the Muon momentum."""
    shutil.copytree(src, dst)
    path = glob.glob(os.path.join(dst, TAG, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))[0]
    sd = torch.load(path, weights_only=False)
    for state in sd["optimizer_state_dict"]["optimizer_state_dict"]["state"].values():
        state.pop("momentum_buffer", None)
    torch.save(sd, path)


def _empty_partitions(src: str, dst: str) -> None:
    """A copy of ``src`` as DeepSpeed alone writes NVMe checkpoints: empty fp32 partitions and state
    placeholders, and no ds_muon metadata."""
    shutil.copytree(src, dst)
    for path in glob.glob(os.path.join(dst, TAG, "zero_pp_rank_*_optim_states.pt")):
        sd = torch.load(path, weights_only=False)
        inner = sd["optimizer_state_dict"]
        inner.pop("ds_muon", None)
        inner["fp32_flat_groups"] = [torch.empty(0) for _ in inner["fp32_flat_groups"]]
        for state in inner["optimizer_state_dict"]["state"].values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = torch.empty(0)
        torch.save(sd, path)


def test_loads_that_do_not_fit_fail_on_every_rank(saved_runs, tmp_path) -> None:
    """W=2: each case raises CheckpointError on both ranks with the parameter or the command named.
    The momentum is removed from rank 1's file only: rank 0 must raise too, not wait for rank 1."""
    from ds_muon.checkpoint import CheckpointError, convert_to_universal
    w2, w3 = saved_runs[2], saved_runs[3]
    no_momentum = str(tmp_path / "no_momentum")
    _drop_momentum(w2["plain"], no_momentum, rank=1)
    with pytest.raises(CheckpointError, match=r"cannot convert(.|\n)*'q\.weight' uses Muon but the checkpoint holds "
                                              "no Muon momentum"):
        convert_to_universal(no_momentum, str(tmp_path / "never"), TAG)
    empty = str(tmp_path / "empty_partitions")
    _empty_partitions(w2["plain"], empty)
    universal_no_momentum = str(tmp_path / "universal_no_momentum")
    shutil.copytree(w3["universal"], universal_no_momentum)
    os.remove(os.path.join(universal_no_momentum, TAG, "zero", "q.weight", "momentum_buffer.pt"))
    shape = r"'pad_a\.weight': shape \(5, 7\) in the checkpoint, \(6, 7\) in the model"
    cases = [
        (w3["plain"], False, None, r"saved at data-parallel world size 3, this run has 2(.|\n)*"
                                   r"python -m ds_muon\.checkpoint to-universal"),
        (w2["plain"], False, _pad_a_6x7, shape),
        (w2["plain"], False, _pad_a_transposed, r"'pad_a\.weight': shape \(5, 7\) in the checkpoint, \(7, 5\)"),
        (w2["plain"], False, _o_on_adamw, r"'o\.weight': Muon in the checkpoint, AdamW in the model"),
        (no_momentum, False, None, r"'q\.weight' uses Muon but the checkpoint holds no Muon momentum "
                                   r"\('momentum_buffer'\) for it, although it was saved after 2 Muon steps"),
        (w3["universal"], True, _pad_a_6x7, shape),
        (w3["universal"], True, _o_on_adamw, r"'o\.weight': Muon in the checkpoint, AdamW in the model"),
        (universal_no_momentum, True, None, r"'q\.weight': \S*momentum_buffer\.pt is missing"),
        (w2["plain"], True, None, r"not a universal checkpoint(.|\n)*python -m ds_muon\.checkpoint to-universal"),
        (w3["universal"], False, None, r"universal checkpoint.*set \"checkpoint\": \{\"load_universal\": true\}"),
        (empty, False, None, r"ZeRO sub-group 0: the checkpoint holds 0 fp32 elements, this run's partition \d+: an "
                             r"NVMe checkpoint saved by DeepSpeed without ds_muon holds empty placeholders"),
    ]
    run_distributed(load_errors_worker, 2, cases, timeout=300)


# ---- zero_to_fp32 ------------------------------------------------------------------------------
def test_zero_to_fp32_reconstructs_the_fp32_weights(saved_runs, tmp_path) -> None:
    """DeepSpeed's zero_to_fp32 on ds_muon checkpoints gives the live fp32 master weights exactly:
    the library function (W=2) and the script DeepSpeed saves next to the checkpoint (W=3, CPU
    offload), run where ds_muon is not importable: the checkpoint pickles no ds_muon class."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    w2, w3 = saved_runs[2], saved_runs[3]
    for run in saved_runs.values():  # no ds_muon class in any file (NVMe checkpoints included)
        for path in glob.glob(os.path.join(run["plain"], TAG, "*.pt")):
            assert not [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if "ds_muon" in g], path
    state = get_fp32_state_dict_from_zero_checkpoint(w2["plain"], tag=TAG)
    script = os.path.join(w3["plain"], "zero_to_fp32.py")
    # ds_muon is installed (editable) here: make importing it fail inside the script's process
    shim = ("import runpy, sys; sys.modules['ds_muon'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", shim, script, w3["plain"], str(tmp_path / "out"), "--tag", TAG],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from_script = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    for run, got in ((w2, state), (w3, from_script)):
        assert got["head.weight"] is got["embed.weight"] or torch.equal(got["head.weight"], got["embed.weight"])
        weights = {name: t for (name, key), t in run["saved"]["tensors"].items() if key == "fp32"}
        for name, want in weights.items():
            assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
        assert torch.equal(got["frozen.weight"], run["init"]["frozen.weight"])


# ------------------------------------------------------------------------------------------------
# a checkpoint of format 1 as first written (ds_muon at commit ef314f8, before the architecture change)
# ------------------------------------------------------------------------------------------------
LEGACY = os.path.join(REPO, "tests", "support", "legacy")
LEGACY_ATOL = 1e-5  # of each tensor's largest element: a few fp32 ulps of rounding, not a step


def _legacy_worker(rank: int, world_size: int, tmp: str) -> dict:
    """Load tests/support/legacy/<optimizer> (W=2, saved after 2 steps by the old code) and train its 3rd step;
    then convert it to a universal checkpoint and load that at this world size too."""
    import ds_muon
    from ds_muon.checkpoint import convert_to_universal
    from tests.support import make_legacy_checkpoint as legacy
    out = {}
    for optimizer in ("muon", "adam_mini"):
        config = legacy.config(optimizer)
        if optimizer == "muon":
            # before decay_norms_and_biases existed Muon's AdamW half decayed norms and biases (one AdamW group); today's default
            # (decay_norms_and_biases false) puts them in a sub-group of their own: the load must say so
            torch.manual_seed(0)
            model = ParityNet()
            engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=config)
            try:
                engine.load_checkpoint(os.path.join(LEGACY, optimizer), tag="legacy")
                out["default_layout_load"] = "loaded"
            except Exception as exc:  # noqa: BLE001 - the message is what the test checks
                out["default_layout_load"] = f"{type(exc).__name__}: {exc}"
            engine.destroy()
            config["optimizer"]["params"]["decay_norms_and_biases"] = True  # the layout it was saved with
        torch.manual_seed(0)
        model = ParityNet()
        engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.load_checkpoint(os.path.join(LEGACY, optimizer), tag="legacy")
        loaded = {"steps": engine.optimizer.step_count, "muon_steps": engine.optimizer.muon_step_count,
                  "algorithms": [g["algorithm"] for g in engine.optimizer.optimizer.param_groups]}
        legacy.train(engine, rank, range(2, 3))
        loaded["after_step3"] = legacy.fp32_masters(engine)
        engine.destroy()
        universal = os.path.join(tmp, optimizer)
        if rank == 0:
            convert_to_universal(os.path.join(LEGACY, optimizer), universal, "legacy")
        torch.distributed.barrier()
        torch.manual_seed(0)
        model = ParityNet()
        engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(),
                                             config=dict(config, checkpoint={"load_universal": True}))
        engine.load_checkpoint(universal)
        loaded["universal_masters"] = legacy.fp32_masters(engine)
        engine.destroy()
        out[optimizer] = loaded
    return out


def test_checkpoint_of_2026_12_01_loads_and_continues(tmp_path) -> None:
    """The format is unchanged: checkpoints the old code wrote (param groups with an ``adam_mini`` flag and no
    ``algorithm``, metadata without ``step_count``) load at W=2 and the 3rd step lands where the old code's 3rd step
    did (bit for bit on the CPU that wrote them; within ``LEGACY_ATOL`` elsewhere); converted to universal they load at W=2 with the saved weights."""
    results = run_distributed(_legacy_worker, 2, str(tmp_path))
    refused = results[0]["default_layout_load"]
    assert refused.startswith("CheckpointError") and "'norm1.weight': param group 1" in refused, refused
    assert "optimizer.params.decay_norms_and_biases" in refused and "before decay_norms_and_biases existed" in refused, refused
    for optimizer, algorithms in (("muon", ["muon", "adamw"]), ("adam_mini", ["adam_mini", "adam_mini", "adamw", "adamw"])):
        want = torch.load(os.path.join(LEGACY, optimizer, "after_step3.pt"))
        got = results[0][optimizer]
        assert got["algorithms"] == algorithms and got["steps"] == 2, got
        assert got["muon_steps"] == 2, got  # every applied step: format 1 as first written has no step_count
        assert set(got["after_step3"]) == set(want)
        for name, w in want.items():
            # Bit-equal on the CPU that wrote the file; another CPU's matmul kernels (Newton–Schulz) round differently
            # (measured: 6e-8 on 'experts', whose entries are ~0.1). A format or semantics change moves a weight by
            # a whole update (~lr = 1e-2), far above this bound.
            err = float((got["after_step3"][name] - w).abs().max())
            assert err <= LEGACY_ATOL * float(w.abs().max()), (optimizer, name, err)
        saved = torch.load(os.path.join(tmp_path, optimizer, "legacy", "zero", "q.weight", "fp32.pt"))["param"]
        assert torch.equal(got["universal_masters"]["q.weight"], saved)
        assert all(torch.equal(r[optimizer]["after_step3"][n], got["after_step3"][n]) for r in results for n in want)
