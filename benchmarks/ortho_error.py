"""Orthogonality error of each Newton–Schulz method on Muon momentum captured from the main job.

    # 1. capture: train the main job a few steps and save a checkpoint (CPU, 1 process)
    torchrun --nproc_per_node 1 examples/train.py --model small --steps 60 --eval-every 0 --save-dir /tmp/ckpt
    # 2. measure: every Muon parameter's saved momentum, every method x steps x dtype
    python benchmarks/ortho_error.py /tmp/ckpt [--methods standard,polar_express,gram] [--steps 4,5,6]
                                              [--dtypes half,float32] [--out errors.json]

The checkpoint may be a ds_muon ZeRO-3 checkpoint directory (converted to the universal layout in a
temporary directory by :func:`ds_muon.checkpoint.convert_to_universal`) or a universal one already. Each
Muon parameter's ``momentum_buffer`` (the full tensor, fp32) is viewed as ds_muon's owner step views it
(:func:`ds_muon.core.matrix.ns_view_shape`), orthogonalized by :func:`ds_muon.core.newton_schulz.orthogonalize`
(the input of Muon's update is the Nesterov blend ``(1 - beta) G + beta M``; with ``beta = 0.95`` it is
dominated by ``M``, and the gradient is not in the checkpoint), and compared with the exact polar factor
``U V^T`` of a float64 SVD: error = ``||O - U V^T||_F / ||U V^T||_F`` per matrix. Also reported: the
smallest and largest singular value of ``O`` (float64 SVD), i.e. the band the method leaves the
singular values in (exact orthogonalization: all 1).

``half`` in ``--dtypes`` is the precision ds_muon computes in on a GPU (``resolve_ns_dtype("auto")``:
bfloat16, float16 for gram). The table is printed per method, steps and dtype, averaged per matrix kind
(q/k/v/o/gate/up/down; a stacked MoE ``gate_up``/``down`` counts every expert as a matrix).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ds_muon.core.matrix import ns_view_shape  # noqa: E402
from ds_muon.core.newton_schulz import NS_METHODS, orthogonalize
from ds_muon.core.dtypes import resolve_ns_dtype  # noqa: E402

#: Singular values at or above TOP x the Frobenius norm are the "significant" directions of a momentum
#: matrix (the quintic's documented band [0.6818, 1.1344] holds from there, tests/unit/test_newton_schulz.py).
TOP = 1e-2
KINDS = ("q", "k", "v", "o", "gate", "up", "gate_up", "down")
_KIND_RE = re.compile(r"(?:^|\.)(q|k|v|o|gate|up|gate_up|down)_proj(?:\.|$)")


def matrix_kind(name: str) -> str:
    """``"layers.3.attn.q_proj.weight"`` -> ``"q"``; ``"...mlp.gate_up_proj"`` -> ``"gate_up"``; else ``"other"``."""
    m = _KIND_RE.search(name)
    return m.group(1) if m else "other"


def load_momenta(ckpt_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Every Muon parameter's full momentum (``{name: fp32 tensor of the parameter's shape}``) from a
    ds_muon checkpoint (converted to the universal layout in a temporary directory) or a universal one.

    Raises:
        FileNotFoundError: no momentum found (an AdamW-only checkpoint, or one saved before the first
            Muon step). ds_muon.checkpoint.CheckpointError: the checkpoint cannot be converted.
    """
    from ds_muon.checkpoint import convert_to_universal
    with tempfile.TemporaryDirectory() as tmp:
        folder = _universal_folder(ckpt_dir, tag)
        if folder is None:
            folder = convert_to_universal(ckpt_dir, os.path.join(tmp, "universal"), tag)
            folder = _universal_folder(folder, None) or folder
        out = {}
        for path in sorted(glob.glob(os.path.join(folder, "zero", "*", "momentum_buffer.pt"))):
            state = torch.load(path, map_location="cpu", weights_only=True)
            out[os.path.basename(os.path.dirname(path))] = state["param"].float()
    if not out:
        raise FileNotFoundError(f"no Muon momentum (zero/<param>/momentum_buffer.pt) in {ckpt_dir}")
    return out


def _universal_folder(path: str, tag: str | None) -> str | None:
    for cand in ([os.path.join(path, tag)] if tag else []) + [path] + sorted(glob.glob(os.path.join(path, "*"))):
        if os.path.isdir(os.path.join(cand, "zero")):
            return cand
    return None


#: Other projects' Newton–Schulz, measured on the same momenta where installed (their own precision, bf16;
#: heavyball's fixed 5 steps with its 5 tuned coefficient triples, run eagerly here; torch.optim.Muon's
#: quintic with Keller Jordan's coefficients, one matrix at a time).
PEERS = ("heavyball", "torch.optim.Muon")


def _peer(name: str, steps: int):
    if name == "heavyball":
        import heavyball.utils as hb
        if steps != 5:
            return None  # heavyball's iteration has exactly 5 steps
        hb.compile_mode = None  # eager: its inductor graph does not build on CPU (torch 2.13)
        return lambda x: hb.zeropower_via_newtonschulz5(x.bfloat16(), 5)
    from torch.optim import _muon
    coeffs = getattr(_muon, "DEFAULT_NS_COEFFICIENTS", (3.4445, -4.775, 2.0315))
    return lambda x: torch.stack([_muon._zeropower_via_newtonschulz(m, coeffs, steps, 1e-7) for m in x])


def _dtype(name: str, method: str) -> torch.dtype:
    if method in PEERS:
        return torch.bfloat16
    return resolve_ns_dtype("auto", method, "cuda") if name == "half" else resolve_ns_dtype(name, method, "cpu")


def ortho_errors(momenta: dict[str, torch.Tensor], methods=NS_METHODS, steps=(4, 5, 6),
                 dtypes=("half", "float32"), spread: bool = True) -> list[dict]:
    """Per matrix and per (method, steps, dtype): the orthogonality error and singular-value band.

    Args:
        momenta: ``{parameter name: tensor}`` of Muon parameters (>= 2-D; viewed with ``ns_view_shape``).
        methods: ds_muon ``NS_METHODS`` or ``PEERS`` (bf16 whatever ``dtypes``; heavyball at 5 steps only).
            steps: iteration counts. dtypes: ``"half"`` (ds_muon's GPU
            precision per method) or ``NS_DTYPES`` names.
        spread: also the smallest/largest singular value of the output (one float64 SVD per output).

    Returns:
        Rows ``dict(name, kind, index, shape, method, steps, dtype, error, error_top, top_min, top_max,
        sv_min, sv_max)``; ``index`` is the matrix within the parameter's batch view, ``error`` =
        ``||O - U V^T||_F / ||U V^T||_F`` with ``U V^T`` from a float64 SVD of the input;
        ``error_top`` = ``||U_t^T O V_t - I||_F / sqrt(t)`` over the ``t`` singular directions with
        ``sigma >= TOP * ||x||_F`` (the ones carrying the momentum), ``top_min``/``top_max`` the
        smallest/largest diagonal entry of ``U_t^T O V_t`` (the output's gain along those directions).
    """
    rows = []
    for name, t in momenta.items():
        b, m, n = ns_view_shape(t.shape)
        x = t.reshape(b, m, n)
        u, sig, vt = torch.linalg.svd(x.double(), full_matrices=False)
        polar = u @ vt
        top = sig >= TOP * torch.linalg.vector_norm(sig, dim=-1, keepdim=True)  # (b, k) significant directions
        polar_norm = torch.linalg.matrix_norm(polar)
        for method in methods:
            for k in steps:
                peer = _peer(method, k) if method in PEERS else None
                if method in PEERS and peer is None:
                    continue
                for dname in dtypes[:1] if peer else dtypes:
                    dtype = _dtype(dname, method)
                    o = (peer(x) if peer else orthogonalize(x, method, k, dtype)).double()
                    err = torch.linalg.matrix_norm(o - polar) / polar_norm
                    sv = torch.linalg.svdvals(o) if spread else None
                    for i in range(b):
                        # O restricted to the significant singular directions: U_t^T O V_t, ideally I
                        ut, vtt = u[i][:, top[i]], vt[i][top[i]]
                        core = ut.mT @ o[i] @ vtt.mT
                        diag = core.diagonal()
                        rows.append(dict(name=name, kind=matrix_kind(name), index=i, shape=[m, n], method=method,
                                         steps=k, dtype=str(dtype).removeprefix("torch."), error=float(err[i]),
                                         error_top=float(torch.linalg.matrix_norm(core - torch.eye(len(diag), dtype=core.dtype))
                                                         / len(diag) ** 0.5),
                                         top_min=float(diag.min()), top_max=float(diag.max()),
                                         sv_min=float(sv[i].min()) if spread else None,
                                         sv_max=float(sv[i].max()) if spread else None))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean error per (method, steps, dtype) and kind, plus ``"all"``; the band is min/max over the matrices."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        for kind in (r["kind"], "all"):
            g = groups.setdefault((r["method"], r["steps"], r["dtype"], kind),
                                  dict(errors=[], top=[], tlo=[], thi=[], lo=[], hi=[]))
            g["errors"].append(r["error"])
            g["top"].append(r["error_top"])
            g["tlo"].append(r["top_min"])
            g["thi"].append(r["top_max"])
            if r["sv_min"] is not None:
                g["lo"].append(r["sv_min"])
                g["hi"].append(r["sv_max"])
    return [dict(method=k[0], steps=k[1], dtype=k[2], kind=k[3], matrices=len(g["errors"]),
                 error=sum(g["errors"]) / len(g["errors"]), error_max=max(g["errors"]),
                 error_top=sum(g["top"]) / len(g["top"]), top_min=min(g["tlo"]), top_max=max(g["thi"]),
                 sv_min=min(g["lo"]) if g["lo"] else None, sv_max=max(g["hi"]) if g["hi"] else None)
            for k, g in groups.items()]


def print_table(summary: list[dict]) -> None:
    kinds = [k for k in KINDS + ("other",) if any(s["kind"] == k for s in summary)]
    print("| method | steps | dtype | " + " | ".join(kinds) + " | all (mean / max) | significant directions: error, "
          "gain band | singular values of O |")
    print("|---|---|---|" + "---|" * len(kinds) + "---|---|---|")
    table = {(s["method"], s["steps"], s["dtype"], s["kind"]): s for s in summary}
    for method, steps, dtype in dict.fromkeys((s["method"], s["steps"], s["dtype"]) for s in summary):
        cells = [f"{table[(method, steps, dtype, k)]['error']:.3f}" for k in kinds]
        a = table[(method, steps, dtype, "all")]
        band = f"[{a['sv_min']:.3f}, {a['sv_max']:.3f}]" if a["sv_min"] is not None else ""
        print(f"| {method} | {steps} | {dtype} | " + " | ".join(cells) + f" | {a['error']:.3f} / {a['error_max']:.3f} | "
              f"{a['error_top']:.3f}, [{a['top_min']:.3f}, {a['top_max']:.3f}] | {band} |")


def input_spectrum(momenta: dict[str, torch.Tensor]) -> dict[str, float]:
    """Share of the inputs' singular values below 1e-3 and 1e-2 of the Frobenius norm (the region a
    5-step quintic does not lift to ~1; Polar Express is designed for [1e-3, 1])."""
    small3 = small2 = total = 0
    energy = []
    for t in momenta.values():
        b, m, n = ns_view_shape(t.shape)
        x = t.reshape(b, m, n).double()
        s = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x).unsqueeze(-1)
        small3 += int((s < 1e-3).sum())
        small2 += int((s < 1e-2).sum())
        energy.append(float((s.square() * (s >= TOP)).sum(-1).mean()))  # each row of s.square() sums to 1
        total += s.numel()
    return {"below_1e-3": small3 / total, "below_1e-2": small2 / total, "singular_values": total,
            "energy_in_significant": sum(energy) / len(energy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="ds_muon ZeRO-3 checkpoint directory (or a universal one)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--methods", default=",".join(NS_METHODS),
                    help=f"ds_muon methods {NS_METHODS} and peers {PEERS} (where installed)")
    ap.add_argument("--steps", default="4,5,6")
    ap.add_argument("--dtypes", default="half,float32", help="half (ds_muon's GPU precision: bf16, gram fp16), "
                                                             "bfloat16, float16, float32")
    ap.add_argument("--no-spread", action="store_true", help="skip the output singular values (one SVD per output)")
    ap.add_argument("--out", default=None, help="also write every row and the summary as JSON")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    momenta = load_momenta(args.checkpoint, args.tag)
    spec = input_spectrum(momenta)
    print(f"{len(momenta)} Muon momenta from {args.checkpoint}; input singular values below 1e-3 / 1e-2 of ||M||_F: "
          f"{spec['below_1e-3']:.1%} / {spec['below_1e-2']:.1%} of {spec['singular_values']}; share of ||M||_F^2 in "
          f"the significant directions (sigma >= {TOP:g} ||M||_F): {spec['energy_in_significant']:.4f} (mean)")
    rows = ortho_errors(momenta, tuple(args.methods.split(",")), tuple(int(s) for s in args.steps.split(",")),
                        tuple(args.dtypes.split(",")), spread=not args.no_spread)
    summary = summarize(rows)
    print_table(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"input_spectrum": spec, "rows": rows, "summary": summary}, f)


if __name__ == "__main__":
    main()
