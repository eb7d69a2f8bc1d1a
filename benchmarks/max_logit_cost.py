"""Cost of recording the per-head max attention logits (MuonClip), ds_muon ZeRO-3 step with vs without.

    # GPU, the 934M benchmark model (micro-batch 4 x 1024, bf16, step_time.py's ds_muon config):
    torchrun --nproc_per_node 1 benchmarks/max_logit_cost.py --model 934m
    # CPU, the main job's model and config (examples/train.py defaults: tiny, ds_config_cpu.json, 8 x 128):
    python benchmarks/max_logit_cost.py --model tiny --config examples/ds_config_cpu.json --micro-batch 8 \
        --seq-len 128 --steps 10 --rounds 3

One engine; every attention layer's ``record_max_logits`` switch (examples/model.py) is flipped
between blocks of ``--steps`` steps, off and on alternating for ``--rounds`` rounds (so drift in the
machine's speed hits both alike); each step with recording also takes the values
(``RECORDER.take``, what the clip does once per step). Prints medians of the step and fwd+bwd time
per condition, the ratio, and the recording's own time measured alone: ``max_logits_per_head`` on
one layer's query/key shapes, times the layer count, wall clock and CUDA events, next to the
implementation before 2026-12-02 (``previous_max_logits_per_head``; ``--no-micro`` skips both).
``--micro-only`` times only these (no engine). Target (issue 27): recording <= 2% of step time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def previous_max_logits_per_head(query, key, scaling: float, attention_mask=None, is_causal: bool = False,
                                 chunk_size=None):
    """``ds_muon.model.max_logits.max_logits_per_head`` as it was until 2026-12-02, kept to time against the
    current one (``--micro``) and for ``tests/unit/test_max_logits.py``'s old-against-new check. Same contract.
    Per chunk it ran two matmuls under causality (keys before the chunk, the diagonal block), built the
    causal mask from two ``arange`` and reduced each score chunk over the non-contiguous dims ``(0, 3, 4)``
    straight to ``(Hkv, G)``; about 10 kernels per chunk."""
    import torch
    from ds_muon.model import max_logits as ml
    B, H, Sq, D = query.shape
    Hkv, Sk = key.shape[1], key.shape[2]
    G = H // Hkv
    if chunk_size is None:
        chunk_size = max(1, (1 << 24) // max(1, B * H * Sk))  # its budget then: 2**24 scores
        if is_causal:
            chunk_size = min(chunk_size, max(64, -(-Sq // 4)))
    mask = None if attention_mask is None else ml._grouped_mask(attention_mask, B, H, Hkv, Sq, Sk)
    with torch.no_grad():
        q = query.detach().reshape(B, Hkv, G, Sq, D)
        kt = key.detach().transpose(-1, -2).unsqueeze(2)
        best = torch.full((Hkv, G), float("-inf"), dtype=query.dtype, device=query.device)
        for i0 in range(0, Sq, chunk_size):
            i1 = min(i0 + chunk_size, Sq)
            qc = q[:, :, :, i0:i1]
            if is_causal:
                if i0 > 0:
                    free = torch.matmul(qc, kt[..., :min(i0, Sk)])
                    torch.maximum(best, free.amax(dim=(0, 3, 4)), out=best)
                if i0 < Sk:
                    diag = torch.matmul(qc, kt[..., i0:min(i1, Sk)])
                    rows = torch.arange(i0, i1, device=query.device)[:, None]
                    cols = torch.arange(i0, min(i1, Sk), device=query.device)[None, :]
                    diag.masked_fill_(cols > rows, float("-inf"))
                    torch.maximum(best, diag.amax(dim=(0, 3, 4)), out=best)
                continue
            scores = torch.matmul(qc, kt)
            if mask is not None:
                allowed = mask[:, :, :, i0:i1] if mask.size(3) == Sq else mask
                scores.masked_fill_(~allowed, float("-inf"))
            torch.maximum(best, scores.amax(dim=(0, 3, 4)), out=best)
        return best.reshape(H).float() * scaling


class RecordingClock:
    """Stands in for ``max_logits_per_head`` in examples/model.py's namespace and times every call inside the
    training step: host seconds (``perf_counter`` around the call: what a host-bound forward pays for it) and, on
    CUDA, device seconds (CUDA events around it, read after the step's sync). :meth:`take` returns and resets
    ``(host_s, gpu_s or None)`` summed over the calls since the last take."""

    def __init__(self, fn, device) -> None:
        self.fn, self.cuda = fn, device.type == "cuda"
        self.host, self.events = 0.0, []

    def __call__(self, *args, **kwargs):
        import torch
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.host += time.perf_counter() - t
        if self.cuda:
            stop.record()
            self.events.append((start, stop))
        return out

    def take(self):
        gpu = sum(a.elapsed_time(b) for a, b in self.events) / 1e3 if self.cuda else None
        host, self.host, self.events = self.host, 0.0, []
        return host, gpu


def micro_cost(cfg, micro_batch: int, seq_len: int, device, dtype, reps: int = 10, fn=None) -> dict:
    """``fn`` (default ``max_logits_per_head``) on one layer's causal query/key shapes, measured alone, times the
    layer count: ``{"wall_s", "gpu_s"}`` per step (``gpu_s``: CUDA events around the same calls, None on CPU)."""
    import torch
    from ds_muon.model.max_logits import max_logits_per_head
    fn = max_logits_per_head if fn is None else fn
    q = torch.randn(micro_batch, cfg.n_heads, seq_len, cfg.head_dim, device=device, dtype=dtype)
    k = torch.randn(micro_batch, cfg.n_kv_heads, seq_len, cfg.head_dim, device=device, dtype=dtype)
    for _ in range(3):
        fn(q, k, cfg.head_dim ** -0.5, is_causal=True)
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    for _ in range(reps):
        fn(q, k, cfg.head_dim ** -0.5, is_causal=True)
    if cuda:
        stop.record()
    sync(device)
    wall = (time.perf_counter() - t) / reps * cfg.n_layers
    gpu = start.elapsed_time(stop) / 1e3 / reps * cfg.n_layers if cuda else None
    return dict(wall_s=wall, gpu_s=gpu)


def micro_only(args) -> None:
    """``--micro-only``: both implementations alone on the preset's layer shapes (bf16 on CUDA, fp32 on CPU),
    with their results compared; printed and written to ``--out``."""
    import torch
    sys.path.insert(0, os.path.join(REPO, "examples"))
    sys.path.insert(0, REPO)
    from ds_muon.model.max_logits import max_logits_per_head
    from model import ModelConfig
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig.preset(args.model, max_seq_len=args.seq_len)
    res = {name: micro_cost(cfg, args.micro_batch, args.seq_len, device, dtype, fn=fn)
           for name, fn in (("current", max_logits_per_head), ("previous", previous_max_logits_per_head))}
    q = torch.randn(args.micro_batch, cfg.n_heads, args.seq_len, cfg.head_dim, device=device, dtype=dtype)
    k = torch.randn(args.micro_batch, cfg.n_kv_heads, args.seq_len, cfg.head_dim, device=device, dtype=dtype)
    a = max_logits_per_head(q, k, cfg.head_dim ** -0.5, is_causal=True)
    b = previous_max_logits_per_head(q, k, cfg.head_dim ** -0.5, is_causal=True)
    res["max_abs_difference"] = float((a - b).abs().max())
    res.update(model=args.model, micro_batch=args.micro_batch, seq_len=args.seq_len, device=str(device),
               torch=torch.__version__)
    for name in ("current", "previous"):
        m = res[name]
        gpu = "" if m["gpu_s"] is None else f", GPU {m['gpu_s'] * 1e3:.3f} ms"
        print(f"{name}: {m['wall_s'] * 1e3:.3f} ms per step ({cfg.n_layers} layers, wall){gpu}")
    print(f"max |current - previous| = {res['max_abs_difference']:.3g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="934m", help="an examples/model.py preset")
    ap.add_argument("--config", default=None, help="DeepSpeed config JSON (default: step_time.py's ds_muon, bf16)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    ap.add_argument("--rounds", type=int, default=3, help="off/on block pairs")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--micro-only", action="store_true",
                    help="only time the recording alone (current and previous implementation), no engine")
    ap.add_argument("--out", default=None, help="also write the results as JSON")
    args = ap.parse_args()
    if args.micro_only:
        return micro_only(args)

    if "RANK" not in os.environ:  # plain `python ...`: a single process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
    import deepspeed
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(REPO, "examples"))
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    sys.path.insert(0, REPO)
    import ds_muon
    from ds_muon.model.max_logits import RECORDER
    import model as model_module
    from model import CausalLM, ModelConfig

    deepspeed.init_distributed()
    rank = dist.get_rank()
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
        config["gradient_accumulation_steps"] = 1
    else:
        from step_time import ds_config
        config = ds_config("ds_muon", args.micro_batch)
    torch.manual_seed(0)
    cfg = ModelConfig.preset(args.model, max_seq_len=args.seq_len)
    model = CausalLM(cfg)
    engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = engine.device
    attns = [layer.attn for layer in model.layers]
    g = torch.Generator(device="cpu").manual_seed(rank)
    times = {False: [], True: []}
    fwd_bwd = {False: [], True: []}
    clock = RecordingClock(model_module.max_logits_per_head, device)
    model_module.max_logits_per_head = clock  # what the attention calls (examples/model.py imports it by name)
    inside = {"host_s": [], "gpu_s": []}  # per step with recording: time inside the recording calls
    peak = {False: 0, True: 0}
    blocks = [False] * (args.warmup > 0) + [c for _ in range(args.rounds) for c in (False, True)]
    for b, record in enumerate(blocks):
        for a in attns:
            a.record_max_logits = record
        n = args.warmup if b == 0 and args.warmup else args.steps
        for _ in range(n):
            x = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            sync(device)
            t1 = time.perf_counter()
            engine.step()
            if record:
                taken = [RECORDER.take(a) for a in attns]
                assert all(t is not None for t in taken), "an attention layer recorded nothing"
            sync(device)
            t2 = time.perf_counter()
            host, gpu = clock.take()
            if record and (b > 0 or not args.warmup):
                inside["host_s"].append(host)
                inside["gpu_s"].append(gpu)
            if b > 0 or not args.warmup:
                times[record].append(t2 - t0)
                fwd_bwd[record].append(t1 - t0)
                if device.type == "cuda":
                    peak[record] = max(peak[record], torch.cuda.max_memory_allocated(device))
    res = {k: dict(step_s=statistics.median(times[k]), fwd_bwd_s=statistics.median(fwd_bwd[k]),
                   peak_gib=peak[k] / 2**30) for k in (False, True)}
    res[True].update({f"recording_{k}": statistics.median(v) for k, v in inside.items() if None not in v})
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    micro = micro_cost(cfg, args.micro_batch, args.seq_len, device, dtype) if args.micro else None
    micro_prev = (micro_cost(cfg, args.micro_batch, args.seq_len, device, dtype, fn=previous_max_logits_per_head)
                  if args.micro else None)
    if rank == 0:
        off, on = res[False], res[True]
        print(f"\nmodel {args.model} ({sum(p.ds_numel for p in model.parameters()) / 1e6:.0f}M params), "
              f"micro-batch {args.micro_batch} x {args.seq_len}, world {dist.get_world_size()}, {device}, "
              f"{args.rounds} x {args.steps} steps per condition (medians)")
        print("| recording | step s | fwd+bwd s | peak GiB |")
        print("|---|---|---|---|")
        for name, r in (("off", off), ("on", on)):
            print(f"| {name} | {r['step_s']:.4f} | {r['fwd_bwd_s']:.4f} | {r['peak_gib']:.2f} |")
        print(f"step on/off {on['step_s'] / off['step_s']:.4f}x ({on['step_s'] / off['step_s'] - 1:+.2%}); "
              f"fwd+bwd on/off {on['fwd_bwd_s'] / off['fwd_bwd_s']:.4f}x")
        gpu = on.get("recording_gpu_s")
        print(f"inside the training step: the recording calls take {on['recording_host_s'] * 1e3:.2f} ms of host time "
              f"per step ({on['recording_host_s'] / off['step_s']:.2%} of the step without recording)" +
              ("" if gpu is None else f", {gpu * 1e3:.2f} ms of GPU time ({gpu / off['step_s']:.2%})"))
        if micro is not None:
            for name, m in (("max_logits_per_head", micro), ("previous_max_logits_per_head", micro_prev)):
                gpu = "" if m["gpu_s"] is None else f", GPU {m['gpu_s'] * 1e3:.2f} ms"
                print(f"{name} alone: {m['wall_s'] * 1e3:.2f} ms per step ({cfg.n_layers} layers){gpu} = "
                      f"{m['wall_s'] / off['step_s']:.2%} of the step without recording")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(args=vars(args), off=off, on=on, micro=micro, micro_previous=micro_prev), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
