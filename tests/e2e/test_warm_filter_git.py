"""The warm filter (theta.warm): git's filter process served by a fork of a started server stores and checks out
byte for byte what a cold filter does, takes the client's environment, ends with its client, refuses what it
cannot trust and never serves stale code. Real git, real git-lfs, real torch files."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch

from theta import warm

from support.checkpoints import assert_same_checkpoint, make_state, save_pt
from support.gitrepo import ROOT, GitEnv


@pytest.fixture
def genv(tmp_path):
    g = GitEnv.create(tmp_path)
    d = tmp_path / "warm"
    g.env["GIT_THETA_WARM_DIR"] = str(d)  # this test's own servers
    yield g
    if d.exists():
        for _, pid in warm.servers(str(d)):
            os.kill(pid, signal.SIGKILL)


def tuned(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v * (1 + 1e-3 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v
            for k, v in state.items()}


def servers(genv) -> list[tuple[str, int]]:
    d = genv.env["GIT_THETA_WARM_DIR"]
    return warm.servers(d) if os.path.isdir(d) else []


def wait_for_servers(genv, n: int = 1, other_than: set = frozenset(), timeout: float = 30.0) -> list:
    """The servers once ``n`` of them (with pids not in ``other_than``) are listening."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        live = [s for s in servers(genv) if s[1] not in other_than]
        d = Path(genv.env["GIT_THETA_WARM_DIR"])
        if len(live) >= n and all((d / f"{k}.{warm.SOCKET}").exists() for k, _ in live):
            return live
        time.sleep(0.05)
    raise AssertionError(f"no warm server after {timeout} s: {servers(genv)}")


def gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.02)
    return False


def ledger(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_warm_add_and_checkout_store_and_write_what_cold_ones_do(genv, tmp_path):
    """The first filter is cold and leaves a server; the next add is served by the server's child (it says so
    in the ledger) and stages byte for byte the metadata a cold add stages; a warm checkout writes the
    checkpoint a cold one writes."""
    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    cold_first = tmp_path / "first.jsonl"
    repo.git("add", ".gitattributes", "model.pt", extra_env={"GIT_THETA_WARM_LEDGER": str(cold_first)})
    repo.git("commit", "-q", "-m", "v1")
    assert ledger(cold_first) == []  # no server yet: the first filter was cold
    [(key, server)] = wait_for_servers(genv)

    v2 = tuned(v1, 2)
    save_pt(repo / "model.pt", v2)
    warm_log = tmp_path / "warm.jsonl"
    repo.git("add", "model.pt", extra_env={"GIT_THETA_WARM_LEDGER": str(warm_log)})
    entries = ledger(warm_log)
    assert [e["what"] for e in entries] == ["start", "end"] and entries[0]["pid"] == entries[1]["pid"]
    assert entries[1]["cpu"] > 0 and entries[1]["maxrss"] > 0
    warm_text = repo.show(":model.pt")

    repo.git("reset", "-q")
    cold_log = tmp_path / "cold.jsonl"
    repo.git("add", "model.pt", extra_env={"GIT_THETA_WARM": "0", "GIT_THETA_WARM_LEDGER": str(cold_log)})
    assert ledger(cold_log) == []
    assert repo.show(":model.pt") == warm_text
    repo.git("commit", "-q", "-m", "v2")

    (repo / "model.pt").unlink()
    checkout_log = tmp_path / "checkout.jsonl"
    repo.git("checkout", "HEAD~1", "--", "model.pt", extra_env={"GIT_THETA_WARM_LEDGER": str(checkout_log)})
    assert [e["what"] for e in ledger(checkout_log)] == ["start", "end"]
    warm_bytes = (repo / "model.pt").read_bytes()
    assert_same_checkpoint(repo / "model.pt", v1)
    (repo / "model.pt").unlink()
    repo.git("checkout", "HEAD~1", "--", "model.pt", extra_env={"GIT_THETA_WARM": "0"})
    assert (repo / "model.pt").read_bytes() == warm_bytes
    assert servers(genv) == [(key, server)]  # the same server served every warm filter


def test_the_child_takes_the_clients_environment_not_the_servers(genv, tmp_path):
    """Settings read when theta's modules are imported (GIT_THETA_THREADS) are read again from the client's
    environment: with one thread the warm child receives git's bytes itself, with two a forked child does."""
    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    wait_for_servers(genv)
    save_pt(repo / "model.pt", tuned(v1, 3))
    said = {}
    for threads in ("1", "2"):
        repo.git("reset", "-q")
        log = tmp_path / f"t{threads}.jsonl"
        p = repo.git("add", "model.pt", extra_env={"GIT_THETA_THREADS": threads, "GIT_THETA_TIMING": "1",
                                                   "GIT_THETA_WARM_LEDGER": str(log)})
        assert [e["what"] for e in ledger(log)] == ["start", "end"]
        said[threads] = p.stderr.decode()
    assert "received by a forked child" not in said["1"] and "clean model.pt" in said["1"]
    assert "received by a forked child" in said["2"]


def test_a_server_whose_code_changed_refuses_and_exits(genv, tmp_path):
    """An upgrade (here: a source file of a copy of theta touched) makes the server refuse the next request and
    exit; that add runs cold, and leaves a server of the new code."""
    code = tmp_path / "code"
    for pkg in ("theta", "zipslice"):
        shutil.copytree(ROOT / pkg, code / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    genv.env["PYTHONPATH"] = str(code)
    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    [(_, old)] = wait_for_servers(genv)
    source = code / "theta" / "model" / "clean.py"
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    save_pt(repo / "model.pt", tuned(v1, 4))
    log = tmp_path / "stale.jsonl"
    repo.git("add", "model.pt", extra_env={"GIT_THETA_WARM_LEDGER": str(log)})
    assert ledger(log) == []  # refused: served cold
    assert gone(old)
    [(_, new)] = wait_for_servers(genv, other_than={old})
    assert new != old
    repo.git("reset", "-q")
    again = tmp_path / "again.jsonl"
    repo.git("add", "model.pt", extra_env={"GIT_THETA_WARM_LEDGER": str(again)})
    assert [e["what"] for e in ledger(again)] == ["start", "end"]


def test_a_different_start_environment_gets_a_server_of_its_own(genv):
    """Environment the interpreter or native libraries read at start (here OPENBLAS_NUM_THREADS) is part of a
    server's key: a filter started with another value is not served by the first server."""
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", make_state(1))
    repo.commit("v1", ".gitattributes", "model.pt")
    [(_, first)] = wait_for_servers(genv)
    save_pt(repo / "model.pt", make_state(2))
    repo.git("add", "model.pt", extra_env={"OPENBLAS_NUM_THREADS": "2"})
    live = wait_for_servers(genv, 2)
    assert len({k for k, _ in live}) == 2 and first in {p for _, p in live}


def filter_process(genv, repo, **extra) -> subprocess.Popen:
    """`git-theta filter-process` started as git starts it, with this test playing git."""
    return subprocess.Popen([str(repo.git_common_dir() / "theta" / "bin" / "git-theta"), "filter-process"],
                            cwd=repo.path, env={**genv.env, **extra}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def pkt(text: str) -> bytes:
    data = text.encode() + b"\n"
    return b"%04x" % (len(data) + 4) + data


HANDSHAKE = pkt("git-filter-client") + pkt("version=2") + b"0000"


def warm_child(log: Path, timeout: float = 30.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        starts = [e for e in ledger(log) if e["what"] == "start"]
        if starts:
            return starts[0]["pid"]
        time.sleep(0.02)
    raise AssertionError("no warm child started")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_the_child_ends_with_its_client(genv, tmp_path, how):
    """git (or a user, or the OOM killer) ending the filter process git started ends the warm child serving it:
    killed (SIGKILL), the child notices its client is gone; sent SIGTERM, the client passes it on and dies of
    it, as a cold filter would."""
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", make_state(1))
    repo.commit("v1", ".gitattributes", "model.pt")
    wait_for_servers(genv)
    log = tmp_path / "kill.jsonl"
    proc = filter_process(genv, repo, GIT_THETA_WARM_LEDGER=str(log))
    proc.stdin.write(HANDSHAKE)
    proc.stdin.flush()
    child = warm_child(log)
    assert proc.stdout.read(4)  # the child answered the greeting: it serves git
    os.kill(proc.pid, getattr(signal, how))
    assert proc.wait(10) == -getattr(signal, how)
    assert gone(child)


def test_a_protocol_error_ends_a_warm_filter_as_it_ends_a_cold_one(genv, tmp_path):
    """A greeting that is not git's: the same exit status and message from a warm filter as from a cold one."""
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", make_state(1))
    repo.commit("v1", ".gitattributes", "model.pt")
    wait_for_servers(genv)
    got = {}
    for mode in ("1", "0"):
        log = tmp_path / f"bad{mode}.jsonl"
        proc = filter_process(genv, repo, GIT_THETA_WARM=mode, GIT_THETA_WARM_LEDGER=str(log))
        out, err = proc.communicate(pkt("hello") + b"0000", timeout=60)
        got[mode] = (proc.returncode, out, err.decode())
        assert bool(ledger(log)) == (mode == "1")
    assert got["1"] == got["0"] and got["0"][0] != 0 and "unexpected greeting" in got["0"][2]


def test_garbage_on_the_socket_is_refused_and_the_server_serves_on(genv, tmp_path):
    """A request without git's pipes, with a length past the limit, or cut short: refused, nothing forked,
    and the next add is served warm."""
    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    [(key, server)] = wait_for_servers(genv)
    path = os.path.join(genv.env["GIT_THETA_WARM_DIR"], f"{key}.{warm.SOCKET}")
    for payload, fds in ((b"\x00\x00\x00\x02{}", []), (struct.pack("!I", 1 << 30), [0, 1, 2]),
                         (struct.pack("!I", 100) + b"{", [0, 1, 2]), (b"\xff" * 4 + b"not json", [0, 1, 2])):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
        s.sendmsg([payload], anc)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        try:
            answer = s.recv(16)
        except ConnectionResetError:  # (closed with the request unread)
            answer = b""
        assert answer == b""  # closed without an answer: no child
        s.close()
    save_pt(repo / "model.pt", tuned(v1, 5))
    log = tmp_path / "after.jsonl"
    repo.git("add", "model.pt", extra_env={"GIT_THETA_WARM_LEDGER": str(log)})
    assert [e["what"] for e in ledger(log)] == ["start", "end"]
    assert servers(genv) == [(key, server)]


@pytest.mark.parametrize("unsafe", ["open to others", "a symlink"])
def test_a_directory_others_could_enter_is_not_used(genv, tmp_path, unsafe):
    """The servers' directory must be the user's own and closed to others: else nothing is warm (no server is
    started, none is asked) and git's commands work cold."""
    d = Path(genv.env["GIT_THETA_WARM_DIR"])
    if unsafe == "open to others":
        d.mkdir(mode=0o755)
        d.chmod(0o755)
    else:
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        d.symlink_to(real)
    repo = genv.init("work", track=("*.pt",))
    v1 = make_state(1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    save_pt(repo / "model.pt", tuned(v1, 6))
    log = tmp_path / "unsafe.jsonl"
    repo.git("add", "model.pt", extra_env={"GIT_THETA_WARM_LEDGER": str(log)})
    time.sleep(1.0)
    assert ledger(log) == [] and os.listdir(d) == []


def test_module_level_environment_reads_are_read_again_in_a_warm_child():
    """A warm child imports nothing: every module-level read of the environment (at import) would keep the
    server's value. The only ones are theta.base.faults' and theta.base.parallel's, which the child reads again
    (theta.warm.server._reconfigure); a new one must join them."""
    import ast

    def run_at_import(node):  # the nodes evaluated when the module is imported (not function bodies)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield child
                yield from run_at_import(child)

    found = set()
    for path in sorted((ROOT / "theta").rglob("*.py")) + sorted((ROOT / "zipslice").rglob("*.py")):
        for sub in run_at_import(ast.parse(path.read_text(), str(path))):
            if isinstance(sub, ast.Call):
                name = ast.unparse(sub.func)
                if name.endswith(("environ.get", "getenv", "settings.env", "environ")) or name == "configure":
                    found.add((path.relative_to(ROOT).as_posix(), name))
            elif isinstance(sub, ast.Subscript) and ast.unparse(sub.value).endswith("environ"):
                found.add((path.relative_to(ROOT).as_posix(), ast.unparse(sub)))
    assert found == {("theta/base/faults.py", "configure"), ("theta/base/parallel.py", "configure")}, found


def test_no_more_than_max_servers_are_left(genv):
    """Filters that each need a server of their own (here: six values of OPENBLAS_NUM_THREADS) leave at most
    MAX_SERVERS; the others run cold."""
    repo = genv.init("work", track=("*.pt",))
    save_pt(repo / "model.pt", make_state(1))
    repo.commit("v1", ".gitattributes", "model.pt")
    wait_for_servers(genv)
    for n in range(2, 8):
        save_pt(repo / "model.pt", make_state(n))
        repo.git("add", "model.pt", extra_env={"OPENBLAS_NUM_THREADS": str(n)})
        time.sleep(0.5)  # (a server started by the last filter binds its socket)
    live = wait_for_servers(genv, warm.MAX_SERVERS)
    time.sleep(1.0)
    assert len(servers(genv)) == len(live) == warm.MAX_SERVERS


def test_no_directory_means_no_server(tmp_path):
    assert warm.servers(str(tmp_path / "none")) == [] and warm.stop(str(tmp_path / "none")) == 0


HOSTILE_MODULES = ("theta/__init__.py", "json.py", "struct.py", "os.py", "site.py", "numpy.py", "_socket.py")


@pytest.mark.parametrize("start", ["console script", "interpreter"])
def test_modules_in_the_work_tree_are_never_imported(genv, tmp_path, start):
    """git runs the filter in the work tree, which a clone's author wrote: a `json.py` or a `theta/` there must
    never be imported, cold or warm, console script or interpreter (`-c`, never `-m`)."""
    from theta.commands.install import interpreter_command, launcher_script, this_environment_command

    repo = genv.init("work", track=("*.pt",))
    owned = tmp_path / "imported.txt"
    for name in HOSTILE_MODULES:
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_text(f"open({str(owned)!r}, 'a').write({name!r} + '\\n')\nraise SystemExit(3)\n")
    command = interpreter_command() if start == "interpreter" else this_environment_command()
    launcher = repo.git_common_dir() / "theta" / "bin" / "git-theta"
    launcher.write_text(launcher_script(command))
    v = make_state(1)
    save_pt(repo / "model.pt", v)
    repo.commit("v1", ".gitattributes", "model.pt")  # cold: leaves a server
    wait_for_servers(genv)
    for i, env in enumerate(({}, {"GIT_THETA_WARM": "0"})):
        v = tuned(v, 30 + i)
        save_pt(repo / "model.pt", v)
        repo.git("add", "model.pt", extra_env=env)
        repo.git("commit", "-q", "-m", f"v{i + 2}")
    (repo / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt")
    assert_same_checkpoint(repo / "model.pt", v)
    assert not owned.exists(), owned.read_text()


def test_a_stopped_server_removes_its_files_and_a_killed_ones_are_swept(genv, tmp_path):
    """warm.stop (SIGTERM) leaves no socket or lock behind; what a killed server left (SIGKILL, a cgroup's OOM
    kill) is removed by the next filter that starts a server, and a live server's files are kept."""
    repo = genv.init("work", track=("*.pt",))
    v = make_state(1)
    save_pt(repo / "model.pt", v)
    repo.commit("v1", ".gitattributes", "model.pt")
    d = Path(genv.env["GIT_THETA_WARM_DIR"])
    [(key, server)] = wait_for_servers(genv)
    assert warm.stop(str(d)) == 1 and gone(server)
    assert sorted(os.listdir(d)) == []

    save_pt(repo / "model.pt", tuned(v, 39))
    repo.git("add", "model.pt", extra_env={"OPENBLAS_NUM_THREADS": "2"})  # cold (no server): leaves one
    [(other, live)] = wait_for_servers(genv)
    dead = "0123456789abcdef01234567"
    (d / f"{dead}.{warm.LOCK}").write_text("999999\n")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(d / f"{dead}.{warm.SOCKET}"))
    s.close()
    (d / f"lonely.{warm.SOCKET}").write_text("")
    save_pt(repo / "model.pt", tuned(v, 40))
    repo.git("add", "model.pt")  # this key has no server: the cold filter sweeps, then leaves one
    live_now = wait_for_servers(genv, 2)
    assert {k for k, _ in live_now} == {key, other} and (other, live) in live_now
    assert sorted(os.listdir(d)) == sorted(f"{k}.{w}" for k in (key, other) for w in (warm.LOCK, warm.SOCKET))
