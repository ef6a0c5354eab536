"""User errors in the command line's own terms, one line (usage errors: plus a hint to -h), never a traceback;
every case of a malformed command line, and the help, version and completion entry points. In-process where possible."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.gitrepo import GitEnv
from theta.commands import cli as theta_cli
from zipslice import cli as zipslice_cli

ROOT = Path(__file__).resolve().parents[2]


def zipslice(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        zipslice_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def theta(capsys, *argv) -> tuple[int, str, str]:
    code = theta_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def pt(tmp_path) -> Path:
    torch.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}, tmp_path / "m.pt")
    return tmp_path / "m.pt"


def _one_error(err: str, prefix: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert lines[0].startswith(prefix), err
    return lines[0]


# -- malformed command lines --------------------------------------------------------------------------------

def test_unknown_output_format_names_the_flag(capsys, pt, tmp_path):
    code, out, err = zipslice(capsys, "convert", pt, tmp_path / "x.npz")
    line = _one_error(err, "zipslice convert: error: ")
    assert code == 2 and out == "" and "--to torch|safetensors|hdf5|sharded" in line and "format=" not in line
    assert err.splitlines()[1] == "Try 'zipslice convert -h' for help."


def test_missing_output_directory_names_the_output_not_a_temp_file(capsys, pt, tmp_path):
    dst = tmp_path / "no" / "such" / "out.safetensors"
    code, _, err = zipslice(capsys, "convert", pt, dst)
    line = _one_error(err, "zipslice: error: ")
    assert code == 2 and err.count("\n") == 1
    assert line == f"zipslice: error: {dst}: cannot write it: no directory {str(dst.parent)!r}"
    assert ".tmp" not in err and not dst.parent.exists()


def test_bad_dtype_is_one_line_not_a_validation_dump(capsys, pt, tmp_path):
    code, _, err = zipslice(capsys, "convert", pt, tmp_path / "x.pt", "--dtype", "int8")
    assert code == 2 and err.splitlines() == [
        "zipslice convert: error: Invalid value for '--dtype': 'int8' is not a dtype to cast to; choose one of "
        "bfloat16, float16, float32", "Try 'zipslice convert -h' for help."]


def test_sharded_output_through_the_cli(capsys, pt, tmp_path):
    code, out, err = zipslice(capsys, "convert", pt, tmp_path / "s.safetensors.index.json", "--shard-size", "20B")
    assert code == 0 and out == "" and "sharded, 2 tensors" in err
    shards = sorted(p.name for p in tmp_path.glob("s-*.safetensors"))
    assert shards == ["s-00001-of-00002.safetensors", "s-00002-of-00002.safetensors"]
    assert zipslice(capsys, "diff", pt, tmp_path / "s.safetensors.index.json", "-q")[0] == 0
    for argv, message in [
        (["--shard-size", "lots"], "'lots' is not a size"),
        (["--to", "safetensors", "--shard-size", "1MB"], "only for a sharded output"),
    ]:
        code, _, err = zipslice(capsys, "convert", pt, tmp_path / "t.safetensors", *argv)
        assert code == 2 and message in _one_error(err, "zipslice convert: error: ")
    code, _, err = zipslice(capsys, "convert", pt, tmp_path / "t.safetensors", "--to", "sharded")
    assert code == 2 and "written through its index" in err


def test_filter_help_and_misuse_without_traceback():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = lambda *a, stdin=subprocess.DEVNULL: subprocess.run(  # noqa: E731
        [sys.executable, "-c", "import sys; from theta.commands.cli import filter_main; sys.exit(filter_main())",
         *a], env=env, capture_output=True, text=True, stdin=stdin, timeout=60)
    for flag in ("-h", "--help"):
        r = run(flag)
        assert r.returncode == 0 and r.stdout.startswith("Usage: git-theta-filter") and r.stderr == ""
    r = run("--bogus")
    assert r.returncode == 2 and r.stderr.startswith("git-theta-filter: error: unexpected argument '--bogus'")
    r = run()  # stdin ends before git's handshake
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "handshake" in r.stderr and "Traceback" not in r.stderr


def test_merge_resolve_names_its_own_flags(tmp_path):
    """`merge-resolve --strategy` is reported as --strategy (it used to say the environment variable)."""
    genv = GitEnv.create(tmp_path)
    repo = genv.init("r")
    torch.save({"w": torch.zeros(4), "n": torch.tensor([1, 2])}, repo / "m.pt")
    repo.commit("base", "m.pt", ".gitattributes")
    repo.git("checkout", "-q", "-b", "other")
    torch.save({"w": torch.ones(4), "n": torch.tensor([1, 3])}, repo / "m.pt")
    repo.commit("theirs", "m.pt")
    repo.git("checkout", "-q", "main")
    torch.save({"w": torch.full((4,), 2.0), "n": torch.tensor([1, 4])}, repo / "m.pt")
    repo.commit("ours", "m.pt")
    repo.git("merge", "other", check=False, extra_env={"GIT_THETA_MERGE_INTERACTIVE": "0"})
    r = repo.theta("merge-resolve", "m.pt", "--strategy", "average", check=False)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err
    assert "(from --strategy)" in err and "GIT_THETA_MERGE_STRATEGY" not in err  # an int group cannot be averaged
    r = repo.theta("merge-resolve", "m.pt", "--strategy", "average", "-p", "alpha=lots", check=False)
    assert r.returncode == 1 and "--param alpha=lots" in r.stderr.decode()
    r = repo.theta("merge-resolve", "m.pt", "--strategy", "average", "-p", "densty=0.3", check=False)
    assert r.returncode == 1 and "unknown merge parameter --param densty" in r.stderr.decode()


# -- no traceback for any user error ------------------------------------------------------------------

@pytest.mark.parametrize("argv, status, message", [
    (["ls", "{tmp}/missing.pt"], 2, "missing.pt: No such file or directory"),
    (["show", "{pt}", "nope"], 2, "no tensor named 'nope'"),
    (["show", "{pt}", "w", "--rows", "2"], 2, "'2' is not a row range; write A:B"),
    (["show", "{pt}", "w", "--slice", "1:2:3:4"], 2, "is not an index"),
    (["show", "{pt}", "w", "--slice", "9"], 2, "index 9 is out of bounds for dimension 0 of size 3"),
    (["show", "{pt}", "w", "--rows", "0:1", "--slice", "0"], 2, "give --rows or --slice, not both"),
    (["show", "{pt}"], 2, "missing argument NAME"),
    (["ls", "{pt}", "--sort", "size,name"], 2, "is not a sort order; choose one of file, name, size"),
    (["nonsense"], 2, "No such command 'nonsense'"),
    (["ls", "{pt}", "--colour"], 2, "No such option: --colour"),
    (["completion", "tcsh"], 2, "'tcsh' is not a shell; choose one of bash, zsh, fish"),
])
def test_zipslice_user_errors(capsys, pt, tmp_path, argv, status, message):
    code, out, err = zipslice(capsys, *[a.format(tmp=tmp_path, pt=pt) for a in argv])
    assert code == status and out == ""
    assert message in _one_error(err, "zipslice")


@pytest.mark.parametrize("argv, status, message", [
    (["ls-files"], 1, "git theta: error: "),                      # not in a repository
    (["export", "HEAD:m.pt"], 2, "missing argument OUT"),
    (["export", "HEAD:m.pt", "o.pt", "--to", "npz"], 2, "'npz' is not a format"),
    (["add", "m.pt", "-o", "novalue"], 2, "Invalid value for '--option': expected KEY=VALUE, got 'novalue'"),
    (["merge-resolve", "m.pt", "-s", "ties", "-p", "density"], 2, "expected NAME=VALUE, got 'density'"),
    (["help", "nonsense"], 2, "no command 'nonsense'"),
    (["frobnicate"], 2, "No such command 'frobnicate'"),
])
def test_theta_user_errors(capsys, tmp_path, monkeypatch, argv, status, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    code, out, err = theta(capsys, *argv)
    assert code == status and out == ""
    assert message in _one_error(err, "git theta")


# -- help, version, completion -----------------------------------------------------------------------

def test_no_command_prints_the_help(capsys):
    code, out, err = zipslice(capsys)
    assert code == 2 and out.startswith("Usage: zipslice [OPTIONS] COMMAND") and err == ""
    code, out, err = theta(capsys)
    assert code == 2 and out.startswith("Usage: git theta [OPTIONS] COMMAND") and "ls-files" in out and err == ""


def test_versions(capsys):
    from zipslice.version import package_version

    v = package_version()
    assert zipslice(capsys, "--version")[1] == f"zipslice {v}\n"
    assert theta(capsys, "--version")[1] == f"git-theta {v}\n"
    import theta as theta_pkg
    import zipslice as zipslice_pkg
    assert zipslice_pkg.__version__ == theta_pkg.__version__ == v and v[0].isdigit()


def test_help_everywhere_and_internal_commands_hidden(capsys):
    code, out, _ = theta(capsys, "-h")
    listed = [line.split()[0] for line in out.split("Commands:\n")[1].splitlines() if line.startswith("  ")
              and not line.startswith("   ")]
    assert {"install", "track", "ls-files", "export", "diff", "help", "completion", "merge-resolve"} <= set(listed)
    assert not set(listed) & set(theta_cli._INTERNAL)
    for name in listed:
        for flag in ("-h", "--help"):
            code, text, err = theta(capsys, name, flag)
            assert code == 0 and text.startswith(f"Usage: git theta {name}") and err == "", name
        assert theta(capsys, "help", name)[1] == theta(capsys, name, "-h")[1]
    for name in theta_cli._INTERNAL:  # hidden, still documented for whoever looks
        code, text, _ = theta(capsys, "help", name)
        assert code == 0 and text.startswith(f"Usage: git theta {name}")
    code, out, _ = zipslice(capsys, "-h")
    for name in ("ls", "info", "show", "convert", "diff", "completion"):
        code, text, _ = zipslice(capsys, name, "-h")
        assert code == 0 and text.startswith(f"Usage: zipslice {name}")
        assert "<" not in text.split("\n")[0] and "{" not in text.split("\n")[0]  # no type tags, no {placeholders}


def test_bash_completion_for_git_theta_and_zipslice(tmp_path):
    """The printed script, sourced in a real bash: `git theta ls<TAB>` and `zipslice con<TAB>` complete."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    scripts = tmp_path / "completion.bash"
    scripts.write_text(subprocess.run([sys.executable, "-m", "theta.commands.cli", "completion", "bash"], env=env,
                                      capture_output=True, text=True, check=True).stdout
                       + subprocess.run([sys.executable, "-m", "zipslice.cli", "completion", "bash"], env=env,
                                        capture_output=True, text=True, check=True).stdout)
    probe = (f"source {scripts}\n"
             "COMP_WORDS=(git theta ls); COMP_CWORD=2; _git_theta; echo \"git:${COMPREPLY[*]}\"\n"
             "COMP_WORDS=(git-theta merge-r); COMP_CWORD=1; _git_theta_completion; echo \"dash:${COMPREPLY[*]}\"\n"
             "COMP_WORDS=(zipslice con); COMP_CWORD=1; _zipslice_completion; echo \"z:${COMPREPLY[*]}\"\n"
             "COMP_WORDS=(zipslice convert a b --to s); COMP_CWORD=5; _zipslice_completion; echo \"to:${COMPREPLY[*]}\"\n")
    r = subprocess.run(["bash", "--norc", "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = dict(line.split(":", 1) for line in r.stdout.splitlines())
    assert got["git"] == "ls-files" and got["dash"] == "merge-resolve"
    assert got["z"] == "convert" and got["to"] == "safetensors sharded"
