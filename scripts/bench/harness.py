"""The benchmarks' shared harness: an isolated git environment, running a command while measuring its whole
process tree, and a memory cgroup that stands in for a machine with less RAM.

Every benchmark runs the peer (git-lfs, torch, safetensors, stock PyTorch...) side by side with ours through
these helpers, so all figures are measured the same way:

- ``seconds``: wall clock of the command;
- ``cpu``: user + system seconds of the command and every process it started (robust on a busy machine);
- ``peak_tree_rss``: the largest sum of RSS over the command's process tree (git, filters, git-lfs...),
  sampled every 20 ms;
- ``cgroup_peak``: with a :class:`MemCgroup`, the kernel's own peak of the cgroup (page cache included):
  the number that decides whether a machine with that much RAM would have killed the command.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # imported as bench.harness (scripts/demo.py), not run from this folder
    sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:  # a benchmark measures this checkout's zipslice and theta, installed or not
    sys.path.insert(1, str(ROOT))

from memcg import MemoryCgroup  # noqa: E402

MiB = 1 << 20


def fmt_mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def dir_bytes(*dirs: Path) -> int:
    """Bytes of every file below ``dirs`` (missing ones count 0)."""
    total = 0
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except FileNotFoundError:
                    pass
    return total


# -- an isolated git environment --------------------------------------------------------------------------
def git_env(home: Path, pythonpath: bool = False) -> dict:
    """Environment for git with its own HOME and global config (the user's is never touched).

    git-theta is taken straight from the interpreter's bin directory, as in a virtualenv (a pyenv shim adds
    ~0.4 s per call). ``pythonpath``: put this checkout first on PYTHONPATH (benchmarks of uncommitted code).
    """
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "THETA_"))}
    env.update({"HOME": str(home), "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"), "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_TERMINAL_PROMPT": "0", "XDG_CONFIG_HOME": str(home / ".config"),
                # `git theta install` writes no man page beside the interpreter's bin directory (outside HOME)
                "GIT_THETA_MAN_DIR": ""})
    own = Path(sys.executable).parent
    if (own / "git-theta").exists():
        env["PATH"] = str(own) + os.pathsep + env.get("PATH", "")
    if pythonpath:
        env["PYTHONPATH"] = this_checkout_first(env)
    # as on a user's machine, the filter imports cached bytecode: without it every git command that starts
    # git-theta recompiles theta and zipslice (~0.2 s of CPU, measured with py-spy)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for k, v in {"user.name": "bench", "user.email": "bench@example.com", "init.defaultBranch": "main"}.items():
        subprocess.run(["git", "config", "--global", k, v], env=env, check=True, capture_output=True)
    return env


def this_checkout_first(env: dict) -> str:
    """``PYTHONPATH`` with this checkout first, and no empty entry: an empty one puts each command's working
    directory on git-theta's sys.path (a module there would be imported)."""
    return os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)


def sh(args: list, cwd: Path, env: dict) -> str:
    """Run a setup command; stop the benchmark with its stderr if it fails."""
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args))} failed in {cwd}:\n{p.stderr}")
    return p.stdout


def new_repo(root: Path, name: str, tool: str, env: dict, pattern: str = "*.pt") -> Path:
    """A fresh repository tracking ``pattern`` with ``tool`` ("theta" or "lfs"), attributes committed."""
    repo = root / name
    if repo.exists():
        shutil.rmtree(repo)
    sh(["git", "init", "-q", repo], root, env)
    if tool == "lfs":
        sh(["git", "lfs", "install", "--local"], repo, env)
        sh(["git", "lfs", "track", pattern], repo, env)
    else:
        sh(["git", "theta", "install", "--local"], repo, env)
        sh(["git", "theta", "track", pattern], repo, env)
    sh(["git", "add", ".gitattributes"], repo, env)
    sh(["git", "commit", "-q", "-m", "attributes"], repo, env)
    return repo


# -- a machine with less RAM -------------------------------------------------------------------------------
class MemCgroup:
    """A memory cgroup limited to ``limit`` bytes (page cache included): as far as memory goes, a machine with
    that much RAM. The cgroup itself is scripts/bench/memcg.py's MemoryCgroup (the one implementation, shared
    with the tests); this is the benchmarks' face of it. :meth:`available` says whether this machine allows it.

    Each :func:`run_measured` call gets a fresh child group, so ``peak`` is that command's own.
    """

    def __init__(self, limit: int, name: str = "bench"):
        self.limit = limit
        self.group = MemoryCgroup.create(f"theta-{name}-{os.getpid()}", limit)
        self.path = self.group.path
        self._children: dict[Path, MemoryCgroup] = {}

    @staticmethod
    def available() -> str | None:
        """None when memory cgroups can be made here, else why not."""
        return MemoryCgroup.unavailable_reason()

    def child(self) -> Path:
        c = self.group.child()
        self._children[c.path] = c
        return c.path

    def peak(self, child: Path) -> int:
        return self._children[child].peak()

    def oom_killed(self, child: Path) -> bool:
        return self._children[child].oom_kills() > 0

    def remove(self, child: Path) -> None:
        c = self._children.pop(child, None)
        if c is not None:
            c.remove(wait=2.5, kill=True)  # (with anything the command left running in it)

    def close(self) -> None:
        for child in list(self._children):
            self.remove(child)
        self.group.remove(wait=2.5)

    def __enter__(self) -> "MemCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- measuring -----------------------------------------------------------------------------------------------
@dataclass
class Measure:
    seconds: float
    cpu: float                  # user + system seconds of the whole process tree
    peak_tree_rss: int          # largest sum of RSS over the process tree (sampled every 20 ms)
    peak_proc_rss: int          # the largest single process...
    peak_proc_name: str         # ...and its command line
    peak_filter_rss: int = 0    # the largest git-theta / git-lfs helper process (not git itself)
    cgroup_peak: int = 0        # with a MemCgroup: the kernel's peak for the command (page cache included)
    returncode: int = 0
    stderr: str = ""
    oom_killed: bool = False    # with a MemCgroup: the kernel killed a process of the command for want of memory

    @property
    def status(self) -> str:
        """"ok", "OOM-killed" or "failed (exit N)"."""
        if self.oom_killed:
            return "OOM-killed"
        return "ok" if self.returncode == 0 else f"failed (exit {self.returncode})"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_measured(args: list, cwd: Path, env: dict | None = None, cgroup: MemCgroup | None = None,
                 check: bool = True, stdin=None, stdout=None) -> Measure:
    """Run a command, sampling the RSS of its whole process tree every 20 ms (and, in ``cgroup``, reading the
    kernel's peak). ``check``: stop the benchmark if it fails (else the result carries the return code)."""
    args = [str(a) for a in args]
    child = cgroup.child() if cgroup is not None else None

    def join() -> None:
        (child / "cgroup.procs").write_text(str(os.getpid()))

    env = dict(os.environ if env is None else env)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = psutil.Popen(args, cwd=cwd, env=env, stdin=stdin or subprocess.DEVNULL, stdout=stdout or subprocess.PIPE,
                        stderr=subprocess.PIPE, preexec_fn=join if child is not None else None)
    peak = {"tree": 0, "proc": 0, "name": "", "filter": 0}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                procs = [proc] + proc.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            seen: dict[int, tuple] = {}  # pid -> (parent pid, cmdline, rss, process) in this poll
            for p in procs:
                try:
                    seen[p.pid] = (p.ppid(), p.cmdline(), p.memory_info().rss, p)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            total = 0
            for ppid, full, rss, p in seen.values():
                parent = seen.get(ppid)
                if parent is not None and parent[1] == full:
                    # a forked child: it shares its parent's pages. A child between vfork and exec (e.g. the
                    # filter starting `git`) shares its parent's very memory: only what its RSS exceeds the
                    # parent's counts (summing RSS counted the filter twice: a clone "at 333 MiB" whose processes
                    # held 184)
                    total += max(0, rss - parent[2])
                    continue
                total += rss
                cmd = " ".join(full[:3])
                if rss > peak["filter"] and ("theta" in cmd or "git-lfs" in cmd):
                    peak["filter"] = rss
                if rss > peak["proc"]:
                    peak["proc"], peak["name"] = rss, cmd
            peak["tree"] = max(peak["tree"], total)
            done.wait(0.02)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    _, err = proc.communicate()
    elapsed = time.perf_counter() - t0
    done.set()
    th.join()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    cg_peak, killed = 0, False
    if child is not None:
        cg_peak, killed = cgroup.peak(child), cgroup.oom_killed(child)
        cgroup.remove(child)
    stderr = err.decode(errors="replace") + ("\n(OOM-killed in the memory cgroup)" if killed else "")
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}) in {cwd}:\n{stderr}")
    return Measure(elapsed, cpu, peak["tree"], peak["proc"], peak["name"], peak["filter"], cg_peak,
                   proc.returncode, stderr, killed)


def best_of(n: int, fn):
    """The run with the least wall time of ``n`` calls of ``fn()`` (each returning a Measure)."""
    runs = [fn() for _ in range(n)]
    return min(runs, key=lambda m: m.seconds)


def variant_env(spec: str) -> dict:
    """An A/B variant ``path[@NAME=value...]`` -> the environment that runs it (that checkout first on
    PYTHONPATH, then the variables)."""
    path, *pairs = spec.split("@")
    env = {"PYTHONPATH": str(Path(path).resolve())}
    for pair in pairs:
        name, _, value = pair.partition("=")
        env[name] = value
    return env
