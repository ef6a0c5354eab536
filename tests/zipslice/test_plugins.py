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


def test_opening_a_torch_file_and_encoding_never_scan_the_entry_points(tmp_path):
    """What a `git add` needs (a torch file opened, update types and a merge strategy found) imports neither
    importlib.metadata nor anything it pulls in (~25 ms before git's first byte could be hashed)."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, path)
    out = _run(f"""
        import sys
        import zipslice, theta.updates, theta.merges
        with zipslice.load({str(path)!r}) as lsd:
            assert lsd.numpy("w").tolist() == [0, 1, 2, 3, 4, 5]
        for name in ("dense", "delta", "sparse", "rows", "ia3", "low-rank"):
            assert theta.updates.get(name).name == name
        assert theta.merges.get("ties").name == "ties"
        print(sorted(m for m in sys.modules if m.startswith(("importlib.metadata", "email"))))
    """)
    assert out.strip() == "[]"


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
        from theta.errors import UpdateTypeError
        try:
            theta.updates.get("nope")
        except UpdateTypeError as e:
            print(e)
    """, site)
    assert "unknown update type 'nope'; known: delta, dense, ia3, low-rank, rows, scale, sparse" in out
