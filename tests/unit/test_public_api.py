"""The public surface against the conventions of torch.optim, DeepSpeed and Hugging Face (issue 38, item 7).

* ``MuonAdamW`` has a typed keyword signature (``help()`` and IDEs show every hyperparameter) that covers the
  ``"Muon"`` config's keys with the config's defaults, and still validates exactly as a config (unknown keys,
  aliases, refused keys: :class:`ds_muon.config.ConfigError`).
* The exports: ``is_enabled`` (the predicate) and ``enable_scope`` (the context manager) are exported, and both ZeRO
  optimizer classes are; the old ``ds_muon.enabled()`` still works, with a ``DeprecationWarning``.
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import ds_muon
from ds_muon.config import ConfigError, MuonOptimizerParams


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))


def test_muon_adamw_signature_lists_every_config_key_with_its_default():
    from ds_muon.oracle.muon_adamw import DEFAULT_WHEN_NONE
    sig = inspect.signature(ds_muon.MuonAdamW.__init__)
    keywords = {n: p for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(keywords) == set(MuonOptimizerParams.model_fields), set(keywords) ^ set(MuonOptimizerParams.model_fields)
    for name, param in keywords.items():
        field = MuonOptimizerParams.model_fields[name]
        default = field.get_default(call_default_factory=True)
        assert param.annotation is not inspect.Parameter.empty, name
        if name in DEFAULT_WHEN_NONE:  # None stands for the config's default, which is not None
            assert param.default is None and default is not None, (name, default)
        else:
            assert param.default == default, (name, param.default, default)
    assert "lr: 'float' = 0.02" in str(sig) and "ns_method: \"Literal['standard', 'gram', 'polar_express']\"" in str(sig)


def test_muon_adamw_keywords_validate_as_the_config_does():
    m = _model()
    assert ds_muon.MuonAdamW(m).config == MuonOptimizerParams()  # no keyword: the config's defaults
    opt = ds_muon.MuonAdamW(m, lr=0.1, adam_betas=(0.8, 0.9), adam_eps=1e-6, adjust_lr_fn="match_rms_adamw",
                            qk_clip=None, muon_params=None)
    assert (opt.config.lr, opt.config.betas, opt.config.eps, opt.config.update_scale) == (0.1, (0.8, 0.9), 1e-6,
                                                                                         "rms_match")
    assert ds_muon.MuonAdamW(m, update_scale="original").param_groups[0]["update_scale"] == "shape"
    for kwargs, pattern in ((dict(lrr=0.1), r"MuonAdamW\.lrr: unknown key.*did you mean 'lr'"),
                            (dict(betas=(0.9, 0.95), adam_betas=(0.9, 0.95)), r"both 'betas' and its alias"),
                            (dict(max_grad_norm=1.0), r"MuonAdamW\.max_grad_norm.*gradient_clipping"),
                            (dict(lr=None), r"MuonAdamW\.lr: None is invalid"),
                            (dict(momentum=1.5), r"MuonAdamW\.momentum: 1\.5 is invalid")):
        with pytest.raises(ConfigError, match=pattern):
            ds_muon.MuonAdamW(m, **kwargs)


def test_exports_are_consistent_and_old_names_still_work():
    from ds_muon.integration import hooks
    from ds_muon.integration.zero3 import MuonZeroOptimizer
    from ds_muon.integration.zero12 import MuonZero12Optimizer
    assert {"is_enabled", "enable_scope", "MuonZeroOptimizer", "MuonZero12Optimizer", "enable", "disable"} <= set(
        ds_muon.__all__)
    assert ds_muon.MuonZeroOptimizer is MuonZeroOptimizer and ds_muon.MuonZero12Optimizer is MuonZero12Optimizer
    assert ds_muon.is_enabled is hooks.is_enabled and ds_muon.enable_scope is hooks.enable_scope
    assert not ds_muon.is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names warn about nothing
        with ds_muon.enable_scope():
            assert ds_muon.is_enabled()
    assert not ds_muon.is_enabled()
    with pytest.deprecated_call(match=r"ds_muon\.enabled\(\) is deprecated: use ds_muon\.enable_scope\(\)"):
        scope = ds_muon.enabled()
    with scope:
        assert ds_muon.is_enabled()
    assert not ds_muon.is_enabled()


def test_flat_partition_inner_is_a_deprecated_name_of_zero_muon_inner():
    """The ZeRO-1/2 inner optimizer was FlatPartitionInner (a name without "muon", to keep DeepSpeed's own ZeRO-1/2 Muon
    path off); ZeroMuonInner serves every stage now (the path is switched off by BuiltinMuonSwitch) and the old name
    still imports, with a DeprecationWarning."""
    from ds_muon.integration import inner
    from ds_muon.integration.builtin_muon import BuiltinMuonSwitch
    from ds_muon.integration.zero12 import MuonZero12Optimizer
    with pytest.deprecated_call(match="FlatPartitionInner is deprecated: ZeroMuonInner"):
        assert inner.FlatPartitionInner is inner.ZeroMuonInner
    assert "muon" in inner.ZeroMuonInner.__name__.lower()
    assert issubclass(MuonZero12Optimizer, BuiltinMuonSwitch) and MuonZero12Optimizer.builtin_muon is False
