"""zipslice.clistyle and zipslice.clihelp, the style both command lines share, and the reference docs generated
from them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zipslice import clihelp, clistyle

ROOT = Path(__file__).resolve().parents[2]


def test_natural_key_orders_numbers_by_value():
    names = ["layer.10.weight", "layer.2.weight", "layer.1.bias", "Layer.3", "layer.2.bias", "head", "layer.02.x"]
    assert sorted(names, key=clistyle.natural_key) == [
        "head", "layer.1.bias", "layer.2.bias", "layer.2.weight", "layer.02.x", "Layer.3", "layer.10.weight"]


def test_columns_never_pad_or_cut_the_last_column():
    lines = clistyle.columns([["dtype", "size", "name"], ["float32", "12 B", "a"], ["int8", "1.0 KiB", "b" * 300]],
                             right=(1,))
    assert lines == ["dtype       size  name", "float32     12 B  a", "int8     1.0 KiB  " + "b" * 300]


def test_printable_escapes_control_characters_only():
    assert clistyle.printable("layer.0\n\x1b[31mred\x7f") == "layer.0\\n\\x1b[31mred\\x7f"
    assert clistyle.printable("ünïcode name") == "ünïcode name"


def test_jsonable_is_strict_json():
    import numpy as np

    doc = clistyle.jsonable({"a": float("nan"), "b": (1, float("-inf")), 3: np.float32(0.5), "c": b"\xff"})
    assert json.loads(json.dumps(doc, allow_nan=False)) == {"a": "nan", "b": [1, "-inf"], "3": 0.5, "c": "\\xff"}


@pytest.mark.parametrize("width", [40, 80, 100])
def test_help_wraps_text_and_keeps_names_whole(width):
    doc = clihelp.CommandDoc(
        path="p c", usage="p c [OPTIONS] SRC", summary="A summary that is long enough to need wrapping " * 3,
        body=["    an example line that stays as it is, however long it is, because it is indented"],
        options=[clihelp.ParamDoc("--a-really-long-option-name-that-wont-fit VALUE", "what it does " * 6,
                                   "option"), clihelp.ParamDoc("-q, --quiet", "quiet", "option")])
    text = clihelp.render_help(doc, width=width)
    lines = text.splitlines()
    assert "  --a-really-long-option-name-that-wont-fit VALUE" in lines  # on its own line, whole
    assert "    an example line that stays as it is, however long it is, because it is indented" in text
    assert all(len(line) <= width for line in lines if "example line" not in line and "--a-really" not in line)


def test_reference_docs_and_man_pages_are_up_to_date():
    """docs/reference/cli.md and docs/man/*.1 are generated from the apps: regenerate after changing a command."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_cli_docs.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for heading in ("### `zipslice convert`", "### `git theta ls-files`", "`--shard-size SIZE`",
                    "Commands git runs (hidden from `git theta -h`)"):
        assert heading in reference
