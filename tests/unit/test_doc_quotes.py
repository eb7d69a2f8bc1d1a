"""Program output quoted in the docs is the program's output today: docs/selection.md's parameter splits and its
weight-decay example.

Each quoted ``ds_muon parameter split`` block is recomputed from the model it describes
(``select_muon_params(...).summary()``, what examples/train.py and the engine log) and must match line for line;
when the summary's format or the rules change, paste the new output (the assertion message prints it). The
``# ds_muon param groups`` snippet is run and its output compared with the text block after it.
"""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from tests.support.tools import REPO, repo_module


def _blocks(path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [b.strip("\n") for b in re.findall(r"```text\n(ds_muon parameter split.*?)```", text, flags=re.S)]


def _example_moe():
    model = repo_module("examples/model.py")
    return model.CausalLM(model.ModelConfig.preset("moe")), {}


def _qwen3_moe():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(cfg), {"per_head_muon": True}


def _family(name: str, params: dict | None = None):
    def build():
        pytest.importorskip("transformers")
        from tests.support import families
        return getattr(families, name)(), params or {}
    build.__name__ = name
    return build


# the quoted splits of docs/selection.md, in order
QUOTED = [("examples-moe", _example_moe), ("qwen3-moe", _qwen3_moe), ("gpt-oss", _family("gpt_oss")),
          ("qwen3-next", _family("qwen3_next", {"per_head_muon": True})), ("encoder", _family("encoder_lm")),
          ("vit", _family("vit"))]


@pytest.mark.parametrize("index,build", [(i, b) for i, (_, b) in enumerate(QUOTED)], ids=[n for n, _ in QUOTED])
def test_quoted_parameter_splits_are_todays_output(index, build):
    from ds_muon.config import parse_muon_params
    from ds_muon.model.selection import SelectionRules, select_muon_params
    quoted = _blocks(REPO / "docs" / "selection.md")
    assert len(quoted) == len(QUOTED), f"docs/selection.md should quote {len(QUOTED)} parameter splits"
    model, params = build()
    got = select_muon_params(model, SelectionRules.from_params(parse_muon_params(params))).summary().strip("\n")
    assert got.splitlines() == quoted[index].splitlines(), f"docs/selection.md block {index} is stale; today:\n{got}"


def test_quoted_param_groups_are_todays_output():
    pytest.importorskip("transformers")
    text = (REPO / "docs" / "selection.md").read_text(encoding="utf-8")
    found = re.findall(r"```python\n(# ds_muon param groups\n.*?)```\n\n```text\n(.*?)```", text, flags=re.S)
    assert len(found) == 1, "docs/selection.md should have one '# ds_muon param groups' snippet and its output"
    snippet, quoted = found[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "docs/selection.md", "exec"), {})
    got = out.getvalue().strip("\n")
    assert got.splitlines() == quoted.strip("\n").splitlines(), f"docs/selection.md param groups are stale; today:\n{got}"
