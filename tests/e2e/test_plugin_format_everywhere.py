"""The format plugin of docs/extending.md (docs/examples/npy_format.py), installed as a distribution declares it,
works wherever a built-in format does: `zipslice convert` writes it, `git theta export --to` writes it, and a
theta-tracked checkpoint is checked out in it with the ``theta-format`` attribute (a view: `git status` clean).

The plugin is "installed" the way pip would leave it: a ``*.dist-info`` with its ``zipslice.formats`` entry point
on PYTHONPATH, so every process (git's filter included) finds it through importlib.metadata.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from support.gitrepo import GitEnv

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture
def plugin_site(tmp_path) -> Path:
    site = tmp_path / "plugin-site"
    (site / "npy_plugin_dist").mkdir(parents=True)
    (site / "npy_plugin_dist" / "__init__.py").write_text(
        "from zipslice.formats import FormatSpec\n"
        "NPY = FormatSpec('npy', reader='npy_format:NpyCheckpoint', writer='npy_format:write',\n"
        "                 extensions=('.npy',), detect='npy_format:detect')\n")
    info = site / "npy_plugin_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: npy-plugin-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[zipslice.formats]\nnpy = npy_plugin_dist:NPY\n")
    return site


@pytest.fixture
def genv(tmp_path, plugin_site) -> GitEnv:
    env = GitEnv.create(tmp_path)
    env.env["PYTHONPATH"] = f"{env.env['PYTHONPATH']}:{plugin_site}:{EXAMPLES}"
    return env


def test_zipslice_convert_writes_a_plugin_format(genv, tmp_path):
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    save_file({"w": w}, str(tmp_path / "one.safetensors"))
    genv.run(["zipslice", "convert", str(tmp_path / "one.safetensors"), str(tmp_path / "w.npy")], cwd=tmp_path)
    assert np.load(tmp_path / "w.npy").tobytes() == w.tobytes()
    genv.run(["zipslice", "convert", str(tmp_path / "one.safetensors"), str(tmp_path / "w.data"), "--to", "npy"],
             cwd=tmp_path)
    assert np.load(tmp_path / "w.data").tobytes() == w.tobytes()
    bad = genv.run(["zipslice", "convert", str(tmp_path / "one.safetensors"), str(tmp_path / "x"), "--to", "nope"],
                   cwd=tmp_path, check=False)
    assert bad.returncode == 2 and b"npy" in bad.stderr  # the choices listed come from the registry


def test_a_plugin_format_is_committed_diffed_and_checked_out(genv):
    """A .npy file tracked by theta: cleaned through the plugin's reader, rebuilt through its writer."""
    repo = genv.init("work", theta=True, track=("*.npy",))
    rng = np.random.default_rng(1)
    v1 = rng.standard_normal((256, 64)).astype(np.float32)
    np.save(repo.path / "emb.npy", v1)
    repo.git("add", ".gitattributes", "emb.npy")
    repo.git("commit", "-qm", "v1")
    v2 = v1.copy()
    v2[:8] += 1
    np.save(repo.path / "emb.npy", v2)
    repo.git("commit", "-qam", "v2")
    assert b"format npy" in repo.git("show", "HEAD:emb.npy").stdout or b"npy" in repo.git("show", "HEAD:emb.npy").stdout
    repo.git("checkout", "-q", "HEAD~1")
    assert np.load(repo.path / "emb.npy").tobytes() == v1.tobytes()
    repo.git("checkout", "-q", "-")
    assert np.load(repo.path / "emb.npy").tobytes() == v2.tobytes()
    assert repo.git("status", "--porcelain").stdout == b""


def test_a_tracked_checkpoint_exports_and_checks_out_in_a_plugin_format(genv):
    import torch

    repo = genv.init("work", theta=True)
    w = torch.randn(128, 64)
    torch.save({"array": w}, repo.path / "model.pt")  # the one name a .npy file can hold
    torch.save({"w": w, "b": torch.zeros(64)}, repo.path / "two.pt")
    torch.save({"w": w}, repo.path / "named.pt")
    repo.git("add", ".gitattributes", "model.pt", "two.pt", "named.pt")
    repo.git("commit", "-qm", "base")
    out = repo.path.parent / "exported.npy"
    repo.theta("export", "HEAD:model.pt", str(out), "--to", "npy")
    assert np.load(out).tobytes() == w.numpy().tobytes()

    with open(repo.path / ".gitattributes", "a") as f:
        f.write("model.pt theta-format=npy\ntwo.pt theta-format=npy\nnamed.pt theta-format=npy\n")
    repo.git("commit", "-qam", "view both as npy")
    (repo.path / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt")
    assert (repo.path / "model.pt").read_bytes()[:6] == b"\x93NUMPY"
    assert np.load(repo.path / "model.pt").tobytes() == w.numpy().tobytes()
    assert repo.git("status", "--porcelain").stdout == b""

    # what the plugin cannot hold is refused, naming the file: two tensors (its writer refuses), or a name it
    # cannot spell (theta reads back what it wrote); nothing is left under the file's name
    (repo.path / "two.pt").unlink()
    failed = repo.git("checkout", "--", "two.pt", check=False)
    assert failed.returncode != 0
    assert b"cannot write two.pt as npy: two.pt: a .npy file holds one array, got 2 tensors" in failed.stderr
    assert not (repo.path / "two.pt").exists()
    (repo.path / "named.pt").unlink()
    failed = repo.git("checkout", "--", "named.pt", check=False)
    assert failed.returncode != 0
    assert b"named.pt: format 'npy' cannot hold this checkpoint as it is committed (group 'w'" in failed.stderr
    assert not (repo.path / "named.pt").exists()
