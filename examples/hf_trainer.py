"""Hugging Face Trainer with ds_muon. Installed with pip, ds_muon needs no line here (a start-up hook
enables it); from a source checkout, ``ds_muon.enable()`` before building the Trainer does the same.

    torchrun --nproc_per_node 2 examples/hf_trainer.py [--steps 3]        # CPU (DeepSpeed picks gloo) or GPUs

Trainer (through Accelerate) calls ``deepspeed.initialize`` itself; ``ds_muon.enable()`` makes that
call build ds_muon's ZeRO-3 Muon for ``"optimizer": {"type": "Muon"}``. The model is a tiny
``LlamaForCausalLM`` built from a config (no download), trained for a few steps on counting sequences
(each token is the previous one plus 1, from a random start), which it learns at once: the loss falls.

Trainer cross-checks the DeepSpeed optimizer's ``lr`` against ``TrainingArguments.learning_rate``,
so they are set equal (the Muon lr); AdamW's lr comes from ``adam_lr``. Trainer's own linear
schedule scales every param group by the same factor, so the Muon/AdamW ratio is kept. The
reported ``grad_norm`` is the raw gradient norm (DeepSpeed's built-in Muon reports the norm of the
orthogonalized update instead). Prints one ``RESULT {json}`` line on rank 0.
"""
from __future__ import annotations

import argparse
import json
import warnings

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import ds_muon

# DeepSpeed 0.19.8's ZeRO calls torch.distributed.all_gather_into_tensor / reduce_scatter_tensor, which torch marks
# deprecated with a FutureWarning per call (14 lines in a 2-step run); they are DeepSpeed's calls, not ds_muon's.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


class CountingTokens(torch.utils.data.Dataset):
    """``n`` fixed sequences of ``seq`` token ids ``(start + t) % vocab``, random ``start``; labels = input_ids.
    Learnable (each token predicts the next), unlike uniform random tokens, whose loss cannot fall below
    ``ln(vocab)``."""

    def __init__(self, n: int = 64, seq: int = 32, vocab: int = 128) -> None:
        start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
        self.x = (start + torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--output-dir", default="runs/hf_trainer")
    args = ap.parse_args()

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3},
    }
    ds_muon.enable()
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    watched = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight")  # a Muon and an AdamW weight
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in watched}
    training_args = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=4, learning_rate=0.02,
                                      max_steps=args.steps, logging_steps=1, deepspeed=ds_config,
                                      use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no",
                                      log_level="info")  # shows ds_muon's parameter split
    trainer = Trainer(model=model, args=training_args, train_dataset=CountingTokens())
    trainer.train()
    opt = trainer.deepspeed.optimizer
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters([params[n] for n in watched]):  # ZeRO-3 partitions: gather to compare
        change = {n: ((params[n].detach().float() - before[n].float()).norm() / before[n].float().norm()).item()
                  for n in watched}
    if trainer.is_world_process_zero():
        print("RESULT " + json.dumps({
            "optimizer": type(opt).__name__,
            "muon_step_count": getattr(opt, "muon_step_count", None),
            "muon_params": sorted(n for n, p in model.named_parameters() if getattr(p, "use_muon", False)),
            "adamw_params": sorted(n for n, p in model.named_parameters() if not getattr(p, "use_muon", False)),
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "weight_change": change,  # ||w_after - w_before|| / ||w_before||
        }), flush=True)
    ds_muon.disable()
    if torch.distributed.is_initialized():  # a clean teardown (docs/troubleshooting.md, "terminate called ...")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
