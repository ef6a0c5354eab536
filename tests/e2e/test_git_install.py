"""`git theta install` / `track`, the pre-push hook chaining, and the pkt-line framing, with real git and git-lfs."""
import io
import os

import pytest

from support.gitrepo import GitEnv
from theta.commands.install import settings_for
from theta.base.errors import ProtocolError
from theta.git.pktline import MAX_PAYLOAD, PktReader, PktWriter
from theta.commands.track import parse_line, track_lines, TrackError


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def _config(repo, *args):
    return repo.git("config", *args, check=False).stdout.decode().strip()


def test_local_install_sets_drivers_and_is_idempotent(genv):
    repo = genv.init("r", theta=False)
    first = repo.theta("install", "--local").stdout.decode()
    assert "filter.theta.process" in first
    launcher = repo.git_common_dir() / "theta" / "bin" / "git-theta"
    for key, value in settings_for(launcher).items():
        assert _config(repo, "--local", "--get", key) == value
    hooks = repo.git_common_dir() / "hooks"
    hook = (hooks / "pre-push").read_text()
    assert "git-theta pre-push" in hook
    # git-lfs's own pre-push is kept and chained, not overwritten
    chained = (hooks / "pre-push.theta-chained").read_text()
    assert "git lfs pre-push" in chained
    assert _config(repo, "--local", "--get", "filter.lfs.process") == "git-lfs filter-process"
    before = {p.name: p.read_bytes() for p in hooks.iterdir()}
    config_before = (repo.git_common_dir() / "config").read_bytes()
    again = repo.theta("install", "--local").stdout.decode()
    assert "already installed" in again
    assert {p.name: p.read_bytes() for p in hooks.iterdir()} == before
    assert (repo.git_common_dir() / "config").read_bytes() == config_before


def test_git_lfs_force_update_over_our_hook_is_repaired(genv):
    repo = genv.init("r", theta=False)
    repo.theta("install", "--local")
    hooks = repo.git_common_dir() / "hooks"
    # git-lfs refuses to replace theta's hook (harmless: its own hook is chained) ...
    assert repo.git("lfs", "install", "--local", check=False).returncode != 0
    # ... unless forced; `git theta install` then restores the chain
    repo.git("lfs", "update", "--force")
    assert "git-theta" not in (hooks / "pre-push").read_text()
    repo.theta("install", "--local")
    assert "git-theta pre-push" in (hooks / "pre-push").read_text()
    assert "git lfs pre-push" in (hooks / "pre-push.theta-chained").read_text()


def test_global_install_writes_global_config_only(genv):
    repo = genv.init("r", theta=False)
    repo.theta("install")
    global_cfg = (genv.home / ".gitconfig").read_text()
    assert "git-theta filter-process" in global_cfg and "git-theta merge-driver %O %A %B %L %P" in global_cfg
    assert _config(repo, "--local", "--get", "filter.theta.process") == ""
    assert "git-theta pre-push" in (repo.git_common_dir() / "hooks" / "pre-push").read_text()


def test_existing_user_hook_is_chained_and_still_runs(genv, tmp_path):
    repo = genv.init("r", theta=False)
    hooks = repo.git_common_dir() / "hooks"
    marker = tmp_path / "user-hook-ran"
    (hooks / "pre-push").write_text(f"#!/bin/sh\ncat > {marker}\necho \"$1 $2\" >> {marker}\nexit 0\n")
    os.chmod(hooks / "pre-push", 0o755)
    repo.theta("install", "--local")
    assert "cat >" in (hooks / "pre-push.theta-chained").read_text()
    # push to a bare remote: theta's hook runs, then the user's hook with the same stdin and arguments
    remote = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", str(remote.path))
    (repo / "a.txt").write_text("hello\n")
    repo.commit("text", "a.txt")
    repo.git("push", "-q", "origin", "main")
    ran = marker.read_text()
    assert "refs/heads/main" in ran and f"origin {remote.path}" in ran


def test_user_hook_failure_blocks_push(genv):
    repo = genv.init("r", theta=False)
    hooks = repo.git_common_dir() / "hooks"
    (hooks / "pre-push").write_text("#!/bin/sh\necho refused >&2\nexit 3\n")
    os.chmod(hooks / "pre-push", 0o755)
    repo.theta("install", "--local")
    remote = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", str(remote.path))
    (repo / "a.txt").write_text("x\n")
    repo.commit("text", "a.txt")
    proc = repo.git("push", "origin", "main", check=False)
    assert proc.returncode != 0 and b"refused" in proc.stderr


def test_track_writes_attributes_and_is_idempotent(genv):
    repo = genv.init("r", theta=True, track=())
    (repo / ".gitattributes").write_text("*.pt -text\n*.txt eol=lf\n")
    out = repo.theta("track", "*.pt", "models/*.safetensors").stdout.decode()
    assert "Tracking *.pt" in out
    text = (repo / ".gitattributes").read_text()
    assert text == ("*.pt -text filter=theta diff=theta merge=theta\n*.txt eol=lf\n"
                    "models/*.safetensors filter=theta diff=theta merge=theta\n")
    assert "Already tracking" in repo.theta("track", "*.pt").stdout.decode()
    assert (repo / ".gitattributes").read_text() == text
    got = repo.out("check-attr", "filter", "diff", "merge", "--", "x/model.pt")
    assert got.splitlines() == ["x/model.pt: filter: theta", "x/model.pt: diff: theta", "x/model.pt: merge: theta"]


def test_track_refuses_a_conflicting_driver(genv):
    repo = genv.init("r", theta=True, track=())
    (repo / ".gitattributes").write_text("*.pt filter=lfs diff=lfs merge=lfs -text\n")
    proc = repo.theta("track", "*.pt", check=False)
    assert proc.returncode == 1
    assert b"error:" in proc.stderr and b"filter=lfs" in proc.stderr and b"git lfs untrack" in proc.stderr
    assert (repo / ".gitattributes").read_text() == "*.pt filter=lfs diff=lfs merge=lfs -text\n"


def test_track_lines_quoted_pattern_round_trip():
    lines, changed = track_lines([parse_line('"my model.pt" -text')], "my model.pt")
    assert changed and lines[0].render() == '"my model.pt" -text filter=theta diff=theta merge=theta'
    with pytest.raises(TrackError):
        track_lines([parse_line("*.bin merge=binary")], "*.bin")


def test_pktline_round_trip_and_splitting():
    buf = io.BytesIO()
    w = PktWriter(buf)
    w.text_list(["git-filter-server", "version=2"])
    big = bytes(range(256)) * 600  # > one packet
    w.packet(big)
    w.flush()
    buf.seek(0)
    r = PktReader(buf)
    assert r.read_text_list() == ["git-filter-server", "version=2"]
    assert b"".join(r.iter_content()) == big
    raw = buf.getvalue()
    assert raw.startswith(b"0016git-filter-server\n")
    assert b"%04x" % (MAX_PAYLOAD + 4) in raw
    with pytest.raises(EOFError):
        r.read_packet()
    with pytest.raises(ProtocolError):
        PktReader(io.BytesIO(b"00zz")).read_packet()
    with pytest.raises(ProtocolError):
        PktReader(io.BytesIO(b"0010abc")).read_packet()


def test_cli_errors_are_one_line(genv):
    repo = genv.init("r", theta=True)
    proc = repo.theta("export", "HEAD:nothing.pt", str(repo / "out.pt"), check=False)
    assert proc.returncode == 1
    assert proc.stderr.decode() == "git theta: error: HEAD:nothing.pt: no such file in git\n"
