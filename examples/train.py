"""Train a small Llama-like byte-level LM with DeepSpeed ZeRO-3 and ds_muon.

CPU (2 processes, gloo; DeepSpeed picks its CPU accelerator by itself when there is no GPU):
    deepspeed --num_gpus 2 examples/train.py                        # tiny model, examples/ds_config_cpu.json
    deepspeed --num_gpus 2 examples/train.py --model moe            # small MoE: 8 stacked experts per layer, router
GPUs:
    deepspeed --num_gpus 8 examples/train.py --model small --deepspeed_config examples/ds_config_gpu_bf16.json
Or simply ``scripts/train.sh [args...]`` (creates .venv, installs, launches with NPROC=2 processes).

The corpus is the Python standard library's own sources (or ``--data FILE``), byte-level (vocab 256).
Prints train loss / tokens/s / grad norm / lr (tqdm's bar on a terminal; in a log, a line every ``--log-every``
steps), periodic validation loss, and saves a DeepSpeed checkpoint to ``--save-dir`` at the end (and every
``--save-every`` steps).

Resuming: ``--resume`` continues from the latest checkpoint in ``--save-dir`` (``--resume DIR``: in DIR) up to
``--steps`` in all: weights, optimizer state, lr schedule, step count and the data sampler's position. A
checkpoint saved at another number of processes is first converted to a universal one (``DIR/universal/``,
by ``ds_muon.checkpoint.convert_to_universal``) and loaded through it. The data come in ``--data-streams``
sample streams (default: the number of processes of the first run, kept by every resume): each process
draws its share of them and the gradient accumulation grows to match, so a resume at another number of
processes keeps the global batch and the samples of every step. ``--metrics FILE`` appends one JSON line per
step (train loss, lrs, grad norm, the step's max attention logit, resident memory) and per validation, so a
resumed run's curve continues the file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Optional

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import DEFAULT_MAX_BYTES, ByteCorpus  # noqa: E402
from model import PRESETS, CausalLM, ModelConfig, count_params  # noqa: E402

import ds_muon  # noqa: E402
from ds_muon.checkpoint import LATEST, convert_to_universal, saved_model_states  # noqa: E402
from ds_muon.config import parse_muon_params  # noqa: E402
from ds_muon.model.max_logits import RECORDER  # noqa: E402
from ds_muon.model.selection import SelectionRules, select_muon_params  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "ds_config_cpu.json")
# torch 2.13 deprecates the collective names DeepSpeed 0.19.8 calls; the notice is DeepSpeed's to act on, not the user's
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (tiny, 2 idle CPU processes: ~3 min)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocab (>= 256 for bytes)")
    p.add_argument("--tie-embeddings", action="store_true", help="tie lm_head to the token embedding")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the preset's max_seq_len)")
    p.add_argument("--data", default=None, help="a text file; default: the Python stdlib's .py sources")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size cap in bytes")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N steps (0: only at start/end)")
    p.add_argument("--eval-batches", type=int, default=8, help="micro-batches per rank per validation (so the validation set grows with the number of processes)")
    p.add_argument("--save-dir", default="checkpoints/", help="DeepSpeed checkpoint directory ('' to skip)")
    p.add_argument("--save-every", type=int, default=0, help="also save a checkpoint every N steps (0: at the end)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                   help="continue from the latest checkpoint in DIR (default: --save-dir), at this or another "
                        "number of processes; --steps counts from the start of the first run")
    p.add_argument("--metrics", default=None, metavar="FILE",
                   help="append per-step JSON lines (step, loss, lr, grad_norm, max_logit, rss_mib, peak_rss_mib; "
                        "val_loss at validations) to FILE")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-streams", type=int, default=None, metavar="N",
                   help="sample streams of the global batch (default: the number of processes, or the resumed run's "
                        "value): stream s draws micro-batches seeded with seed + s; W processes draw N/W streams "
                        "each, with gradient_accumulation_steps multiplied by N/W (N must be a multiple of W), so "
                        "the global batch and the samples of each step do not depend on W")
    p.add_argument("--adamw", action="store_true",
                   help="baseline: replace the config's optimizer by AdamW (lr = the config's adam_lr)")
    p.add_argument("--adam-mini", nargs="?", const="default", default=None, choices=("default", "neuron"),
                   metavar="BLOCK_RULE", help="replace the config's optimizer by ds_muon's AdamMini with this block_rule "
                                              "(default: 'default'); lr = the config's adam_lr, as --adamw")
    p.add_argument("--zero-init", action="store_true", help="build the model under deepspeed.zero.Init")
    p.add_argument("--log-json", default=None, help="write the loss curves (per step, with tokens seen) to this "
                                                   "JSON file on rank 0, for scripts/plot_results.py")
    p.add_argument("--log-every", type=int, default=0, metavar="N",
                   help="when stderr is not a terminal (a log file, a pipe), print a progress line every N steps "
                        "and at the last one instead of tqdm's bar (default 0: every 50 steps or every 10%% of the "
                        "run, whichever is fewer steps)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def load_config(args: argparse.Namespace) -> dict:
    with open(args.deepspeed_config or DEFAULT_CONFIG) as f:
        config = json.load(f)
    if args.adamw or args.adam_mini:
        params = config.get("optimizer", {}).get("params", {})
        config["optimizer"] = {"type": "AdamMini" if args.adam_mini else "AdamW",
                               "params": {"lr": params.get("adam_lr", 3e-3), "weight_decay": params.get("weight_decay", 0.0)}}
        if args.adam_mini:
            config["optimizer"]["params"]["block_rule"] = args.adam_mini
    config.pop("train_batch_size", None)            # derived from micro batch x accumulation x world size
    return config


def prepare_resume(args: argparse.Namespace, config: dict, world: int) -> Optional[tuple[str, str]]:
    """``(load_dir, tag)`` of the checkpoint to resume from, or None when ``--resume``'s directory has none yet.

    The tag is the one in ``DIR/latest``. A checkpoint saved at another world size is converted (rank 0,
    once) to a universal checkpoint in ``DIR/universal`` and ``config`` gets ``checkpoint.load_universal``.
    Sets ``args.saved_data_streams``: the saved run's ``--data-streams`` (from the checkpoint's client state;
    its world size for checkpoints written before the option existed).

    Raises:
        FileNotFoundError: the directory does not exist (a mistyped path must not start a fresh run).
    """
    load_dir = args.resume or args.save_dir
    if not load_dir or not os.path.isdir(load_dir):
        raise FileNotFoundError(f"--resume: checkpoint directory {load_dir!r} does not exist")
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag = f.read().strip()
    states = saved_model_states(os.path.join(load_dir, tag)) or {}
    saved = states.get("dp_world_size")
    args.saved_data_streams = (states.get("args") or {}).get("data_streams") or saved
    if saved is None or saved == world:
        return load_dir, tag
    universal = os.path.join(load_dir, "universal")
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(universal, tag, "zero", "optimizer_state.pt")):
        convert_to_universal(load_dir, universal, tag)
    dist.barrier()                                   # every rank reads the converted files
    config.setdefault("checkpoint", {})["load_universal"] = True
    return universal, tag


def write_metrics(path: Optional[str], record: dict) -> None:
    """Append one JSON line to the ``--metrics`` file (rank 0 only calls this)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


class Progress:
    """The training loop's progress: tqdm's bar on a terminal, a plain line every few steps in a log.

    tqdm redraws its bar with a carriage return at most every 0.1 s; written to a file or a pipe (the DeepSpeed
    launcher's output collected by ``scripts/train.sh ... > log`` or by CI) each redraw is a new record, about one
    per step. With ``disable=None`` tqdm draws only when its stream (``file``, default ``sys.stderr``) is a
    terminal; otherwise this prints ``step N/T: loss ..., tok/s ..., ...`` every ``every`` steps and at the last
    step, through ``tqdm.write`` (``sys.stdout``), where the validation lines go too.

    Args:
        start: the first step of this run (a resumed run starts after the saved step).
        steps: the last step (``--steps``, counted from the first run's start).
        enabled: whether this process reports at all (rank 0 only).
        every: steps between two plain lines; 0: every 50 steps or every 10% of this run's steps, whichever is
            fewer (at least 1).
        file: the bar's stream (default ``sys.stderr``); its ``isatty()`` decides between bar and lines.
    """

    def __init__(self, start: int, steps: int, enabled: bool = True, every: int = 0, file=None) -> None:
        self.bar = tqdm(range(start, steps + 1), disable=None if enabled else True, file=file, dynamic_ncols=True,
                        desc="train", initial=start - 1, total=steps)
        self.lines = enabled and self.bar.disable   # tqdm turned itself off: not a terminal
        self.every = every if every > 0 else max(1, min(50, -(-(steps - start + 1) // 10)))
        self.steps, self.t0 = steps, time.perf_counter()

    def __iter__(self):
        return iter(self.bar)

    def update(self, step: int, stats: dict) -> None:
        """Show ``stats`` (name -> formatted value, in order) for ``step``: the bar's postfix or, in a log, a line."""
        self.bar.set_postfix(stats)
        if self.lines and (step % self.every == 0 or step == self.steps):
            elapsed = tqdm.format_interval(time.perf_counter() - self.t0)
            self.write(f"step {step}/{self.steps}: " + ", ".join(f"{k} {v}" for k, v in stats.items())
                       + f", elapsed {elapsed}")

    def write(self, line: str) -> None:
        """Print ``line`` without breaking the bar."""
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()


def check_data_streams(streams: Optional[int], world: int) -> None:
    """Raise ValueError unless ``streams`` (``--data-streams``) is None or a positive multiple of ``world``."""
    if streams is not None and (streams < 1 or streams % world):
        raise ValueError(f"--data-streams {streams} is not a positive multiple of the {world} processes: each "
                         "process draws the same number of sample streams")


def apply_data_streams(args: argparse.Namespace, config: dict, world: int, log) -> int:
    """Set ``args.data_streams`` and multiply the config's gradient accumulation by streams/world; returns the
    streams per process. Default: the resumed run's streams when they divide among ``world`` processes, else
    ``world`` (said in the log: the global batch then changes). An explicit ``--data-streams`` has been checked
    by :func:`check_data_streams` already (in :func:`main`, before a resume converts anything).
    """
    saved = getattr(args, "saved_data_streams", None)
    if args.data_streams is None:
        args.data_streams = saved if saved and saved % world == 0 else world
        if saved and saved != args.data_streams:
            log(f"the saved run's {saved} data streams do not divide among {world} processes: {world} streams "
                f"from here on (the global batch changes by {world}/{saved}; --data-streams sets it)")
    elif saved and saved != args.data_streams:
        log(f"--data-streams {args.data_streams} where the saved run had {saved}: the global batch changes by "
            f"{args.data_streams}/{saved}")
    per_process = args.data_streams // world
    config["gradient_accumulation_steps"] = int(config.get("gradient_accumulation_steps", 1)) * per_process
    return per_process


def step_batches(corpus: ByteCorpus, split: str, streams: list[int], micro_per_stream: int, batch_size: int,
                 seq_len: int, seed: int, device, skip_steps: int = 0):
    """Endless ``(input_ids, targets)`` micro-batches of this process, each ``(batch_size, seq_len)`` int64:
    per optimizer step, ``micro_per_stream`` consecutive ones from each stream of ``streams`` in the list's
    order (stream ``s`` is :meth:`ByteCorpus.batches` seeded ``seed + s``), after skipping ``skip_steps``
    steps' worth of each stream."""
    its = [corpus.batches(split, batch_size, seq_len, seed=seed + s, device=device,
                          skip=skip_steps * micro_per_stream) for s in streams]
    while True:
        for it in its:
            for _ in range(micro_per_stream):
                yield next(it)


def rss_mib(device: torch.device) -> tuple[float, float]:
    """``(resident, peak resident)`` memory in MiB, the largest over the ranks (all ranks call this).

    Linux only: both from the kernel's one account, ``/proc/self/status`` (``VmRSS``, ``VmHWM``, in KiB), so the
    peak is never below the current value."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    now, peak = fields["VmRSS"], max(fields["VmHWM"], fields["VmRSS"])
    values = torch.tensor([now, peak], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return float(values[0]), float(values[1])


def step_max_logit(attns: list, device: torch.device) -> float:
    """The step's largest pre-softmax attention logit over layers, heads and ranks (all ranks call this).

    Read (not taken) from ds_muon's max-logit recorder before the optimizer step, in which QK-clip takes it.
    """
    values = [v.max() for v in (RECORDER.peek(a) for a in attns) if v is not None]
    top = torch.stack(values).max() if values else torch.tensor(float("-inf"), device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top.item()


@torch.no_grad()
def evaluate(engine, corpus: ByteCorpus, args, streams: list[int], batch_size: int, seq_len: int) -> float:
    """Mean validation loss over ``eval_batches`` fixed micro-batches per data stream, averaged over the
    ``args.data_streams`` streams (this process evaluates ``streams``)."""
    engine.eval()
    total = torch.zeros((), device=engine.device)
    for s in streams:
        batches = corpus.batches("val", batch_size, seq_len, seed=10_000 + args.seed + s, device=engine.device)
        for _ in range(args.eval_batches):
            x, y = next(batches)
            total += engine(x, y).float()
    dist.all_reduce(total)
    engine.train()
    return total.item() / (args.eval_batches * args.data_streams)


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
    check_data_streams(args.data_streams, world)     # before a resume converts anything
    resume = prepare_resume(args, config, world) if args.resume is not None else None
    per_process = apply_data_streams(args, config, world, log)
    streams = list(range(rank * per_process, (rank + 1) * per_process))  # this process's sample streams

    # per-head max logits (examples/model.py, ds_muon.model.max_logits): needed by QK-clip and logged by --metrics;
    # otherwise off (measured cost on one H200, 934M model: +10% step time; docs/qk_clip.md)
    qk_clip = (config.get("optimizer", {}).get("params", {}).get("qk_clip") or {}).get("enabled", False)
    cfg = ModelConfig.preset(args.model, tie_embeddings=args.tie_embeddings, record_max_logits=bool(qk_clip or args.metrics),
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
    log(f"optimizer: ds_muon's {type(engine.optimizer).__name__} (ZeRO stage {engine.zero_optimization_stage()}, "
        f"built by ds_muon.initialize) for \"type\": \"{config['optimizer']['type']}\"")
    start = 1
    if resume is not None:
        _, client = engine.load_checkpoint(*resume)
        start = int(client["step"]) + 1
        if start > args.steps:
            log(f"resumed from {os.path.join(*resume)} (saved at step {start - 1}): nothing to train, --steps is "
                f"{args.steps}; pass --steps N with N > {start - 1} to train further")
        else:
            log(f"resumed from {os.path.join(*resume)} (saved at step {start - 1}); continuing to step {args.steps}")
    elif args.resume is not None:
        log(f"--resume: no checkpoint in {args.resume or args.save_dir} yet; starting from step 1")
    save = (lambda step: engine.save_checkpoint(args.save_dir, client_state={"args": vars(args), "step": step}))

    if config["optimizer"]["type"].lower() == "muon":  # which parameters Muon trains, and as which matrices
        opt = parse_muon_params(config["optimizer"].get("params"))
        log(select_muon_params(model, SelectionRules.from_params(opt)).summary())
    muon = [p for p in model.parameters() if getattr(p, "use_muon", False)]
    other = [p for p in model.parameters() if not getattr(p, "use_muon", False)]
    log(f"model {args.model}: {count_params(model.parameters()):,} params | world {world} | data streams "
        f"{args.data_streams} ({per_process} per process) | device {engine.device}")
    log(f"optimizer {config['optimizer']['type']}: Muon {len(muon)} tensors / {count_params(muon):,} elements, "
        f"AdamW {len(other)} tensors / {count_params(other):,} elements")

    corpus = ByteCorpus(args.data, max_bytes=args.max_bytes)
    log(corpus)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = mbs * gas * world * seq_len
    train_batches = step_batches(corpus, "train", streams, gas // per_process, mbs, seq_len, args.seed,
                                 engine.device, skip_steps=start - 1)
    metrics = args.metrics if rank == 0 else None
    attns = [layer.attn for layer in model.layers if layer.attn.record_max_logits]  # per-head max logits (MuonClip)
    max_logit = None

    val_losses = [(start - 1, evaluate(engine, corpus, args, streams, mbs, seq_len))]
    log(f"step {start - 1}: val loss {val_losses[-1][1]:.4f}")
    write_metrics(metrics, {"step": start - 1, "val_loss": val_losses[-1][1]})
    train_losses, train_time = [], 0.0
    bar = Progress(start, args.steps, enabled=rank == 0, every=args.log_every)
    for step in bar:
        t0 = time.perf_counter()
        step_loss = torch.zeros((), device=engine.device)
        for micro in range(gas):
            x, y = next(train_batches)
            loss = engine(x, y)
            engine.backward(loss)
            if args.metrics and attns and micro == gas - 1:
                max_logit = step_max_logit(attns, engine.device)
            engine.step()                            # optimizer steps at the accumulation boundary only
            step_loss += loss.detach().float() / gas
        for a in attns:                              # the next step records afresh (QK-clip took them if enabled)
            RECORDER.take(a)
        dist.all_reduce(step_loss)
        train_losses.append(step_loss.item() / world)
        if step > start:                             # leave out the first (warm-up) step
            train_time += time.perf_counter() - t0
        grad_norm = engine.get_global_grad_norm()
        lrs = sorted(set(engine.get_lr()), reverse=True)
        record = {"step": step, "loss": train_losses[-1], "lr": lrs,
                  "grad_norm": None if grad_norm is None else float(grad_norm), "max_logit": max_logit}
        if args.metrics:                         # resident / peak resident memory, the largest over the ranks
            record["rss_mib"], record["peak_rss_mib"] = rss_mib(engine.device)
        write_metrics(metrics, record)
        bar.update(step, {"loss": f"{train_losses[-1]:.3f}",           # a dict keeps this order
                          "tok/s": f"{tokens_per_step * (step - start) / train_time:,.0f}" if train_time else "-",
                          "gnorm": f"{float(grad_norm):.3f}" if grad_norm is not None else "-",
                          "lr": "/".join(f"{lr:.3g}" for lr in lrs)})
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            val_losses.append((step, evaluate(engine, corpus, args, streams, mbs, seq_len)))
            write_metrics(metrics, {"step": step, "val_loss": val_losses[-1][1]})
            if rank == 0:
                bar.write(f"step {step}: train loss {train_losses[-1]:.4f}, val loss {val_losses[-1][1]:.4f}")
        if args.save_dir and args.save_every and step % args.save_every == 0 and step != args.steps:
            save(step)
    bar.close()

    if train_losses:  # like with like: the mean of the first k steps of this run against the mean of its last k
        k = max(1, min(10, len(train_losses) // 2))
        first, last = sum(train_losses[:k]) / k, sum(train_losses[-k:]) / k
        log(f"train loss: {first:.4f} (mean of steps {start}-{start + k - 1}) -> {last:.4f} (mean of the last {k} "
            f"steps), relative drop {(first - last) / first:.1%}")
        log(f"val loss:   {val_losses[0][1]:.4f} -> {val_losses[-1][1]:.4f}, "
            f"relative drop {(val_losses[0][1] - val_losses[-1][1]) / val_losses[0][1]:.1%}")
    if train_time:
        n = len(train_losses) - 1
        log(f"throughput: {tokens_per_step * n / train_time:,.0f} tokens/s (global), {train_time / n:.3f} s/step")
    if args.log_json and rank == 0 and train_losses:
        with open(args.log_json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "optimizer": "AdamW" if args.adamw else "AdamMini" if args.adam_mini else "ds_muon",
                       "world_size": world,
                       "tokens_per_step": tokens_per_step, "steps": args.steps, "seed": args.seed,
                       "device": str(engine.device), "first_step": start, "train_loss": train_losses,
                       "val_loss": [list(v) for v in val_losses],
                       "tokens_per_s": tokens_per_step * (len(train_losses) - 1) / train_time if train_time else None,
                       "command": " ".join(sys.argv)}, f, indent=1)
    if args.save_dir and train_losses:
        save(args.steps)
        log(f"saved checkpoint to {os.path.abspath(args.save_dir)}")
    # every rank done, then the process group torn down while Python is fully alive: a gloo worker thread that
    # releases a collective's tensors after interpreter finalization began aborts the process (SIGABRT, "terminate
    # called without an active exception"; docs/troubleshooting.md). tests/e2e/test_clean_exit.py checks it
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
