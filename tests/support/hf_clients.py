"""Real-client jobs for tests/e2e/test_clients.py, run under ``torchrun`` (CPU, gloo) like a user's script.

    torchrun --standalone --nproc_per_node 2 tests/support/hf_clients.py MODE --out DIR [options]

MODE is ``trainer`` (HF Trainer on a tiny Llama), ``peft`` (the same with a PEFT LoRA adapter),
``accelerate`` (Accelerate's native DeepSpeed path with ``DummyOptim``/``DummyScheduler``) or ``trl``
(TRL's ``SFTTrainer``). Every mode calls ``ds_muon.enable()`` and writes ``DIR/result.json`` on
rank 0: the optimizer class, Muon step count, per-step losses and the trainable parameters' fp32
master weights (``DIR/params.pt``, gathered from the ZeRO-3 partitions); Trainer modes also the
input_ids every rank trained on (``DIR/batches.pt``). ``--optimizer adam_mini`` runs Trainer with
``"optimizer": {"type": "AdamMini"}``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ds_muon

VOCAB, SEQ = 128, 16


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        use_cache=False))


class Tokens(torch.utils.data.Dataset):
    """32 fixed random sequences; labels = input_ids."""

    x = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


# AdamMini's params as TrainingArguments(learning_rate=3e-3, weight_decay=0.1) and its default betas/eps
# give them (Trainer refuses a DeepSpeed config whose optimizer params contradict its arguments).
ADAM_MINI = {"type": "AdamMini", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}


def ds_config(load_universal: bool = False, adam_mini: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto",
           "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95,
                                                    "weight_decay": 0.0, "ns_dtype": "float32",
                                                    "exchange_dtype": "float32"}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if adam_mini:
        cfg["optimizer"] = json.loads(json.dumps(ADAM_MINI))
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def master_params(model) -> dict[str, torch.Tensor]:
    """Trainable parameters' fp32 master weights, full shape (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().float().cpu().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def write(out: str, rank: int, opt, params: dict, **extra) -> None:
    if rank != 0:
        return
    os.makedirs(out, exist_ok=True)
    torch.save(params, os.path.join(out, "params.pt"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"optimizer": type(opt).__name__, "muon_step_count": getattr(opt, "muon_step_count", None),
                   **extra}, f)


def run_trainer(args, peft: bool) -> None:
    from transformers import Trainer, TrainingArguments
    model = tiny_llama()
    adam_mini = args.optimizer == "adam_mini"
    seen: list[torch.Tensor] = []  # each micro-batch's input_ids on this rank, for the AdamMini reference
    model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].detach().cpu().clone()),
                                    with_kwargs=True)
    if peft:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.batch,
                              learning_rate=3e-3 if adam_mini else 0.02, weight_decay=0.1 if adam_mini else 0.0,
                              max_steps=args.steps, logging_steps=1,
                              deepspeed=ds_config(args.load_universal, adam_mini),
                              use_cpu=True, report_to=[], save_strategy="steps", save_steps=args.save_steps,
                              log_level="info", seed=0, data_seed=0, lr_scheduler_type="constant",
                              gradient_checkpointing=args.gradient_checkpointing)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=args.resume)
    engine = trainer.model_wrapped
    params = master_params(trainer.model)
    batches = [None] * trainer.args.world_size
    torch.distributed.all_gather_object(batches, seen)
    if trainer.args.process_index == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(batches, os.path.join(args.out, "batches.pt"))  # [rank][micro-batch] -> (batch, SEQ) int64
    write(args.out, trainer.args.process_index, engine.optimizer, params,
          adam_mini_sub_groups=len(getattr(engine.optimizer, "adam_mini_maps", {})),
          losses={h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
          frozen=sorted(n for n, p in trainer.model.named_parameters() if not p.requires_grad),
          muon=sorted(n for n, p in trainer.model.named_parameters()
                      if p.requires_grad and getattr(p, "use_muon", False)))


def run_accelerate(args) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
    cfg = ds_config()
    cfg.update(train_micro_batch_size_per_gpu=args.batch, gradient_accumulation_steps=1, gradient_clipping=1.0)
    # A scheduler that scales each param group's own lr (Muon's and AdamW's differ).
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps, "warmup_num_steps": 1}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = tiny_llama()
    optimizer = DummyOptim(model.parameters())
    scheduler = DummyScheduler(optimizer)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=args.batch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = {}
    for step, batch in enumerate(loader, 1):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if step == args.steps:
            break
    engine = model
    write(args.out, accelerator.process_index, engine.optimizer, master_params(engine.module), losses=losses,
          lrs=[g["lr"] for g in engine.optimizer.param_groups])


def run_trl(args) -> None:
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer
    words = [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "<eos>"] + words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(words[j] for j in torch.randint(0, len(words), (SEQ - 2,), generator=gen)) for _ in range(32)]
    sft = SFTConfig(output_dir=args.out, per_device_train_batch_size=args.batch, learning_rate=0.02,
                    max_steps=args.steps, logging_steps=1, deepspeed=ds_config(), use_cpu=True, report_to=[],
                    save_strategy="no", max_length=SEQ, seed=0, lr_scheduler_type="constant")
    trainer = SFTTrainer(model=tiny_llama(), args=sft, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer)
    trainer.train()
    write(args.out, trainer.args.process_index, trainer.model_wrapped.optimizer, master_params(trainer.model),
          losses={h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["trainer", "peft", "accelerate", "trl"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2, help="per-process micro-batch")
    ap.add_argument("--save-steps", type=int, default=2)
    ap.add_argument("--resume", default=None, help="checkpoint folder to resume from (Trainer modes)")
    ap.add_argument("--load-universal", action="store_true")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--optimizer", choices=["muon", "adam_mini"], default="muon",
                    help="the DeepSpeed config's optimizer (Trainer modes): Muon, or AdamMini (ADAM_MINI)")
    args = ap.parse_args()
    ds_muon.enable()
    if args.mode in ("trainer", "peft"):
        run_trainer(args, peft=args.mode == "peft")
    elif args.mode == "accelerate":
        run_accelerate(args)
    else:
        run_trl(args)
    # A clean teardown: a rank that leaves while another is still writing can abort in gloo's destructors at
    # interpreter exit ("terminate called without an active exception", SIGABRT; seen once in CI).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
