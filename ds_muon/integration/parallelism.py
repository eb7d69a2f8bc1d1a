"""Which model-parallel layouts ds_muon serves: the ``mpu`` an engine is given (layer ``integration``).

DeepSpeed 0.19.8 (``deepspeed/utils/groups.py``, ``runtime/engine.py``) treats an ``mpu`` that has
``initialize_sequence_parallel`` (the module ``deepspeed.runtime.sequence_parallel.parallel_state_sp``, which
``UlyssesSPAttentionHF.register_with_transformers`` returns) as sequence parallelism only: its
``get_model_parallel_*`` functions are aliases of the sequence-parallel ones, and DeepSpeed then counts the
model-parallel world size as 1. With such an mpu (or any other whose tensor- and pipeline-parallel sizes are 1)
the engine hands its ZeRO optimizer ``dp_process_group = mpu.get_sequence_data_parallel_group()`` (the
sequence-data-parallel group: every rank that holds a copy of the weights), ZeRO partitions over that group,
and DeepSpeed reduces each gradient over it divided by ``world_size(group) / sequence_parallel_size`` (the
sequence-parallel ranks of one sample add their partial gradients, the data-parallel replicas average). ds_muon's
owner exchange, no-gradient flags, Adam-mini block sums and QK-clip maxima run over the same group (the sub-group's
partition group at ZeRO-3, ``real_dp_process_group`` at ZeRO-1/2), so nothing changes for them: docs/parallelism.md.

Not served: an mpu with tensor or pipeline parallelism (Muon orthogonalizes whole matrices, not tensor-parallel
slices), and QK-clip with sequence parallelism > 1 (Ulysses' attention sees ``num_heads / sp`` heads on each rank,
so the per-head max logits it records are not the module's heads).
"""
from __future__ import annotations

from typing import Any, Optional

#: the fix named when an mpu brings tensor or pipeline parallelism
MPU_FIX = ("ds_muon serves an mpu that provides sequence parallelism only (DeepSpeed-Ulysses: "
           "deepspeed.runtime.sequence_parallel.parallel_state_sp, as UlyssesSPAttentionHF.register_with_transformers "
           "returns it; or any mpu whose tensor- and pipeline-parallel world sizes are 1); run tensor/pipeline "
           "parallelism with DeepSpeed's built-in Muon (DS_MUON=0), or drop it")


def is_sequence_parallel_mpu(mpu: Any) -> bool:
    """DeepSpeed's own test for a sequence-parallel-only mpu (``deepspeed.utils.groups._get_model_parallel_world_size``
    and the ZeRO optimizers: ``hasattr(mpu, 'initialize_sequence_parallel')``)."""
    return hasattr(mpu, "initialize_sequence_parallel")


def mpu_sizes(mpu: Any) -> tuple[int, int]:
    """``(tensor-parallel, pipeline-parallel)`` world sizes of ``mpu``, read as DeepSpeed reads them
    (``deepspeed.utils.bwc``); ``(1, 1)`` for a sequence-parallel-only mpu (whose model-parallel functions are
    the sequence-parallel ones)."""
    if mpu is None or is_sequence_parallel_mpu(mpu):
        return 1, 1
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_world_size
    return int(bwc_tensor_model_parallel_world_size(mpu)), int(bwc_pipeline_parallel_world_size(mpu))


def mpu_problem(mpu: Any) -> Optional[str]:
    """Why ds_muon cannot serve an engine given ``mpu``, naming the sizes and the fix; None when it can (no mpu,
    or sequence parallelism only)."""
    if mpu is None:
        return None
    tp, pp = mpu_sizes(mpu)
    if tp == 1 and pp == 1:
        return None
    return (f"ds_muon does not support this mpu's model parallelism (tensor-parallel world size {tp}, "
            f"pipeline-parallel world size {pp}): Muon must orthogonalize whole matrices, not tensor-parallel "
            f"slices, and ds_muon does not partition over pipeline stages. {MPU_FIX}")


def sequence_parallel_size() -> int:
    """DeepSpeed's sequence-parallel world size (``deepspeed.utils.groups``; 1 without an SP mpu, or before
    ``torch.distributed`` is initialized, where DeepSpeed's getter asserts)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return 1
    from deepspeed.utils import groups
    return int(groups._get_sequence_parallel_world_size())


def qk_clip_sp_problem(qk_clip_enabled: bool, sp: int) -> Optional[str]:
    """QK-clip with sequence parallelism ``sp`` > 1: refused, naming the key and the reason."""
    if not qk_clip_enabled or sp <= 1:
        return None
    return (f"optimizer.params.qk_clip.enabled: true is not supported with sequence parallelism (sequence-parallel "
            f"world size {sp}): DeepSpeed-Ulysses' attention computes num_heads/{sp} heads on each rank, so the "
            "per-head max logits an attention module records there are not that module's heads; disable qk_clip or "
            "sequence parallelism")
