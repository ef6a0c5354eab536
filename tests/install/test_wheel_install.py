"""A user install, as a user does it: build the wheel, install it into a fresh virtual environment with no
extras (so no torch, no test dependencies) and run every command there, with only that environment's bin
directory and the system's on PATH (no PYTHONPATH: the checkout is invisible).

The dependencies come from the package index (pip's cache makes later runs quick). The checkpoints are
made by this test process (with torch); the installed commands only read and write them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import h5py
import numpy as np
import pytest
import safetensors.torch
import torch

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PATH = ["/usr/local/bin", "/usr/bin", "/bin"]


def _copy_sources(dest: Path) -> None:
    """What the build needs, from the working tree (uncommitted changes included; nothing is written into it)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for top in ROOT.iterdir():
        if top.is_dir() and any(Path(top.name).match(p.rstrip("*") + "*") for p in patterns) \
                and (top / "__init__.py").exists():
            shutil.copytree(top, dest / top.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for files in project["tool"]["setuptools"].get("data-files", {}).values():
        for f in files:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)


class Installed:
    """A fresh virtual environment with the wheel installed, and a clean environment to run commands in."""

    def __init__(self, base: Path):
        self.base = base
        src, dist, self.venv = base / "src", base / "dist", base / "venv"
        src.mkdir()
        _copy_sources(src)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(dist), str(src)], check=True, capture_output=True)
        self.wheel = next(dist.glob("*.whl"))
        # a bare venv, filled by this interpreter's pip (--python): no ensurepip run, no .pyc compile pass
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True, capture_output=True)
        pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.venv / "bin" / "python"), "install",
                              "-q", "--no-compile", "--disable-pip-version-check", str(self.wheel)],
                             capture_output=True, text=True)
        assert pip.returncode == 0, pip.stderr
        home = base / "home"
        home.mkdir()
        lfs = shutil.which("git-lfs")
        path = [str(self.venv / "bin"), *SYSTEM_PATH] + ([str(Path(lfs).parent)] if lfs else [])
        self.env = {
            "PATH": os.pathsep.join(dict.fromkeys(path)), "HOME": str(home), "LANG": "C.UTF-8",
            "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "T", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "T",
            "GIT_COMMITTER_EMAIL": "t@example.com", "PAGER": "cat", "MANPAGER": "cat", "MANWIDTH": "100",
            "GIT_TERMINAL_PROMPT": "0",
        }

    def run(self, *args: str, cwd: Path | None = None, ok: bool = True, status: int | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), cwd=cwd or self.base, env=self.env, capture_output=True, text=True,
                              input=input if input is not None else "", timeout=300)
        expected = status if status is not None else (0 if ok else None)
        if expected is not None:
            assert proc.returncode == expected, (f"{' '.join(args)} exited {proc.returncode}:\n"
                                                 f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc


@pytest.fixture(scope="module")
def inst(tmp_path_factory) -> Installed:
    return Installed(tmp_path_factory.mktemp("user-install"))


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 16, generator=g), "layer.2.weight": torch.randn(16, 16, generator=g),
            "layer.10.weight": torch.randn(16, 16, generator=g), "head.bias": torch.zeros(8, dtype=torch.bfloat16)}


def test_installed_without_torch_or_the_checkout(inst):
    py = str(inst.venv / "bin" / "python")
    assert inst.run(py, "-c", "import importlib.util as u; print(u.find_spec('torch'))").stdout.strip() == "None"
    where = inst.run(py, "-c", "import zipslice, theta; print(zipslice.__file__); print(theta.__file__)")
    assert all(str(inst.venv) in line for line in where.stdout.split())  # the installed copy, not the checkout
    v = inst.run(py, "-c", "import zipslice, theta; print(zipslice.__version__, theta.__version__)").stdout.split()
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert v == [meta, meta]
    assert inst.run("zipslice", "--version").stdout == f"zipslice {meta}\n"
    assert inst.run("git", "theta", "--version").stdout == f"git-theta {meta}\n"
    assert inst.run("git-theta-filter", "--version").stdout == f"git-theta-filter {meta}\n"


def test_help_everywhere(inst):
    for prog in (["zipslice"], ["git", "theta"]):
        top = inst.run(*prog, "-h").stdout
        assert top.startswith(f"Usage: {' '.join(prog)} [OPTIONS] COMMAND")
        section = top.split("Commands:\n", 1)[1].splitlines()
        names = [line.split()[0] for line in section if line.startswith("  ") and not line.startswith("   ")]
        for internal in ("filter-process", "clean", "smudge", "pre-push", "merge-driver", "diff-driver"):
            assert internal not in names
        for name in ("ls", "show", "info", "convert", "diff") if prog == ["zipslice"] else (
                "install", "track", "ls-files", "export", "diff", "merge-resolve", "help"):
            assert name in names
            out = inst.run(*prog, name, "-h").stdout
            assert out.startswith(f"Usage: {' '.join(prog)} {name}"), out
    assert inst.run("zipslice", "convert", "--help").stdout.startswith("Usage: zipslice convert [OPTIONS] SRC DST")
    assert inst.run("git", "theta", "help", "ls-files").stdout == inst.run("git", "theta", "ls-files", "-h").stdout
    filt = inst.run("git-theta-filter", "--help").stdout
    assert filt.startswith("Usage: git-theta-filter") and "git theta install" in filt


MAN_LINE = "version ML checkpoints in git, parameter group by parameter group"  # docs/man/git-theta.1's NAME


def _need_man(inst) -> None:
    if shutil.which("man", path=inst.env["PATH"]) is None:
        pytest.skip("no man(1) on this machine (apt-get install man-db): git help cannot show any page")


def _shows_the_manual(inst) -> None:
    for args in (["git", "theta", "--help"], ["git", "help", "theta"]):
        out = inst.run(*args).stdout
        assert "GIT-THETA(1)" in out and MAN_LINE in out and "git theta ls-files" in out, args
    assert "ZIPSLICE(1)" in inst.run("man", "zipslice").stdout


def test_git_help_finds_the_man_page(inst):
    """git turns `git theta --help` into `man git-theta`: the page ships in the wheel (share/man/man1), where
    man finds it (beside the venv's bin directory on PATH); `git theta install` then has nothing to add, and
    `git theta uninstall` leaves pip's pages alone."""
    _need_man(inst)
    _shows_the_manual(inst)
    # after a command, git passes --help through to git-theta: the command's own help
    assert inst.run("git", "theta", "ls-files", "--help").stdout.startswith("Usage: git theta ls-files")
    pages = inst.venv / "share" / "man" / "man1"
    before = {p.name: p.read_bytes() for p in pages.iterdir()}
    installed = inst.run("git", "theta", "install")
    assert "man page" not in installed.stdout and installed.stderr == ""
    removed = inst.run("git", "theta", "uninstall").stdout
    assert "man page" not in removed
    assert {p.name: p.read_bytes() for p in pages.iterdir()} == before
    _shows_the_manual(inst)


def test_an_editable_install_gets_its_manual_from_git_theta_install(inst, tmp_path):
    """pip installs no data files for an editable install: `git theta --help` finds no manual until `git theta
    install` writes the pages beside the environment's bin directory; `git theta uninstall` removes them. (The
    module's venv becomes an editable install of the sources for this test, then the wheel's again.)"""
    _need_man(inst)
    built = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                            "print(b.build_editable(sys.argv[1]))", str(tmp_path)],
                           cwd=inst.base / "src", check=True, capture_output=True, text=True)
    editable = tmp_path / built.stdout.split()[-1]
    pip = [sys.executable, "-m", "pip", "--python", str(inst.venv / "bin" / "python"), "install", "-q",
           "--no-compile", "--disable-pip-version-check", "--no-deps", "--force-reinstall"]
    subprocess.run(pip + [str(editable)], check=True, capture_output=True)
    try:
        py = str(inst.venv / "bin" / "python")
        where = inst.run(py, "-c", "import theta; print(theta.__file__)").stdout
        assert where.startswith(str(inst.base / "src"))  # the sources, not a copy in site-packages
        pages = inst.venv / "share" / "man" / "man1"
        assert not (pages / "git-theta.1").exists()  # (pip removed the wheel's pages, and left no other)
        before = sorted(inst.venv.glob("share/**/*"))
        assert "No manual entry for git-theta" in inst.run("git", "theta", "--help", ok=False).stderr
        out = inst.run("git", "theta", "install")
        assert f"wrote the man pages git-theta.1, zipslice.1 in {pages}" in out.stdout.splitlines()
        assert out.stderr == ""  # (no warning: man shows the page just written)
        _shows_the_manual(inst)
        assert inst.run("git", "theta", "install").stdout == "git-theta is already installed\n"
        removed = inst.run("git", "theta", "uninstall").stdout.splitlines()
        assert f"removed the man page {pages / 'git-theta.1'}" in removed
        assert f"removed the man page {pages / 'zipslice.1'}" in removed
        assert sorted(inst.venv.glob("share/**/*")) == before  # what install made (pages, directories) is gone
        assert not (Path(inst.env["HOME"]) / ".local" / "share" / "git-theta").exists()
    finally:
        subprocess.run(pip + [str(inst.wheel)], check=True, capture_output=True)


def test_zipslice_commands(inst, tmp_path):
    sd = _state(0)
    torch.save({"model": sd, "step": 3}, tmp_path / "m.pt")
    z = lambda *a, **k: inst.run("zipslice", *a, cwd=tmp_path, **k)  # noqa: E731
    listing = json.loads(z("ls", "m.pt", "--json").stdout)
    assert [t["name"] for t in listing["tensors"]] == [f"model/{k}" for k in sd]
    names = z("ls", "m.pt", "--sort", "name", "-q").stdout.split("\n")
    assert [line.split()[-1] for line in names if line] == [
        "model/embed.weight", "model/head.bias", "model/layer.2.weight", "model/layer.10.weight"]
    info = json.loads(z("info", "m.pt", "--json").stdout)
    assert info["format"] == "torch" and info["tensors"] == 4 and info["values"] == {"step": 3}
    shown = json.loads(z("show", "m.pt", "model/layer.2.weight", "--rows", "1:3", "--json").stdout)
    assert shown["values"] == sd["layer.2.weight"][1:3].tolist()
    z("convert", "m.pt", "m.safetensors", "-q")
    z("convert", "m.pt", "m.h5", "--dtype", "float16")
    z("convert", "m.safetensors", "s.safetensors.index.json", "--shard-size", "2KiB")
    assert len(list(tmp_path.glob("s-0000*-of-*.safetensors"))) > 1
    same = json.loads(z("diff", "m.safetensors", "s.safetensors.index.json", "--json", ok=False).stdout)
    assert same["counts"] == {"added": 0, "removed": 0, "changed": 0, "same": 4}
    # same tensors and values ("step" is kept in the safetensors layout metadata, not a value zipslice compares)
    assert json.loads(z("diff", "m.pt", "m.safetensors", "--json", ok=False).stdout)["counts"]["same"] == 4
    changed = z("diff", "m.pt", "m.h5", "--json", status=1)
    assert json.loads(changed.stdout)["counts"]["changed"] == 4  # every tensor is floating: all cast to float16
    err = z("convert", "m.pt", "x.npz", status=2).stderr
    assert "--to" in err and "format=" not in err
    assert "_zipslice_completion" in z("completion", "bash").stdout


def test_git_theta_commands(inst, tmp_path):
    repo = tmp_path / "repo"
    g = lambda *a, **k: inst.run("git", *a, cwd=repo, **k)  # noqa: E731
    inst.run("git", "init", "-q", "-b", "main", str(repo))
    assert "filter.theta.process" in g("theta", "install", "--local").stdout
    assert g("theta", "track", "*.pt").stdout == "Tracking *.pt\n"
    torch.save(_state(0), repo / "m.pt")
    g("theta", "add", "m.pt", ".gitattributes")
    g("commit", "-q", "-m", "base")
    files = json.loads(g("theta", "ls-files", "--json").stdout)["files"]
    assert [(f["path"], f["groups"], f["local"]) for f in files] == [("m.pt", 4, True)]
    # two branches change the same group: a conflict, resolved with a strategy
    g("checkout", "-q", "-b", "other")
    theirs = _state(0)
    theirs["layer.2.weight"] += 1
    torch.save(theirs, repo / "m.pt")
    diff = json.loads(g("theta", "diff", "--json").stdout)["files"][0]
    assert diff["path"] == "m.pt" and [x["name"] for x in diff["groups"]] == ["layer.2.weight"]
    g("commit", "-q", "-am", "theirs")
    g("checkout", "-q", "main")
    ours = _state(0)
    ours["layer.2.weight"] -= 1
    torch.save(ours, repo / "m.pt")
    g("commit", "-q", "-am", "ours")
    g("merge", "other", ok=False)
    written = g("theta", "merge-manual", "m.pt").stdout.split()
    assert sorted(Path(w).name for w in written) == ["m.ancestor.pt", "m.ours.pt", "m.theirs.pt"]
    g("theta", "merge-resolve", "m.pt", "--strategy", "average", "-q")
    g("commit", "-q", "-m", "merged")
    merged = json.loads(inst.run("zipslice", "diff", str(repo / "m.pt"), str(repo / "m.ancestor.pt"), "--json",
                                 cwd=repo, ok=False).stdout)
    assert all(float(t["max_abs_diff"] or 0) < 1e-6 for t in merged["tensors"])  # (ours + theirs) / 2 == base
    g("theta", "export", "HEAD~1:m.pt", "old.safetensors", "--to", "safetensors", "-q")
    assert "layer.2.weight" in inst.run("zipslice", "ls", str(repo / "old.safetensors"), cwd=repo).stdout
    assert "self-contained" in g("theta", "squash", "m.pt").stdout
    assert "average" in g("theta", "merge-strategies").stdout
    assert "_git_theta()" in g("theta", "completion", "bash").stdout
    bad = g("theta", "merge-resolve", "m.pt", "--strategy", "average", "-p", "alpha", status=2).stderr
    assert "--param" in bad and "NAME=VALUE" in bad
    png = g("theta", "log", "--png", str(tmp_path / "h.png"), "--", "m.pt", status=1).stderr
    assert png == ("git theta: error: matplotlib is not installed, and --png needs it: "
                   'pip install "zipslice-theta[plot]"\n')
    assert not (tmp_path / "h.png").exists()


NO_TORCH = 'torch is not installed, and lsd[key] returns torch tensors: pip install "zipslice-theta[torch]" ' \
           '(without torch, lsd.numpy(key) and lsd.get_slice(key, framework="np")[...] return numpy arrays)'

# Every public accessor, in the environment without torch: each either reads numpy arrays, or fails with one
# line naming the extra (a MissingDependencyError, which is a ModuleNotFoundError). Prints JSON.
ACCESSORS = r"""
import json, os, sys
import numpy as np
import zipslice, theta
from zipslice.errors import MissingDependencyError

def fails(f):
    try:
        f()
    except MissingDependencyError as e:
        assert isinstance(e, ModuleNotFoundError) and "\n" not in str(e), repr(e)
        return [e.name, str(e)]
    return None

out = {}
for path in sys.argv[1:-2]:
    with zipslice.load(path) as lsd:
        out[path] = {
            "names": list(lsd),
            "w": lsd.numpy("w").tolist(), "b": lsd.numpy("b").astype(np.float32).tolist(),
            "b_dtype": str(lsd.numpy("b").dtype),
            "rows": lsd.get_slice("w", framework="np")[1:3].tolist(),
            "raw": lsd.get_slice("b").raw(slice(0, 2)).tolist(),
            "shape": lsd.get_slice("w").get_shape(),
            "getitem": fails(lambda: lsd["w"]), "tensor": fails(lambda: lsd.tensor("w")),
            "slice": fails(lambda: lsd.get_slice("w")[0]), "items": fails(lambda: dict(lsd.items())),
            "values": fails(lambda: list(lsd.values())),
            "extras": {k: v for k, v in lsd.extras.items()},
        }
repo, blob = sys.argv[-2:]
os.chdir(repo)
sd = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.full(3, 0.5, dtype=np.float16)}
sha = theta.save_to_git(sd, "n.pt", "numpy arrays, no torch")
with theta.load_from_git(sha, "n.pt") as lsd:
    out["load_from_git"] = {"w": lsd.numpy("w").tolist(), "rows": lsd.get_slice("w", framework="np")[2].tolist(),
                            "getitem": fails(lambda: lsd["w"])}
with theta.load("n.pt", rev="HEAD") as lsd:
    out["theta.load"] = {"b": lsd.numpy("b").tolist(), "getitem": fails(lambda: lsd["b"])}
with zipslice.load("HEAD:n.pt") as lsd:
    out["REV:PATH"] = {"w": lsd.numpy("w").sum().item(), "slice": fails(lambda: lsd.get_slice("w")[0])}
out["tempo"] = fails(lambda: __import__("tempo"))
out["callback"] = fails(lambda: theta.ThetaTrainerCallback)
from theta.peers.gittheta import blobs as gt_blobs
out["zarr"] = fails(lambda: gt_blobs.decode_group_blob(open(blob, "rb").read()))
print(json.dumps(out))
"""


def test_every_accessor_reads_numpy_or_names_the_extra(inst, tmp_path):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 3, generator=g), torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    torch.save({"w": w, "b": b, "step": 3, "size": torch.Size([2, 3])}, tmp_path / "m.pt")
    safetensors.torch.save_file({"w": w, "b": b}, str(tmp_path / "m.safetensors"))
    with h5py.File(tmp_path / "m.h5", "w") as f:
        f["w"], f["b"] = w.numpy(), b.float().numpy()
    repo = tmp_path / "repo"
    inst.run("git", "init", "-q", "-b", "main", str(repo))
    inst.run("git", "theta", "install", "--local", cwd=repo)
    blob = sorted((ROOT / "fixtures" / "git_theta" / "lfs" / "objects").glob("*/*/*"))[0]
    files = [str(tmp_path / n) for n in ("m.pt", "m.safetensors", "m.h5")]
    out = json.loads(inst.run(str(inst.venv / "bin" / "python"), "-c", ACCESSORS, *files, str(repo), str(blob),
                              cwd=tmp_path).stdout)
    torch_only = ["torch", NO_TORCH]
    slice_only = ["torch", 'torch is not installed, and get_slice(key)[...] returns torch tensors: pip install '
                           '"zipslice-theta[torch]" (without torch, get_slice(key, framework="np")[...] returns '
                           'numpy arrays)']
    for path in files:
        got = out[path]
        assert got["w"] == w.tolist() and got["rows"] == w[1:3].tolist() and got["shape"] == [4, 3], path
        assert got["b"] == [1.5, -2.0]
        assert got["b_dtype"] == ("bfloat16" if not path.endswith(".h5") else "float32")
        assert got["getitem"] == got["tensor"] == got["items"] == got["values"] == torch_only, path
        assert got["slice"] == slice_only, path
    assert out[files[0]]["raw"] == b.view(torch.int16).numpy().view("uint16").tolist()
    assert out[files[0]]["extras"] == {"step": 3, "size": {"torch": "size", "value": [2, 3]}}
    assert out["load_from_git"] == {"w": np.arange(12).reshape(3, 4).tolist(), "rows": [8, 9, 10, 11],
                                    "getitem": torch_only}
    assert out["theta.load"] == {"b": [0.5, 0.5, 0.5], "getitem": torch_only}
    assert out["REV:PATH"] == {"w": 66.0, "slice": slice_only}
    assert out["tempo"] == ["torch", 'torch is not installed, and tempo needs it: pip install "zipslice-theta[tempo]"']
    assert out["callback"] == ["transformers", "transformers is not installed, and theta.ThetaTrainerCallback "
                                               'needs it: pip install "zipslice-theta[hf]"']
    assert out["zarr"] == ["zarr", "zarr is not installed, and reading Git-Theta's parameter blobs needs zarr >= "
                                   '3.1: pip install "zipslice-theta[gittheta]"']
