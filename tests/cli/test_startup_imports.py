"""`git theta` starts without the numerical stack: its commands that need numpy import it when they run, so a
hook, `--version` or `--help` costs the interpreter and the command line only (numpy alone is ~0.3 s)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "torch", "safetensors", "h5py", "zstandard", "msgpack")


def modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_command_line_and_every_registered_command_import_no_numerical_module():
    loaded = modules_after("import theta.commands.app\ntheta.commands.app._register_areas()")
    assert "theta.commands.app" in loaded and "theta.commands.fsck" in loaded
    assert not {m.split(".")[0] for m in loaded} & set(HEAVY)


def test_the_entry_point_imports_neither_typer_nor_the_command_tree():
    """git waits for the filter's handshake: `git-theta filter-process` must not pay for the CLI."""
    loaded = modules_after("import theta.commands.cli")
    assert "theta.commands.cli" in loaded
    assert not {m.split(".")[0] for m in loaded} & {"typer", "click", "rich", *HEAVY}
    assert "theta.commands.app" not in loaded


def test_import_zipslice_alone_brings_no_numpy_until_a_checkpoint_is_opened():
    loaded = modules_after("import zipslice\nfrom zipslice import clistyle, progress")
    assert "numpy" not in loaded
    loaded = modules_after("import zipslice\nzipslice.LazyCheckpoint")
    assert "numpy" in loaded and "zipslice.base" in loaded


def test_a_clean_loads_neither_the_entry_points_nor_ml_dtypes_for_a_float32_checkpoint(tmp_path):
    """What every `git add` goes through before the first byte git sends can be used: the filter's modules, a
    torch file opened, the update types and a merge strategy found. Scanning the entry points (importlib.metadata
    and the email package it pulls in) and ml_dtypes cost ~35 ms there; they load only when needed."""
    path = tmp_path / "m.pt"
    loaded = modules_after(f"""
import numpy as np
import zipslice, theta.updates, theta.merges
import theta.commands.filter.process, theta.commands.hooks, theta.model.clean, theta.model.views, theta.updates.auto
zipslice.save({str(path)!r}, {{"w": np.arange(6, dtype="<f4")}}, format="torch")
with zipslice.load({str(path)!r}) as lsd:
    assert lsd.numpy("w").tolist() == [0, 1, 2, 3, 4, 5]
for name in ("dense", "delta", "sparse", "rows", "ia3", "low-rank"):
    assert theta.updates.get(name).name == name
assert theta.merges.get("ties").name == "ties"
""")
    assert "theta.model.clean" in loaded and "zipslice.torch_reader" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("email", "ml_dtypes") or m.startswith("importlib.metadata")}
    bf16 = modules_after("from zipslice import dtypes\nimport numpy as np\nimport ml_dtypes\n"
                         "assert dtypes.from_numpy(np.dtype(ml_dtypes.bfloat16)).name == 'bfloat16'\n"
                         "assert dtypes.from_numpy(np.dtype('>f4')).name == 'float32'")
    assert "ml_dtypes" in bf16


def test_the_hooks_git_runs_after_a_checkout_import_neither_typer_nor_the_command_tree(tmp_path):
    """post-checkout and post-index-change run after every checkout, switch, clone and reset: called as git calls
    them they go straight to their work (typer and the pydantic it imports took ~0.2 s of each), and with
    other arguments (``--help``) through the typer app."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    code = ("import sys\nfrom theta.commands.cli import main\n"
            "status = main(sys.argv[1:])\nprint(status)\nprint('\\n'.join(sys.modules))")
    for args in (["post-checkout", "0" * 40, "1" * 40, "1"], ["post-index-change", "1", "0"]):
        out = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, check=True).stdout.split()
        assert out[0] == "0"
        assert "theta.commands.filter.checkout_hooks" in out
        assert not {m.split(".")[0] for m in out} & {"typer", "click", "pydantic"}
        assert "theta.commands.app" not in out
    helped = subprocess.run([sys.executable, "-c", code, "post-checkout", "--help"], cwd=tmp_path,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert "Usage: git theta post-checkout" in helped.stdout and "typer" in helped.stdout.split()
