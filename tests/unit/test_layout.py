"""The layers of docs/design.md as a check: which ds_muon package may import what, and no cycles.

:func:`layout_problems` reads every module of a package tree with ``ast`` (no import is executed) and
returns one line per broken rule. The real package must have none; each rule is also shown to fail on a
small synthetic package that breaks it (the negative controls).
"""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ds_muon"

#: ds_muon packages (or base modules) each layer may import, at module level or in a function.
ALLOWED = {
    "names": set(),
    "errors": set(),
    "partitions": set(),
    "import_hooks": set(),
    "config": {"names", "errors"},
    "core": {"names", "errors"},
    "model": {"core", "names", "errors"},
    "sharded": {"core", "names", "errors", "partitions"},
    "checkpoint": {"names", "errors", "partitions"},
    "oracle": {"config", "core", "model", "names", "errors"},
    "integration": {"config", "core", "model", "sharded", "checkpoint", "oracle", "names", "errors", "partitions",
                    "import_hooks"},
    "_autoload": {"import_hooks", "integration"},
    "__init__": set(),  # lazy: importlib only
}
#: third-party top-level packages each layer may import (the standard library is always allowed).
THIRD_PARTY = {
    "names": set(), "errors": set(), "partitions": set(), "import_hooks": set(), "_autoload": set(), "__init__": set(),
    "config": {"pydantic", "pydantic_core", "annotated_types"},
    "core": {"torch"},
    "model": {"torch", "transformers"},
    "sharded": {"torch"},
    "checkpoint": {"torch"},
    "oracle": {"torch"},
    "integration": {"torch", "deepspeed", "transformers"},
}
#: layers whose modules must not import these at module level (importing them costs seconds or has effects)
NOT_AT_MODULE_LEVEL = {"config": {"torch", "deepspeed"}}
#: layers that must not use these modules at all
FORBIDDEN = {"model": {"torch.distributed"}, "core": {"torch.distributed"}}
#: modules of ``model`` that may import transformers (it is optional for everything else)
TRANSFORMERS_OK = {"model.hf_attention", "integration.hooks"}


def _layer(rel: pathlib.PurePath) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module_name(rel: pathlib.PurePath) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _imports(tree: ast.Module, module: str, is_package: bool):
    """Yield ``(target, in_function, names, node)``: ``target`` a dotted name, ``ds_muon.``-prefixed for the
    package's own modules."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(node) for f in functions for node in ast.walk(f)}
    here = module.split(".") if module != "__init__" else []
    for node in ast.walk(tree):
        local = id(node) in inside
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, local, [], node
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level == 0:
                yield node.module, local, names, node
                continue
            base = here if is_package else here[:-1]
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # from . import a, b: each is a module
                for name in names:
                    yield "ds_muon." + ".".join([*base, name]), local, [], node
            else:
                yield "ds_muon." + target if target else "ds_muon", local, names, node


def layout_problems(package: pathlib.Path) -> list[str]:
    """One line per broken layer rule of the package tree at ``package`` (a folder named like ``ds_muon``)."""
    problems: list[str] = []
    edges: dict[str, set[str]] = {}
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        layer, module = _layer(rel), _module_name(rel)
        tree = ast.parse(path.read_text())
        edges.setdefault(module, set())
        for target, local, names, node in _imports(tree, module, path.name == "__init__.py"):
            where = f"{package.name}/{rel}:{node.lineno}"
            top = target.split(".")[0]
            if top == "ds_muon":
                own = target.split(".")[1:] or ["__init__"]
                edges[module].add(".".join(own))
                # `from ..pkg import mod` names a module of that package: resolve to it for the cycle graph
                for name in names:
                    if (package.joinpath(*own, name + ".py")).exists() or (package.joinpath(*own, name)).is_dir():
                        edges[module].add(".".join(own + [name]))
                target_layer = own[0]
                if target_layer != layer and target_layer not in ALLOWED.get(layer, set()):
                    problems.append(f"{where}: layer {layer!r} imports {target} (layer {target_layer!r}); allowed: "
                                    f"{sorted(ALLOWED.get(layer, set()))}")
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private and target_layer != layer:
                    problems.append(f"{where}: {module} imports private name(s) {private} from {target} (another package)")
                continue
            if top in stdlib:
                continue
            if top not in THIRD_PARTY.get(layer, set()):
                problems.append(f"{where}: layer {layer!r} imports {target}; allowed third-party packages: "
                                f"{sorted(THIRD_PARTY.get(layer, set()))}")
            if top == "transformers" and module not in TRANSFORMERS_OK:
                problems.append(f"{where}: {module} imports transformers (optional: only {sorted(TRANSFORMERS_OK)})")
            if not local and top in NOT_AT_MODULE_LEVEL.get(layer, set()):
                problems.append(f"{where}: layer {layer!r} imports {target} at module level")
            for forbidden in FORBIDDEN.get(layer, set()):
                if target == forbidden or target.startswith(forbidden + "."):
                    problems.append(f"{where}: layer {layer!r} imports {target}")
            if target == "torch" and any(n == "distributed" for n in names) and "torch.distributed" in FORBIDDEN.get(layer, ()):
                problems.append(f"{where}: layer {layer!r} imports torch.distributed")
        if layer == "checkpoint":  # the file format never reaches into an optimizer's private state
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    problems.append(f"{package.name}/{rel}:{node.lineno}: the checkpoint layer uses the private "
                                    f"attribute .{node.attr}; the glue must hand it what it needs")
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(edges)]
    return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every module on an import cycle, as one cycle path each (module-level and function imports alike)."""
    def resolve(name: str) -> str:
        while name and name not in edges:
            name = name.rpartition(".")[0]
        return name
    graph = {m: {resolve(t) for t in ts} - {m, ""} for m, ts in edges.items()}
    found, seen = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        found.append(path + [start])
                elif nxt not in path and len(path) < 12:
                    stack.append((nxt, path + [nxt]))
    return found


def test_the_package_keeps_its_layers():
    problems = layout_problems(PACKAGE)
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    layers = {_layer(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert layers <= set(ALLOWED), sorted(layers - set(ALLOWED))


# ------------------------------------------------------------------------------------------------
# negative controls: each rule fails on a package that breaks it
# ------------------------------------------------------------------------------------------------
def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    pkg = root / "ds_muon"
    for rel, text in {"__init__.py": "", "names.py": "", "errors.py": "", "core/__init__.py": "",
                      "core/math.py": "import torch\n", "model/__init__.py": "", "sharded/__init__.py": "",
                      "config/__init__.py": "", "checkpoint/__init__.py": "", "integration/__init__.py": "",
                      **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


BROKEN = {
    "core imports deepspeed": ({"core/bad.py": "import deepspeed\n"}, "layer 'core' imports deepspeed"),
    "core imports a higher layer": ({"core/bad.py": "from ..model import structure\n"}, "layer 'core' imports ds_muon.model"),
    "model uses torch.distributed": ({"model/bad.py": "import torch.distributed as dist\n"},
                                     "layer 'model' imports torch.distributed"),
    "model uses torch.distributed (from)": ({"model/bad.py": "from torch import distributed\n"},
                                            "layer 'model' imports torch.distributed"),
    "sharded imports deepspeed": ({"sharded/bad.py": "from deepspeed.utils import logger\n"},
                                  "layer 'sharded' imports deepspeed.utils"),
    "config imports torch at module level": ({"config/bad.py": "import torch\n"}, "layer 'config' imports torch"),
    "config imports deepspeed at module level": ({"config/bad.py": "def f():\n    pass\nimport deepspeed\n"},
                                                 "layer 'config' imports deepspeed"),
    "checkpoint calls opt._private": ({"checkpoint/bad.py": "def f(opt):\n    return opt._state_index()\n"},
                                      "private attribute ._state_index"),
    "checkpoint imports the glue": ({"checkpoint/bad.py": "from ..integration import zero3\n"},
                                    "layer 'checkpoint' imports ds_muon.integration"),
    "private name across packages": ({"model/bad.py": "from ..core.math import _helper\n"},
                                     "imports private name(s) ['_helper']"),
    "import cycle": ({"integration/a.py": "from . import b\n", "integration/b.py": "def f():\n    from . import a\n"},
                     "import cycle"),
    "transformers outside hf_attention": ({"model/bad.py": "import transformers\n"}, "imports transformers (optional"),
    "unknown layer": ({"extra.py": "import torch\n"}, "layer 'extra'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_rule_fails_when_broken(case, tmp_path):
    files, expected = BROKEN[case]
    assert not layout_problems(_tree(tmp_path / "ok", {})), "the synthetic base package must be clean"
    problems = layout_problems(_tree(tmp_path / "bad", files))
    assert any(expected in line for line in problems), (case, problems)


def test_checkpoint_key_names_are_deepspeeds():
    """ds_muon.names spells DeepSpeed's checkpoint keys so the checkpoint layer needs no deepspeed import; they
    must be DeepSpeed's own."""
    from deepspeed.checkpoint import constants

    from ds_muon import names
    for key in ("FP32_FLAT_GROUPS", "OPTIMIZER_STATE_DICT", "PARAM", "PARAM_GROUPS", "PARTITION_COUNT", "LOSS_SCALER",
                "SINGLE_PARTITION_OF_FP32_GROUPS", "BASE_OPTIMIZER_STATE"):
        assert getattr(names, key) == getattr(constants, key), key
    # a literal in DeepSpeed's ZeRO-3 optimizer (AutoEP's partition groups), not one of its constants
    import inspect

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3._rigid_state_dict)
    assert f"state_dict['{names.ZERO_PARTITION_GROUPS}']" in source
