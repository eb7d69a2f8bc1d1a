"""Zero-code activation (ds_muon/_autoload.py): an installed ds_muon serves ``"type": "Muon"`` with no import.

A throw-away virtual environment sees the test venv's packages (torch, deepspeed, transformers) through
a path-only ``.pth`` and gets ds_muon installed into it with pip, editable and normal, exactly as a user
would; PYTHONPATH is removed so only the installed copy (and its ``ds_muon_autoload.pth``) can act.
The scripts below never import ds_muon.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from tests.support.spawn import free_port
from tests.support.tools import REPO


# The end of each launched script: tear the process group down and skip interpreter teardown, as
# tests/support/spawn.py's workers do. On CPU a rank aborted there now and then ("terminate called without an active
# exception", SIGABRT after its RESULT line: PLAIN 3 of ~20 runs under load, never alone; TRAINER once in a full
# suite on 2 loaded cores, 2026-12-03); what the tests check is printed before it.
TEARDOWN = textwrap.dedent('''
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    import os; os._exit(0)
''')

PLAIN = textwrap.dedent('''
    import argparse, json, sys
    import torch, deepspeed
    ap = argparse.ArgumentParser(); ap.add_argument("--local_rank", type=int, default=0)
    args = deepspeed.add_config_arguments(ap).parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    for _ in range(2):
        loss = engine(torch.randn(4, 16)).pow(2).mean(); engine.backward(loss); engine.step()
    print("RESULT " + json.dumps({"rank": engine.global_rank, "optimizer": type(engine.optimizer).__name__,
                                  "ds_muon_file": getattr(sys.modules.get("ds_muon"), "__file__", None)}), flush=True)
''') + TEARDOWN

TRAINER = textwrap.dedent('''
    import json, torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        x = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
        def __len__(self): return len(self.x)
        def __getitem__(self, i): return {"input_ids": self.x[i], "labels": self.x[i]}

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "ns_steps": 5}},
          "zero_optimization": {"stage": 3}}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, learning_rate=0.02, max_steps=2,
                             deepspeed=ds, use_cpu=True, report_to=[], save_strategy="no", log_level="info")
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    if trainer.is_world_process_zero():
        print("RESULT " + json.dumps({"optimizer": type(trainer.deepspeed.optimizer).__name__,
                                      "muon_steps": getattr(trainer.deepspeed.optimizer, "muon_step_count", None)}),
              flush=True)
''') + TEARDOWN

# ZeRO-3 defaults (reduce_scatter on): DeepSpeed's built-in Muon refuses this config at once ("Muon and
# reduce scatter cannot be used together"), ds_muon trains it; so the outcome says which one ran.
DS_CONFIG = {"train_micro_batch_size_per_gpu": 4,
             "optimizer": {"type": "Muon", "params": {"lr": 0.02, "ns_steps": 5}},
             "zero_optimization": {"stage": 3}}


def _make_venv(root: Path, editable: bool) -> Path:
    """A venv seeing this interpreter's site-packages, with ds_muon pip-installed from REPO."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    py = root / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # A path line only: the outer venv's own .pth files (e.g. an editable ds_muon elsewhere) are not run.
    (site / "_outer_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cmd = [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"] + (["-e"] if editable else [])
    subprocess.run(cmd + [str(REPO)], check=True, capture_output=True, text=True, env=_env(), cwd=root)
    assert (site / "ds_muon_autoload.pth").is_file(), sorted(p.name for p in site.iterdir())
    return py


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_MUON")}
    return dict(env, **extra)



def _results(out: str) -> list[dict]:
    """Every rank's ``RESULT {...}`` (flat JSON objects); the launcher may interleave two ranks' lines."""
    return [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", out)]


@pytest.fixture(scope="module")
def editable_venv(tmp_path_factory) -> Path:
    return _make_venv(tmp_path_factory.mktemp("venv_e"), editable=True)


def _launch(py: Path, cwd: Path, **env: str) -> tuple[int, list[dict], str]:
    (cwd / "plain.py").write_text(PLAIN)
    (cwd / "ds.json").write_text(json.dumps(DS_CONFIG))
    proc = subprocess.run([str(py), "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                           str(free_port()), "plain.py", "--deepspeed_config", "ds.json"],
                          capture_output=True, text=True, timeout=900, cwd=cwd, env=_env(**env))
    out = proc.stdout + proc.stderr
    return proc.returncode, _results(out), out


def test_deepspeed_launcher_unmodified_script_uses_ds_muon(editable_venv, tmp_path) -> None:
    rc, results, out = _launch(editable_venv, tmp_path)
    assert rc == 0, out[-4000:]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["optimizer"] for r in results} == {"MuonZeroOptimizer"}
    assert all(r["ds_muon_file"].startswith(str(REPO)) for r in results)  # the editable install's copy
    assert out.count("ds_muon is active") == 1 and "DS_MUON=0" in out  # one line, rank 0 only


def test_ds_muon_0_falls_back_to_builtin(editable_venv, tmp_path) -> None:
    rc, results, out = _launch(editable_venv, tmp_path, DS_MUON="0")
    assert rc != 0 and not results
    assert "Muon and reduce scatter cannot be used together" in out  # DeepSpeed's built-in Muon was built
    assert "ds_muon is active" not in out and "MuonZeroOptimizer" not in out


def test_trainer_without_import_uses_ds_muon_and_shows_split(editable_venv, tmp_path) -> None:
    (tmp_path / "trainer.py").write_text(TRAINER)
    proc = subprocess.run([str(editable_venv), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "trainer.py"], capture_output=True, text=True, timeout=900, cwd=tmp_path, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert _results(out) == [{"optimizer": "MuonZeroOptimizer", "muon_steps": 2}]
    assert out.count("ds_muon is active") == 1
    # log_level="info" alone (no DeepSpeed logging call in the script) shows the split
    assert "ds_muon parameter split" in out


def test_normal_install_ships_hook_and_activates_on_deepspeed_import(tmp_path) -> None:
    py = _make_venv(tmp_path / "venv", editable=False)
    probe = ("import sys; import deepspeed; from ds_muon import integration as i; "
             "print('PROBE', i.is_enabled(), sys.modules['ds_muon'].__file__)")
    on = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=_env(), cwd=tmp_path, check=True)
    enabled, path = on.stdout.split("PROBE ", 1)[1].split()
    assert enabled == "True" and path.startswith(str(tmp_path / "venv"))  # the installed copy, not the repo
    off = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=_env(DS_MUON="0"), cwd=tmp_path,
                         check=True)
    assert off.stdout.split("PROBE ", 1)[1].split()[0] == "False"
    # start-up stays cheap: the hook imports neither torch nor deepspeed
    cheap = subprocess.run([str(py), "-c", "import sys; print('PROBE', 'torch' in sys.modules, "
                            "'deepspeed' in sys.modules, 'ds_muon._autoload' in sys.modules)"],
                           capture_output=True, text=True, env=_env(), cwd=tmp_path, check=True)
    assert cheap.stdout.split("PROBE ", 1)[1].split() == ["False", "False", "True"]
    # pip uninstall takes the start-up hook with it (it is in the wheel's RECORD), and Python starts silently after
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert (site / "ds_muon_autoload.pth").is_file()
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "ds_muon"], env=_env(), cwd=tmp_path, check=True)
    assert not (site / "ds_muon_autoload.pth").exists()
    gone = subprocess.run([str(py), "-c", "pass"], capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert gone.returncode == 0 and gone.stderr == "", gone.stderr


def _python_prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter with this checkout importable and DS_MUON=1; it must print OK."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO), DS_MUON="1"))
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_explicit_enable_nests_on_top_of_auto() -> None:
    code = ("import sys, deepspeed, ds_muon; from ds_muon import integration as i, _autoload as a; a.install(); "
            "assert i.is_enabled(); ds_muon.enable(); ds_muon.disable(); assert i.is_enabled(); "
            "a.install(); i.disable(); assert not i.is_enabled(); ds_muon.max_logits_per_head; "
            "assert 'transformers' not in sys.modules, 'enable() imported transformers'; print('OK')")
    _python_prints_ok(code)


def test_hook_survives_find_spec_before_import() -> None:
    """Accelerate's is_deepspeed_available() calls importlib.util.find_spec("deepspeed") before importing it."""
    code = ("import importlib.util, sys; from ds_muon import _autoload as a, import_hooks as h; a.install(); "
            "assert importlib.util.find_spec('deepspeed') is not None; assert 'deepspeed' not in sys.modules; "
            "import deepspeed; from ds_muon import integration as i; assert i.is_enabled(), 'not enabled'; "
            "assert not any(isinstance(f, h._AfterImport) and f.fullname == 'deepspeed' for f in sys.meta_path); print('OK')")
    _python_prints_ok(code)


def test_ds_muon_imported_before_deepspeed_still_activates() -> None:
    """A script that imports ds_muon's hooks before deepspeed (``ds_muon.initialize`` does: its first import of
    deepspeed happens inside ds_muon.integration.hooks, while that module is half-imported): activation waits
    for the module instead of failing with a circular-import warning (fails without ``_autoload.deferred``)."""
    code = ("import sys, warnings; warnings.simplefilter('error', RuntimeWarning)\n"
            "from ds_muon import _autoload as a; a.install(); assert 'deepspeed' not in sys.modules\n"
            "import ds_muon.integration as i; assert 'deepspeed' in sys.modules\n"
            "assert i.is_enabled() and not a.deferred, (i.is_enabled(), a.deferred); print('OK')")
    _python_prints_ok(code)


def test_ds_muon_0_set_after_install_still_turns_activation_off() -> None:
    """``install()`` with ``DS_MUON`` unset arms the hook; ``DS_MUON=0`` set afterwards (by a test suite's conftest,
    a wrapper script) and before ``import deepspeed`` wins: ds_muon is not enabled, because the callback
    re-checks the variable. Without the change of the variable the same script is enabled (fresh interpreters,
    the checkout on PYTHONPATH, ``DS_MUON`` removed from the environment)."""
    code = ("import os, sys; assert 'DS_MUON' not in os.environ\n"
            "from ds_muon import _autoload as a; a.install(); assert 'deepspeed' not in sys.modules\n"
            "if sys.argv[1] == 'off': os.environ['DS_MUON'] = '0'\n"
            "import deepspeed; from ds_muon import integration as i; print('ENABLED', i.is_enabled())\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_MUON"}
    for arg, want in (("off", "False"), ("on", "True")):
        proc = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True,
                              env=dict(env, PYTHONPATH=str(REPO)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"ENABLED {want}" in proc.stdout, (arg, proc.stdout, proc.stderr[-3000:])


def test_error_under_auto_activation_names_the_way_out() -> None:
    """A config ds_muon refuses (a bad value: momentum 1.5) names DS_MUON=0 when only the start-up hook enabled
    ds_muon. (A mode ds_muon does not serve is handed over instead: tests/dist/test_handover.py.)"""
    code = ("from ds_muon import _autoload as a; a.install(); import deepspeed; from ds_muon.integration import hooks as i\n"
            "class Cfg: _param_dict = {'optimizer': {'type': 'Muon', 'params': {'momentum': 1.5}}, "
            "'zero_optimization': {'stage': 3}}\n"
            "for explicit in (False, True):\n"
            "    if explicit: i.enable()\n"
            "    try: i._set_optimizer_flags(Cfg(), None)\n"
            "    except Exception as e: print('MSG', explicit, 'DS_MUON=0' in str(e), 'momentum' in str(e))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO), DS_MUON="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    msgs = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("MSG")]
    assert msgs == [["False", "True", "True"], ["True", "False", "True"]]  # explicit enable(): no DS_MUON hint


def test_after_import_calls_each_callback_once_after_the_module_loads(tmp_path, monkeypatch) -> None:
    """ds_muon.import_hooks.after_import on a throw-away module: nothing runs before the import; each distinct
    callback runs once, in order, after the module body (a second registration of the same one is dropped);
    a module whose import fails keeps the hook, and the next successful import runs the callbacks; the finder
    leaves sys.meta_path afterwards; a module already imported calls back at once."""
    from ds_muon import import_hooks as a
    name = "dsm_after_import_probe"
    (tmp_path / f"{name}.py").write_text("import os\nif os.environ.get('DSM_PROBE_FAIL'): raise ImportError('no')\n"
                                         "LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # restored after the test
    calls = []

    def first() -> None:
        calls.append(("first", getattr(sys.modules[name], "LOADED", False)))

    def second() -> None:
        calls.append(("second", True))

    a.after_import(name, first)
    a.after_import(name, second)
    a.after_import(name, first)
    hooks = [f for f in sys.meta_path if isinstance(f, a._AfterImport) and f.fullname == name]
    assert len(hooks) == 1 and calls == []
    monkeypatch.setenv("DSM_PROBE_FAIL", "1")
    with pytest.raises(ImportError, match="no"):
        __import__(name)
    assert calls == [] and hooks[0] in sys.meta_path and name not in sys.modules
    monkeypatch.delenv("DSM_PROBE_FAIL")
    __import__(name)
    assert calls == [("first", True), ("second", True)]
    assert not any(isinstance(f, a._AfterImport) and f.fullname == name for f in sys.meta_path)
    a.after_import(name, second)  # already imported: at once
    assert calls[-1] == ("second", True) and len(calls) == 3
    sys.modules.pop(name, None)


TORCH_STUB = "raise ImportError('No module named torch (test stub: torch missing)')\n"
# After the start-up probe: a process that imports deepspeed where torch is missing gets deepspeed's own
# ImportError, and ds_muon adds nothing to it (no warning, no traceback of its own).
IMPORT_DEEPSPEED = ("\ntry:\n    import deepspeed\nexcept ImportError as err:\n    print('DSIMPORT', repr(str(err)))\n"
                    "else:\n    print('DSIMPORT imported')\n")


@contextlib.contextmanager
def _read_only(folder: Path):
    """``folder`` made read-only as a site-packages on a read-only mount is (a bind mount, remounted ``ro``, as
    root, who write-permission bits do not stop; ``chmod -R a-w`` otherwise). Skips where neither works."""
    if os.geteuid() != 0:
        for d, _, files in os.walk(folder):
            for name in files:
                os.chmod(os.path.join(d, name), 0o444)
            os.chmod(d, 0o555)
        try:
            yield folder
        finally:
            for d, _, _ in os.walk(folder):
                os.chmod(d, 0o755)
        return
    ro = folder.parent / f"{folder.name}_ro"
    ro.mkdir()
    try:
        subprocess.run(["mount", "--bind", str(folder), str(ro)], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"read-only site-packages: cannot bind-mount here ({getattr(err, 'stderr', b'') or err})")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True, capture_output=True, timeout=60)
        probe = ro / "probe"
        with pytest.raises(OSError):
            probe.write_text("x")
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True, timeout=60)


@pytest.mark.parametrize("ds_muon_state", ["present", "missing", "broken", "present-DS_MUON=0", "read-only",
                                           "torch-missing"])
@pytest.mark.parametrize("flags", [["-S"], ["-I", "-S"]], ids=["S", "isolated"])
def test_startup_hook_never_raises_or_prints(tmp_path, ds_muon_state, flags) -> None:
    """The ``.pth`` line runs in every interpreter of the environment, trainer or not. With ds_muon present it only
    installs the finder (no torch, no deepspeed); half-uninstalled (the ``.pth`` left, the package gone) or broken
    (its ``__init__`` raising), Python starts silently as if it were not installed; ``DS_MUON=0`` installs nothing.
    Installed into a read-only site-packages (no ``__pycache__`` can be written) it starts as silently as when
    present. With torch missing (shadowed by a package whose import raises ImportError), start-up is silent and a
    later ``import deepspeed`` raises deepspeed's own ImportError, unchanged, with nothing printed by ds_muon.
    (Python's ``site`` prints "Error processing line 1 of ...pth" and a traceback for a ``.pth`` line that raises.)"""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "ds_muon_autoload.pth").write_text((REPO / "ds_muon_autoload.pth").read_text())
    path = {"present": str(REPO), "present-DS_MUON=0": str(REPO), "missing": str(tmp_path / "empty"),
            "broken": str(tmp_path / "broken"), "read-only": str(site_dir), "torch-missing": str(REPO)}[ds_muon_state]
    if ds_muon_state == "broken":
        (tmp_path / "broken" / "ds_muon").mkdir(parents=True)
        (tmp_path / "broken" / "ds_muon" / "__init__.py").write_text("raise RuntimeError('half-uninstalled')\n")
    if ds_muon_state == "torch-missing":
        (tmp_path / "stub" / "torch").mkdir(parents=True)
        (tmp_path / "stub" / "torch" / "__init__.py").write_text(TORCH_STUB)
    with contextlib.ExitStack() as stack:
        if ds_muon_state == "read-only":  # an installed copy (no __pycache__), the .pth beside it
            shutil.copytree(REPO / "ds_muon", site_dir / "ds_muon", ignore=shutil.ignore_patterns("__pycache__"))
            site_dir = stack.enter_context(_read_only(site_dir))
            path = str(site_dir)
        first = [str(tmp_path / "stub")] if ds_muon_state == "torch-missing" else []
        code = (f"import sys; sys.path[:0] = {first + [path]!r}; import site; site.addsitedir({str(site_dir)!r}); "
                "print('PROBE', 'ds_muon._autoload' in sys.modules, 'torch' in sys.modules, "
                "'deepspeed' in sys.modules, any(type(f).__module__ == 'ds_muon.import_hooks' for f in sys.meta_path), "
                "sys.modules['ds_muon'].__file__.startswith(" + repr(path) + ") if 'ds_muon' in sys.modules else None)")
        if ds_muon_state == "torch-missing":  # deepspeed importable (a path entry: the venv's .pth files do not run)
            code += f"\nsys.path.append({sysconfig.get_paths()['purelib']!r})" + IMPORT_DEEPSPEED
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_MUON")}
        if ds_muon_state.endswith("DS_MUON=0"):
            env["DS_MUON"] = "0"
        proc = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)
        if ds_muon_state == "read-only":
            assert not list(Path(path).rglob("__pycache__")), "wrote into the read-only site-packages"
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    loaded, torch_loaded, ds_loaded, finder, from_path = proc.stdout.split("PROBE ", 1)[1].split()[:5]
    assert torch_loaded == ds_loaded == "False"
    served = ds_muon_state in ("present", "read-only", "torch-missing")
    assert loaded == str(served or ds_muon_state == "present-DS_MUON=0"), proc.stdout
    assert finder == str(served), proc.stdout
    if loaded == "True":
        assert from_path == "True", proc.stdout  # the copy under test, not another one on sys.path
    if ds_muon_state == "torch-missing":
        assert "DSIMPORT 'No module named torch (test stub: torch missing)'" in proc.stdout, proc.stdout


@pytest.mark.parametrize("flags", [[], ["-I"]], ids=["plain", "isolated"])
@pytest.mark.parametrize("switch", ["auto", "DS_MUON=0"])
def test_startup_hook_of_this_environment_never_raises_or_prints(tmp_path, flags, switch) -> None:
    """The hook as pip installed it into this test environment's site-packages (``scripts/test.sh`` runs ``pip
    install -e .``), under ``python -c`` and ``python -I -c`` (no PYTHONPATH, no user site): start-up prints nothing
    and imports neither torch nor deepspeed; the finder is there unless ``DS_MUON=0``; with torch missing (a stub
    put first on ``sys.path`` after start-up), ``import deepspeed`` raises deepspeed's own ImportError and nothing
    else is printed."""
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "ds_muon_autoload.pth").is_file():
        pytest.skip(f"ds_muon is not pip-installed into {site} (no ds_muon_autoload.pth): run scripts/test.sh")
    (tmp_path / "stub" / "torch").mkdir(parents=True)
    (tmp_path / "stub" / "torch" / "__init__.py").write_text(TORCH_STUB)
    code = ("import sys; print('PROBE', 'torch' in sys.modules, 'deepspeed' in sys.modules, "
            "any(type(f).__module__ == 'ds_muon.import_hooks' for f in sys.meta_path)); "
            f"sys.path.insert(0, {str(tmp_path / 'stub')!r})" + IMPORT_DEEPSPEED)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_MUON")}
    if switch == "DS_MUON=0":
        env["DS_MUON"] = "0"
    proc = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    torch_loaded, ds_loaded, finder = proc.stdout.split("PROBE ", 1)[1].split()[:3]
    assert torch_loaded == ds_loaded == "False", proc.stdout
    assert finder == str(switch == "auto"), proc.stdout
    assert "DSIMPORT 'No module named torch (test stub: torch missing)'" in proc.stdout, proc.stdout
