"""A tiny transformers Llama for the AutoTP tests and measurements, its data, and reassembling its TP shards."""
from __future__ import annotations

import torch

MICRO, SEQ, VOCAB = 2, 8, 64
# The Muon matrices AutoTP splits in a Llama layer (q/k/v, gate/up by rows; o/down by columns).
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama():
    """``LlamaForCausalLM``: hidden 32, 4 heads of 8, 2 KV heads, MLP 48, 2 layers, vocab 64, untied head; seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def tokens(step: int, dp: int, micro: int) -> torch.Tensor:
    """``(MICRO, SEQ)`` int64 token ids of data-parallel rank ``dp`` (the same on its tensor-parallel ranks)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * dp + micro)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def full_params(model, tp: int) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master, gathered over the data-parallel group (``safe_get_full_fp32_param``) and then
    over the tensor-parallel group (AutoTP's split from the parameter's own metadata; even sizes). Collective."""
    import torch.distributed as dist
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.utils import groups, safe_get_full_fp32_param
    tp_group = groups.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        shard = safe_get_full_fp32_param(p).detach().float().cpu().clone()
        meta = getattr(p, DS_AUTOTP_UC_META, None) or {}
        if getattr(p, "tensor_model_parallel", False) and meta.get("partition_dim") is not None:
            parts = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(parts, shard, group=tp_group)
            shard = torch.cat(parts, dim=meta["partition_dim"])
        out[name] = shard
    return out
