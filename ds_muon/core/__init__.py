"""Single-device math (layer ``core``: imports torch only).

Newton–Schulz (:mod:`~ds_muon.core.newton_schulz`, its cost model :mod:`~ds_muon.core.ns_cost`, its compiled form
:mod:`~ds_muon.core.ns_compile`), matrix views (:mod:`~ds_muon.core.matrix`), Muon's momentum, scaled
orthogonalization and update (:mod:`~ds_muon.core.muon_update`), Adam's and Adam-mini's updates
(:mod:`~ds_muon.core.adam_update`; a shard's blocks as tiles: :mod:`~ds_muon.core.block_tiles`), QK-clip's rule (:mod:`~ds_muon.core.qk_clip`) and the dtype rules
(:mod:`~ds_muon.core.dtypes`). The oracle and the sharded steps both call these, so they compute the same thing.
"""
