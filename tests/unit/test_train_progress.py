"""examples/train.py's progress output: tqdm's bar on a terminal, a plain line every few steps in a log.

tqdm redraws its bar with a carriage return on every ``set_postfix``; in a file or a pipe each redraw is a record
of its own (a 600-step run of the main job wrote about 1,000 into its log, issue 38). ``train.Progress`` lets
tqdm decide (``disable=None``: draw only on a terminal) and otherwise prints ``step N/T: ...`` every few steps and
at the last one. The loop below is the main job's: ``update`` every step, a validation line every 100 steps.
"""
from __future__ import annotations

import io
import re

import pytest

from tests.support.tools import repo_module

STATS = {"loss": "2.345", "tok/s": "12,345", "gnorm": "0.512", "lr": "0.02/0.003"}


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, as the user's stderr does."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module", autouse=True)
def _load_train():
    repo_module("examples/train.py")              # before capsys: importing deepspeed logs a line


def _train_loop(start: int, steps: int, enabled: bool = True, every: int = 0, file=None) -> None:
    progress = repo_module("examples/train.py").Progress(start, steps, enabled=enabled, every=every, file=file)
    for step in progress:
        progress.update(step, STATS)
        if enabled and step % 100 == 0:
            progress.write(f"step {step}: train loss 2.3450, val loss 2.4000")
    progress.close()


def _progress_steps(out: str, steps: int) -> list[int]:
    return [int(m) for m in re.findall(rf"^step (\d+)/{steps}: loss 2\.345, tok/s 12,345, gnorm 0\.512, "
                                       rf"lr 0\.02/0\.003, elapsed \d\d:\d\d$", out, flags=re.M)]


@pytest.mark.parametrize("start,steps,every,expected", [
    (1, 600, 0, list(range(50, 601, 50))),        # the main job's default run: every 50 steps
    (301, 600, 0, list(range(330, 601, 30))),     # resumed, 300 steps left: every 10% of them
    (1, 7, 0, list(range(1, 8))),                 # a short run: every step
    (1, 600, 250, [250, 500, 600]),               # --log-every 250, and the last step
], ids=["default", "resumed", "short", "log-every"])
def test_a_log_gets_a_line_every_few_steps_and_no_carriage_returns(capsys, start, steps, every, expected):
    _train_loop(start, steps, every=every)        # stdout and stderr are pytest's captures: not terminals
    out, err = capsys.readouterr()
    assert "\r" not in out + err, f"tqdm redraws in a log: {(out + err).count(chr(13))} carriage returns"
    assert err == ""
    assert _progress_steps(out, steps) == expected
    validations = [s for s in range(start, steps + 1) if s % 100 == 0]
    assert len(out.splitlines()) == len(expected) + len(validations), out


def test_a_terminal_gets_the_bar_and_no_lines(capsys):
    terminal = _Terminal()
    _train_loop(1, 600, file=terminal)
    out, _ = capsys.readouterr()
    drawn = terminal.getvalue()
    assert drawn.count("\r") >= 600 and "train: 100%" in drawn and "loss=2.345, tok/s=12,345" in drawn
    assert _progress_steps(out, 600) == []
    assert out.splitlines() == [f"step {s}: train loss 2.3450, val loss 2.4000" for s in range(100, 601, 100)]


@pytest.mark.parametrize("file", [None, _Terminal()], ids=["log", "terminal"])
def test_other_ranks_print_nothing(capsys, file):
    _train_loop(1, 60, enabled=False, file=file)
    out, err = capsys.readouterr()
    assert out == err == "" and (file is None or file.getvalue() == "")
