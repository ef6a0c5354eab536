"""Built-in formats, update types and merge strategies are found without scanning the entry points; plugins
still are, and cannot take a built-in's name (zipslice.plugins)."""
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from support import ROOT

import theta.merges
import theta.updates
from zipslice import formats

DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]


@pytest.mark.parametrize("group, builtins", [
    ("theta.updates", theta.updates._REGISTRY.builtins),
    ("theta.merges", theta.merges._REGISTRY.builtins),
])
def test_the_builtins_are_the_entry_points_pyproject_declares(group, builtins):
    assert {name: b.value for name, b in builtins.items()} == DECLARED[group]


def test_the_builtin_formats_are_the_entry_points_pyproject_declares():
    declared = {name: ref for name, ref in DECLARED["zipslice.formats"].items() if ref.startswith("zipslice.")}
    assert set(declared) == set(formats.BUILTIN)
    for name, ref in declared.items():
        assert getattr(formats, ref.removeprefix("zipslice.formats:")) is formats.BUILTIN[name]


def _run(code: str, site=None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site or ""), str(ROOT),
                                                                   os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          check=True).stdout


def _site(tmp_path, entries: dict) -> os.PathLike:
    info = tmp_path / "site" / "plugin_dist-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) for group, names in entries.items()))
    (tmp_path / "site" / "plugin_mod.py").write_text(textwrap.dedent("""
        from theta.updates.dense import DenseUpdate
        from zipslice.formats import FormatSpec

        class Scale(DenseUpdate):
            name = "scale"

        class Impostor(DenseUpdate):
            name = "impostor"

        FORMAT = FormatSpec("npy-plugin", "zipslice.torch_reader:TorchCheckpoint")
        TORCH = FormatSpec("torch", "zipslice.safetensors_format:SafetensorsCheckpoint")
    """))
    return tmp_path / "site"


def test_plugins_are_found_and_cannot_take_a_builtins_name(tmp_path):
    site = _site(tmp_path, {
        "theta.updates": {"scale": "plugin_mod:Scale", "delta": "plugin_mod:Impostor"},
        "zipslice.formats": {"npy-plugin": "plugin_mod:FORMAT", "torch": "plugin_mod:TORCH"},
    })
    out = _run("""
        import theta.updates
        from zipslice import formats
        print(theta.updates.get("scale").name, theta.updates.get("delta").name, ",".join(theta.updates.names()))
        print(formats.get("npy-plugin").name, formats.get("torch").reader, formats.registry()["torch"].reader)
    """, site).splitlines()
    assert out[0] == "scale delta delta,dense,ia3,low-rank,rows,scale,sparse"
    assert out[1] == ("npy-plugin zipslice.torch_reader:TorchCheckpoint zipslice.torch_reader:TorchCheckpoint")


def test_an_unknown_name_lists_the_builtins_and_the_plugins(tmp_path):
    site = _site(tmp_path, {"theta.updates": {"scale": "plugin_mod:Scale"}})
    out = _run("""
        import theta.updates
        from theta.base.errors import UpdateTypeError
        try:
            theta.updates.get("nope")
        except UpdateTypeError as e:
            print(e)
    """, site)
    assert "unknown update type 'nope'; known: delta, dense, ia3, low-rank, rows, scale, sparse" in out
