"""The two command lines as a person sees them: run in a real pseudo-terminal 80 and 200 columns wide, whose
output is replayed into a terminal emulator (pyte) to get the screen; and through a pipe. Names are never cut
or folded (a name longer than the screen only wraps softly, whole), help fits the terminal, colour only on a
terminal, progress bars vanish, --json parses."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pyte
import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LONG = "model.encoder.layers.10.self_attention.query_key_value.lora_adapter_for_task_summarisation.weight"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TERM"] = "xterm-256color"
    return env


def screen_rows(raw: str, columns: int) -> list[str]:
    """The rows of a ``columns``-wide terminal after ``raw`` was printed (trailing blanks and rows dropped)."""
    screen = pyte.Screen(columns, 200)
    pyte.Stream(screen).feed(raw.replace("\n", "\r\n"))
    rows = [row.rstrip() for row in screen.display]
    while rows and not rows[-1]:
        rows.pop()
    return rows


def screen_lines(raw: str, columns: int) -> list[str]:
    """The text a person reads after ``raw`` was printed on a ``columns``-wide terminal: one entry per logical
    line (a row filled to the last column continues on the next row, as the terminal wrapped it softly)."""
    rows = screen_rows(raw, columns)
    out: list[str] = []
    joined = False
    for row in rows:
        if joined:
            out[-1] += row
        else:
            out.append(row)
        joined = len(row) == columns
    while out and not out[-1]:
        out.pop()
    return out


def in_terminal(args: list[str], columns: int, cwd: Path) -> tuple[int, str]:
    """Run ``args`` with stdin/stdout/stderr on a pty of ``columns`` x 50; (exit status, everything it printed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=_env(), close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            proc.kill()
            raise AssertionError(f"{args} printed nothing for 60 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode("utf-8").replace("\r\n", "\n")


def in_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)


ZIPSLICE = [sys.executable, "-m", "zipslice.cli"]
THETA = [sys.executable, "-m", "theta.commands.cli"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("terminal")
    tensors = {f"layer.{i}.weight": torch.full((3, 4), float(i)) for i in (10, 2, 1)}
    tensors[LONG] = torch.zeros(2, 2, dtype=torch.bfloat16)
    torch.save(tensors, d / "m.pt")
    changed = {k: v + 1 if k == "layer.2.weight" else v for k, v in tensors.items()}
    save_file(changed, d / "n.safetensors")
    return d


@pytest.mark.parametrize("columns", [80, 200])
def test_ls_names_whole_and_last(ckpt, columns):
    status, out = in_terminal([*ZIPSLICE, "ls", "m.pt", "--sort", "name"], columns, ckpt)
    assert status == 0
    assert "\x1b[1m" in out  # the header is bold on a terminal
    assert all(line == line.rstrip() for line in ANSI.sub("", out).splitlines())  # not padded to the width
    lines = screen_lines(out, columns)
    assert lines[0].split() == ["dtype", "shape", "size", "offset", "name"]
    rows = lines[1:-1]
    assert [r.split()[-1] for r in rows] == ["layer.1.weight", "layer.2.weight", "layer.10.weight", LONG]
    assert rows[-1].endswith("  " + LONG)  # whole: longer than 80 columns, it wraps softly, never folded


@pytest.mark.parametrize("columns", [80, 200])
def test_diff_and_show_keep_names_whole(ckpt, columns):
    status, out = in_terminal([*ZIPSLICE, "diff", "m.pt", "n.safetensors", "--all"], columns, ckpt)
    assert status == 1  # they differ
    assert "━" in out  # stderr is the terminal too: a progress bar was drawn ...
    lines = screen_lines(out, columns)
    assert not any("━" in line for line in lines)  # ... and is gone from the screen
    names = [line.split()[-1] for line in lines[1:-1]]
    assert names == ["layer.1.weight", "layer.2.weight", "layer.10.weight", LONG]  # natural order
    assert lines[2].startswith("changed") and "12/12" in lines[2]
    status, out = in_terminal([*ZIPSLICE, "show", "m.pt", LONG], columns, ckpt)
    assert status == 0 and screen_lines(out, columns)[0] == LONG


@pytest.mark.parametrize("columns", [80, 200])
def test_help_fits_the_terminal(ckpt, columns):
    for prog in (ZIPSLICE, THETA):
        for sub in (["-h"], ["convert", "-h"] if prog is ZIPSLICE else ["merge-resolve", "-h"]):
            status, out = in_terminal([*prog, *sub], columns, ckpt)
            assert status == 0
            raw_lines = ANSI.sub("", out).splitlines()
            assert raw_lines[0].startswith("Usage: ")
            assert max(len(line) for line in raw_lines) <= min(columns, 100), out  # wrapped by us, to fit
            assert screen_rows(out, columns) == [line.rstrip() for line in raw_lines]  # so nothing wraps again


def test_pipes_get_plain_unpadded_lines(ckpt):
    out = in_pipe([*ZIPSLICE, "ls", "m.pt"], ckpt).stdout
    assert "\x1b" not in out
    lines = out.splitlines()
    assert all(line == line.rstrip() for line in lines)
    assert max(len(line) for line in lines) == max(len(line) for line in lines if LONG in line)  # as wide as the data
    help_text = in_pipe([*ZIPSLICE, "convert", "-h"], ckpt).stdout
    assert "\x1b" not in help_text and help_text.startswith("Usage: zipslice convert [OPTIONS] SRC DST\n")


def test_quiet_prints_only_rows(ckpt):
    out = in_pipe([*ZIPSLICE, "ls", "m.pt", "-q"], ckpt).stdout.splitlines()
    assert len(out) == 4 and out[-1].endswith(LONG)
    assert in_pipe([*ZIPSLICE, "-q", "diff", "m.pt", "m.pt"], ckpt).stdout == ""


def test_every_listing_has_json(ckpt):
    ls = json.loads(in_pipe([*ZIPSLICE, "ls", "m.pt", "--json", "--sort", "name"], ckpt).stdout)
    assert [t["name"] for t in ls["tensors"]][:3] == ["layer.1.weight", "layer.2.weight", "layer.10.weight"]
    assert ls["tensors"][0]["shape"] == [3, 4] and ls["total"]["tensors"] == 4
    show = json.loads(in_pipe([*ZIPSLICE, "show", "m.pt", "layer.2.weight", "--slice", "0, 1:3", "--json"],
                              ckpt).stdout)
    assert show["values"] == [2.0, 2.0] and show["slice_shape"] == [2] and show["stats"]["mean"] == 2.0
    diff = in_pipe([*ZIPSLICE, "diff", "m.pt", "n.safetensors", "--json"], ckpt)
    rep = json.loads(diff.stdout)
    assert diff.returncode == 1 and rep["counts"] == {"added": 0, "removed": 0, "changed": 1, "same": 3}
    assert [t["name"] for t in rep["tensors"]][:3] == ["layer.1.weight", "layer.2.weight", "layer.10.weight"]
    info = json.loads(in_pipe([*ZIPSLICE, "info", "m.pt", "--json"], ckpt).stdout)
    assert info["dtypes"]["float32"]["tensors"] == 3 and info["dtypes"]["bfloat16"]["nbytes"] == 8
    strategies = json.loads(in_pipe([*THETA, "merge-strategies", "--json"], ckpt).stdout)["strategies"]
    average = next(s for s in strategies if s["name"] == "average")
    assert average["parameters"] == {"alpha": 0.5} and average["needs_ancestor"] is False
