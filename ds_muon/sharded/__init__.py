"""Plans and collectives on flat shards (layer ``sharded``: torch.distributed, no DeepSpeed).

The owner plan (:mod:`~ds_muon.sharded.ownership`), block maps (:mod:`~ds_muon.sharded.blocks`), the owner
exchange (:mod:`~ds_muon.sharded.exchange`), the per-sub-group steps (:mod:`~ds_muon.sharded.muon_step`,
:mod:`~ds_muon.sharded.adam_mini_step`), the no-gradient flags (:mod:`~ds_muon.sharded.no_grad`), QK-clip on
shards (:mod:`~ds_muon.sharded.qk_clip`) and collectives that name themselves (:mod:`~ds_muon.sharded.collectives`).
Each takes explicit inputs (a plan, tensors, a process group), so the DeepSpeed glue only says where the shards are.
"""
