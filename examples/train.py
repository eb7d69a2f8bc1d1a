"""Train a small Llama-like byte-level LM with DeepSpeed ZeRO-3 and ds_muon.

CPU (2 processes, gloo; DeepSpeed picks its CPU accelerator by itself when there is no GPU):
    deepspeed --num_gpus 2 examples/train.py                        # tiny model, examples/ds_config_cpu.json
GPUs:
    deepspeed --num_gpus 8 examples/train.py --model small --deepspeed_config examples/ds_config_gpu_bf16.json
Or simply ``scripts/train.sh [args...]`` (creates .venv, installs, launches with NPROC=2 processes).

The corpus is the Python standard library's own sources (or ``--data FILE``), byte-level (vocab 256).
Prints train loss / tokens/s / grad norm / lr, periodic validation loss, and saves a DeepSpeed checkpoint
to ``--save-dir`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import DEFAULT_MAX_BYTES, ByteCorpus  # noqa: E402
from model import PRESETS, CausalLM, ModelConfig, count_params  # noqa: E402

import ds_muon  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "ds_config_cpu.json")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (tiny, 2 CPU processes: ~2.5 min)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocab (>= 256 for bytes)")
    p.add_argument("--tie-embeddings", action="store_true", help="tie lm_head to the token embedding")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the preset's max_seq_len)")
    p.add_argument("--data", default=None, help="a text file; default: the Python stdlib's .py sources")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size cap in bytes")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N steps (0: only at start/end)")
    p.add_argument("--eval-batches", type=int, default=8, help="micro-batches per rank per validation")
    p.add_argument("--save-dir", default="checkpoints/", help="DeepSpeed checkpoint directory ('' to skip)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--adamw", action="store_true",
                   help="baseline: replace the config's optimizer by AdamW (lr = the config's adam_lr)")
    p.add_argument("--zero-init", action="store_true", help="build the model under deepspeed.zero.Init")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def load_config(args: argparse.Namespace) -> dict:
    with open(args.deepspeed_config or DEFAULT_CONFIG) as f:
        config = json.load(f)
    if args.adamw:
        params = config.get("optimizer", {}).get("params", {})
        config["optimizer"] = {"type": "AdamW", "params": {"lr": params.get("adam_lr", 3e-3),
                                                           "weight_decay": params.get("weight_decay", 0.0)}}
    config.pop("train_batch_size", None)            # derived from micro batch x accumulation x world size
    return config


@torch.no_grad()
def evaluate(engine, corpus: ByteCorpus, args, batch_size: int, seq_len: int) -> float:
    """Mean validation loss over ``eval_batches`` fixed micro-batches per rank, averaged across ranks."""
    engine.eval()
    rank = dist.get_rank()
    batches = corpus.batches("val", batch_size, seq_len, seed=10_000 + args.seed + rank, device=engine.device)
    total = torch.zeros((), device=engine.device)
    for _ in range(args.eval_batches):
        x, y = next(batches)
        total += engine(x, y).float()
    dist.all_reduce(total)
    engine.train()
    return total.item() / (args.eval_batches * dist.get_world_size())


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:                     # plain `python examples/train.py`: a single process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    config = load_config(args)

    cfg = ModelConfig.preset(args.model, tie_embeddings=args.tie_embeddings,
                             **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
    if cfg.vocab_size < 256:
        raise ValueError(f"vocab_size {cfg.vocab_size} < 256: byte-level data needs at least 256")
    seq_len = args.seq_len or cfg.max_seq_len
    cfg.max_seq_len = max(cfg.max_seq_len, seq_len)
    torch.manual_seed(args.seed)                     # identical initial weights on every rank
    if args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = CausalLM(cfg)
    else:
        model = CausalLM(cfg)

    engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=config)

    muon = [p for p in model.parameters() if getattr(p, "use_muon", False)]
    other = [p for p in model.parameters() if not getattr(p, "use_muon", False)]
    log(f"model {args.model}: {count_params(model.parameters()):,} params | world {world} | device {engine.device}")
    log(f"optimizer {config['optimizer']['type']}: Muon {len(muon)} tensors / {count_params(muon):,} elements, "
        f"AdamW {len(other)} tensors / {count_params(other):,} elements")

    corpus = ByteCorpus(args.data, max_bytes=args.max_bytes)
    log(corpus)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = mbs * gas * world * seq_len
    train_batches = corpus.batches("train", mbs, seq_len, seed=args.seed + rank, device=engine.device)

    val_losses = [(0, evaluate(engine, corpus, args, mbs, seq_len))]
    log(f"step 0: val loss {val_losses[-1][1]:.4f}")
    train_losses, train_time = [], 0.0
    bar = tqdm(range(1, args.steps + 1), disable=rank != 0, dynamic_ncols=True, desc="train")
    for step in bar:
        t0 = time.perf_counter()
        step_loss = torch.zeros((), device=engine.device)
        for _ in range(gas):
            x, y = next(train_batches)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()                            # optimizer steps at the accumulation boundary only
            step_loss += loss.detach().float() / gas
        dist.all_reduce(step_loss)
        train_losses.append(step_loss.item() / world)
        if step > 1:                                 # leave out the first (warm-up) step
            train_time += time.perf_counter() - t0
        grad_norm = engine.get_global_grad_norm()
        lrs = sorted(set(engine.get_lr()), reverse=True)
        bar.set_postfix({"loss": f"{train_losses[-1]:.3f}",           # a dict keeps this order
                         "tok/s": f"{tokens_per_step * (step - 1) / train_time:,.0f}" if train_time else "-",
                         "gnorm": f"{float(grad_norm):.3f}" if grad_norm is not None else "-",
                         "lr": "/".join(f"{lr:.3g}" for lr in lrs)})
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            val_losses.append((step, evaluate(engine, corpus, args, mbs, seq_len)))
            if rank == 0:
                bar.write(f"step {step}: train loss {train_losses[-1]:.4f}, val loss {val_losses[-1][1]:.4f}")
    bar.close()

    last = sum(train_losses[-10:]) / len(train_losses[-10:])
    log(f"train loss: first {train_losses[0]:.4f} -> last {last:.4f} (mean of the last {min(10, args.steps)} steps), "
        f"relative drop {(train_losses[0] - last) / train_losses[0]:.1%}")
    log(f"val loss:   {val_losses[0][1]:.4f} -> {val_losses[-1][1]:.4f}, "
        f"relative drop {(val_losses[0][1] - val_losses[-1][1]) / val_losses[0][1]:.1%}")
    if args.steps > 1:
        log(f"throughput: {tokens_per_step * (args.steps - 1) / train_time:,.0f} tokens/s (global), "
            f"{train_time / (args.steps - 1):.3f} s/step")
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"args": vars(args), "step": args.steps})
        log(f"saved checkpoint to {os.path.abspath(args.save_dir)}")
    dist.barrier()
    dist.destroy_process_group()                     # a clean teardown avoids aborts at interpreter exit


if __name__ == "__main__":
    main()
