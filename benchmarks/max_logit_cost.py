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
one layer's query/key shapes, times the layer count (``--no-micro`` skips it). Target: recording
<= 3% of step time.
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


def micro_cost(cfg, micro_batch: int, seq_len: int, device, dtype, reps: int = 10) -> float:
    """Seconds of ``max_logits_per_head`` for all layers of one forward, measured alone."""
    import torch
    from ds_muon.model.max_logits import max_logits_per_head
    q = torch.randn(micro_batch, cfg.n_heads, seq_len, cfg.head_dim, device=device, dtype=dtype)
    k = torch.randn(micro_batch, cfg.n_kv_heads, seq_len, cfg.head_dim, device=device, dtype=dtype)
    for _ in range(3):
        max_logits_per_head(q, k, cfg.head_dim ** -0.5, is_causal=True)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        max_logits_per_head(q, k, cfg.head_dim ** -0.5, is_causal=True)
    sync(device)
    return (time.perf_counter() - t) / reps * cfg.n_layers


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
    ap.add_argument("--out", default=None, help="also write the results as JSON")
    args = ap.parse_args()

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
            if b > 0 or not args.warmup:
                times[record].append(t2 - t0)
                fwd_bwd[record].append(t1 - t0)
                if device.type == "cuda":
                    peak[record] = max(peak[record], torch.cuda.max_memory_allocated(device))
    res = {k: dict(step_s=statistics.median(times[k]), fwd_bwd_s=statistics.median(fwd_bwd[k]),
                   peak_gib=peak[k] / 2**30) for k in (False, True)}
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    micro = micro_cost(cfg, args.micro_batch, args.seq_len, device, dtype) if args.micro else None
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
        if micro is not None:
            print(f"max_logits_per_head alone: {micro * 1e3:.2f} ms per step ({cfg.n_layers} layers) = "
                  f"{micro / off['step_s']:.2%} of the step without recording")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(args=vars(args), off=off, on=on, micro_s=micro), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
