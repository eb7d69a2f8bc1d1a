"""DeepSpeed-Ulysses sequence parallelism under ds_muon: W=4 = SP 2 x DP 2, against the oracle.

The real thing, on CPU/gloo: DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` wraps transformers'
``"sdpa"`` attention of a tiny ``LlamaForCausalLM`` (4 query heads, 2 key/value heads) and returns its mpu
(``deepspeed.runtime.sequence_parallel.parallel_state_sp``: SP groups {0,1}, {2,3}; sequence-data-parallel group
{0,1,2,3}); the engine gets ``mpu=``. Each data-parallel replica (``rank // 2``) draws its own sequences; each SP rank
feeds its contiguous half of the sequence (``position_ids`` global, labels shifted on the full sequence before
sharding, as ``UlyssesSPDataLoaderAdapter`` does) and combines the loss as DeepSpeed's tutorial does (:func:`train`).
The oracle (``ds_muon.MuonAdamW`` / ``ds_muon.AdamMini`` on the whole model, one process, plain SDPA on full
sequences) averages the sequence-mean loss over the 2 replicas and 2 micro-batches, times the factor by which
DeepSpeed's own gradient reduction differs from that mean (:func:`deepspeed_grad_scale`: 1 for ZeRO-3's
reduce-scatter, ``SP`` for its all-reduce paths; the norms, compared to 1e-5, tell the two apart). GAS 2, gradient
clipping on (asserted active), fp32; ZeRO-3 Muon (reduce-scatter), ZeRO-2 Muon, ZeRO-3 Adam-mini (all-reduce);
1e-5 relative per parameter, 1e-3 of its update (measured <= 2.7e-6). docs/parallelism.md.

Broken by hand to see it fail: Adam-mini's block sums all-reduced over the SP group instead of the partition group
(rel error 0.13), the owner exchange over the SP group (the plan check raises: W=4 plan, W=2 group). The same process
group checks the refusals: an mpu with tensor parallelism 2, and QK-clip with SP.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from ds_muon.names import ADAM_MINI as ADAM_MINI_ALGORITHM
from tests.support.harness import PARITY_RTOL, clone_tags, compare, gathered_params
from tests.support.spawn import run_distributed

transformers = pytest.importorskip("transformers")

SP, STEPS, GAS, CLIP, MICRO, SEQ, VOCAB = 2, 3, 2, 0.5, 2, 16, 64
MUON = {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.05, "ns_dtype": "float32",
        "exchange_dtype": "float32"}
ADAM_MINI = {"lr": 3e-3, "weight_decay": 0.05}


def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def sample(step: int, replica: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s micro-batch: tokens ``(MICRO, SEQ)`` int64 and next-token labels (-100 at the end)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + micro)
    tokens = torch.randint(3, VOCAB, (MICRO, SEQ), generator=g)
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    return tokens, labels


def token_loss(logits: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Sum of the cross-entropy of ``labels`` (-100 ignored) over ``n_tokens``."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum") / n_tokens


N_TOKENS = MICRO * (SEQ - 1)  # labelled tokens of one whole micro-batch


def ds_config(stage: int, optimizer: str) -> dict:
    params = MUON if optimizer == "Muon" else ADAM_MINI
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": optimizer, "params": dict(params)},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10_000, "wall_clock_breakdown": False}


@contextlib.contextmanager
def plain_sdpa(original):
    """transformers' own SDPA under ``"sdpa"`` for the oracle (Ulysses' wrapper replaced it in this process)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    wrapped = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapped


def oracle(init, tags, optimizer: str, original_sdpa, grad_scale: int):
    """The whole model on one process: every replica's micro-batches, full sequences, plain SDPA; the mean
    gradient times ``grad_scale`` (:func:`deepspeed_grad_scale`)."""
    import ds_muon
    ref = llama()
    for n, p in ref.named_parameters():
        p.data.copy_(init[n])
        p.use_muon = tags[n]
    opt = ds_muon.MuonAdamW(ref, **MUON) if optimizer == "Muon" else ds_muon.AdamMini(ref, **ADAM_MINI)
    replicas = 4 // SP
    norms = []
    with plain_sdpa(original_sdpa):
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            for replica in range(replicas):
                for micro in range(GAS):
                    tokens, labels = sample(step, replica, micro)
                    loss = token_loss(ref(input_ids=tokens).logits, labels, N_TOKENS)
                    (loss * grad_scale / (replicas * GAS)).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), CLIP)))
            opt.step()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}, norms


def train(engine, rank: int, sp_group) -> list[float]:
    """DeepSpeed's recipe (its Ulysses/ALST tutorial's weighted loss aggregation): each SP rank computes its tokens'
    share of the loss, a differentiable collective over the SP group combines the shares into the whole sequence's
    mean loss on every SP rank, and every SP rank runs backward on it. The collective is the weighted all-reduce
    DeepSpeed's engine warning recommends (``torch.distributed.nn.functional.all_reduce``): the tutorial's
    ``all_gather`` fails in backward on gloo subgroups (torch 2.13 emulates its reduce-scatter with a scatter from
    global rank 0: "Global rank 0 is not part of group"). Both backpropagate the same gradient."""
    from torch.distributed.nn.functional import all_reduce
    replica, sp_rank, chunk = rank // SP, rank % SP, SEQ // SP
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    norms = []
    for step in range(STEPS):
        for micro in range(GAS):
            tokens, labels = sample(step, replica, micro)
            part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
            logits = engine(input_ids=tokens[:, part], position_ids=positions[:, part]).logits
            loss = all_reduce(token_loss(logits, labels[:, part], N_TOKENS), group=sp_group)
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return norms


def deepspeed_grad_scale(stage: int, reduce_scatter: bool) -> int:
    """The gradient DeepSpeed 0.19.8 hands the optimizer under this recipe, over the oracle's (the mean over
    replicas and micro-batches of the sequence-mean loss's gradient). Each SP rank backpropagates the whole loss,
    so the SP ranks' gradients add up to ``SP`` times it; ZeRO-3's reduce-scatter divides the sum over the
    sequence-data-parallel group by its size (``reduce_scatter_coalesced``), every all-reduce path (ZeRO-1/2,
    ZeRO-3 with ``reduce_scatter: false``) by ``size / sequence_parallel_size``."""
    return 1 if stage == 3 and reduce_scatter else SP


def _case(rank: int, mpu, original_sdpa, stage: int, optimizer: str, reduce_scatter: bool) -> dict:
    import ds_muon
    model = llama()
    cfg = ds_config(stage, optimizer)
    cfg["zero_optimization"]["reduce_scatter"] = reduce_scatter
    engine, _, _, _ = ds_muon.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
    opt = engine.optimizer
    out = {"type": type(opt).__name__, "sp": engine.sequence_parallel_size, "seq_dp": engine.seq_dp_world_size}
    if optimizer == "AdamMini":  # parameters in ZeRO-3 sub-groups that step Adam-mini (not the AdamW rest)
        out["adam_mini"] = sum(len(ps) for i, ps in enumerate(opt.fp16_groups)
                               if opt.sub_group_algorithm(i) == ADAM_MINI_ALGORITHM)
    init = gathered_params(model)
    tags = clone_tags(model)
    out["norms"] = train(engine, rank, mpu.get_sequence_parallel_group())
    got = gathered_params(model)
    engine.destroy()
    if rank == 0:
        scale = deepspeed_grad_scale(stage, reduce_scatter)
        want, out["ref_norms"] = oracle(init, tags, optimizer, original_sdpa, scale)
        out["errors"] = compare(got, want, init)
        out["muon"] = sum(tags.values())  # parameters selection put on Muon (none under Adam-mini: it has no Muon)
    return out


class _TensorParallel2:
    """A Megatron-style mpu with tensor-parallel world size 2 (ranks {0,1}, {2,3}) and data parallel 2."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self._tp, _ = dist.new_subgroups(group_size=2)
        self._dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][dist.get_rank() % 2]

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank() % 2

    def get_model_parallel_group(self):
        return self._tp

    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return 2

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank() // 2


def _refusals(mpu) -> dict:
    import ds_muon
    from ds_muon.integration.parallelism import mpu_problem
    out = {"tp_mpu": mpu_problem(_TensorParallel2())}
    cfg = ds_config(3, "Muon")
    cfg["optimizer"]["params"]["qk_clip"] = {"enabled": True}
    model = llama()
    try:
        ds_muon.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
        out["qk_clip"] = "accepted"
    except ds_muon.ConfigError as exc:
        out["qk_clip"] = str(exc)
    return out


def sp_worker(rank: int, world_size: int, cases: list[tuple[int, str, bool]]) -> dict:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=llama(), core_attn_implementation="sdpa", sequence_parallel_size=SP,
        micro_batch_size=MICRO, seq_length=SEQ, seq_length_is_variable=False)
    out = {"groups": (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_data_parallel_world_size())}
    out["cases"] = [_case(rank, mpu, original, *case) for case in cases]
    out.update(_refusals(mpu))
    return out


#: (stage, optimizer, reduce_scatter): both of DeepSpeed's gradient scales (deepspeed_grad_scale) at stage 3
CASES = [(3, "Muon", True), (2, "Muon", True), (3, "AdamMini", False)]


def test_ulysses_sp2_dp2_matches_the_oracle() -> None:
    results = run_distributed(sp_worker, 4, CASES)
    res = results[0]
    assert res["groups"] == (2, 4)
    for k, (stage, optimizer, reduce_scatter) in enumerate(CASES):
        name, case = f"stage {stage} {optimizer} reduce_scatter={reduce_scatter}", res["cases"][k]
        want_type = {3: "MuonZeroOptimizer", 2: "MuonZero12Optimizer"}[stage]
        assert case["type"] == want_type, (name, case["type"])
        assert (case["sp"], case["seq_dp"]) == (2, 4), name
        for other in results:  # every rank reports the same global norm
            assert other["cases"][k]["norms"] == case["norms"], name
        torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(case["ref_norms"]), rtol=1e-5, atol=0)
        assert max(case["ref_norms"]) > CLIP, f"{name}: clipping was never active"
        assert len(case["errors"]) == 21, (name, len(case["errors"]))  # every parameter compared
        # the case's own algorithm holds at least q/k/v/o, gate/up/down of 2 layers (Adam-mini tags no Muon)
        assert case["muon" if optimizer == "Muon" else "adam_mini"] >= 14, (name, case["muon"], case.get("adam_mini"))
        for n, err in case["errors"].items():
            assert err["rel"] <= PARITY_RTOL, f"{name}: {n} rel error {err['rel']:.2e}"
            if err["moved"] > 0:
                assert err["rel_update"] <= 1e-3, f"{name}: {n} update rel error {err['rel_update']:.2e}"
    assert "tensor-parallel world size 2" in res["tp_mpu"] and "sequence parallelism only" in res["tp_mpu"], res
    assert "qk_clip.enabled" in res["qk_clip"] and "sequence-parallel world size 2" in res["qk_clip"], res
