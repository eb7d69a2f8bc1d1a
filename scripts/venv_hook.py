"""Make a virtual environment's ``bin/activate`` set ``TORCH_EXTENSIONS_DIR`` to ``<venv>/torch_extensions``.

``python scripts/venv_hook.py VENV`` (run by ``scripts/train.sh`` and ``scripts/test.sh`` on the environment they
create or reuse). The scripts keep DeepSpeed's JIT-built ops (shared-memory comm, CPU Adam, FusedAdam, async_io)
in ``<venv>/torch_extensions``; without this, a later ``source .venv/bin/activate && deepspeed examples/train.py``
would look in torch's default cache (``~/.cache/torch_extensions``), find nothing and rebuild every op, silently,
for minutes. After it, ``source <venv>/bin/activate`` exports ``TORCH_EXTENSIONS_DIR=<venv>/torch_extensions`` when
the variable is unset (a value you set yourself is kept) and ``deactivate`` removes it again if activate set it
and it was not changed since. Only the bash/zsh/sh ``activate`` is changed (not ``activate.fish``/``.csh``).

Idempotent: the lines sit between two marker lines, and a second run finds them and changes nothing.
Exit code 0 (also when ``VENV/bin/activate`` is missing: nothing to change); 1 on a write error.
"""
from __future__ import annotations

import os
import sys

BEGIN = "# >>> ds_muon: DeepSpeed's JIT-op cache of this environment (scripts/venv_hook.py) >>>"
END = "# <<< ds_muon <<<"

#: Appended to ``activate``: runs after the venv has set (and exported) VIRTUAL_ENV.
ACTIVATE_BLOCK = f"""{BEGIN}
if [ -z "${{TORCH_EXTENSIONS_DIR:-}}" ] ; then
    TORCH_EXTENSIONS_DIR="$VIRTUAL_ENV/torch_extensions"
    export TORCH_EXTENSIONS_DIR
    _DS_MUON_TORCH_EXTENSIONS_DIR="$TORCH_EXTENSIONS_DIR"
fi
{END}
"""

#: Put first into ``deactivate () {``: undo the export above, unless the value was changed since.
DEACTIVATE_BLOCK = f"""    {BEGIN}
    if [ -n "${{_DS_MUON_TORCH_EXTENSIONS_DIR:-}}" ] ; then
        if [ "${{TORCH_EXTENSIONS_DIR:-}}" = "$_DS_MUON_TORCH_EXTENSIONS_DIR" ] ; then
            unset TORCH_EXTENSIONS_DIR
        fi
        unset _DS_MUON_TORCH_EXTENSIONS_DIR
    fi
    {END}
"""

DEACTIVATE_LINE = "deactivate () {"


def add_hook(venv: str) -> bool:
    """Add the two blocks to ``venv/bin/activate``; whether the file changed (False: already there, or no file).

    Raises:
        OSError: the file cannot be read or written.
    """
    path = os.path.join(venv, "bin", "activate")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if BEGIN in text:
        return False
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip() == DEACTIVATE_LINE:  # the venv template's (CPython 3.8-3.13); without it: no undo
            lines.insert(i + 1, DEACTIVATE_BLOCK)
            break
    text = "".join(lines)
    if not text.endswith("\n"):
        text += "\n"
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n" + ACTIVATE_BLOCK)
    os.chmod(tmp, os.stat(path).st_mode)
    os.replace(tmp, path)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/venv_hook.py VENV", file=sys.stderr)
        return 2
    try:
        changed = add_hook(argv[0])
    except OSError as err:
        print(f"!! could not add TORCH_EXTENSIONS_DIR to {argv[0]}/bin/activate ({err}); export it yourself: "
              f"export TORCH_EXTENSIONS_DIR={os.path.abspath(argv[0])}/torch_extensions", file=sys.stderr)
        return 1
    if changed:
        print(f">> {argv[0]}/bin/activate now sets TORCH_EXTENSIONS_DIR={os.path.abspath(argv[0])}/torch_extensions "
              "(DeepSpeed's JIT-built ops of this environment) when it is unset")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
