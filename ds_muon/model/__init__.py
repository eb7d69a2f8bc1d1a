"""Reading an ``nn.Module`` (layer ``model``: torch, no torch.distributed).

Its structure (:mod:`~ds_muon.model.structure`: shapes, module kinds, configs, repeated layers, experts, head
geometry), output heads (:mod:`~ds_muon.model.output_heads`), which parameters Muon trains
(:mod:`~ds_muon.model.selection`) and how each is cut into matrices (:mod:`~ds_muon.model.views`), the param groups
(:mod:`~ds_muon.model.param_groups`), Adam-mini's blocks (:mod:`~ds_muon.model.adam_mini_blocks`), QK-clip's
targets (:mod:`~ds_muon.model.attention`) and the max-logit recorder (:mod:`~ds_muon.model.max_logits`,
:mod:`~ds_muon.model.hf_attention` for transformers' ``ds_muon_sdpa``).
"""
