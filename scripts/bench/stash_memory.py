"""Where `git stash` of a changed Llama-shaped shard keeps its memory: every process of the step, its anonymous and
file-backed resident memory, inside one memory cgroup -- optionally while the machine is busy.

`git stash` runs its own clean filter (refreshing the index cleans the changed shard), keeps that process
waiting, and starts `git update-index`, whose own filter cleans the shard again: two filters, then a
`reset --hard` with a third and theta's post-index-change hook. Their memory adds up inside one container;
llama.py measures the step's total, this script shows each process's share.

The history is llama.py's (scripts/bench/llama_model.py): base, full fine-tune and partial committed, then shard
2 of another full fine-tune of base put in the work tree and stashed. ``--load`` runs the stash while two
busy loops and a writer (2 GB written with fsync, again and again) compete for the CPUs and the disk, as a
test run beside the benchmark does.

    python3 scripts/bench/stash_memory.py --workdir /tmp/theta-bench          # full size, 1 GiB
    python3 scripts/bench/stash_memory.py --scale 0.25 --mem-limit 0.25 --load
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import llama_model as lm  # noqa: E402
from harness import MiB, git_env, new_repo, sh  # noqa: E402
from memcg import MemoryCgroup  # noqa: E402

BUSY = "while True:\n    sum(range(100000))"


def history(root: Path, dims: lm.Dims, env: dict) -> Path:
    """The repository with base, finetune and partial committed (made once under ``root``, then reused)."""
    data, repo = root / "data", root / "stash-repo"
    if (repo / ".git" / "stash-history-ready").exists():
        return repo
    repo = new_repo(root, "stash-repo", "theta", env, pattern="model/*.safetensors")
    sh(["git", "theta", "install", "--local"], repo, env)
    (repo / "model").mkdir()
    for version in ("base", "finetune", "partial"):
        src = lm.write_version(data, version, dims, progress=True)
        for name in lm.SHARDS + (lm.INDEX,):
            shutil.copyfile(src / name, repo / "model" / name)
        sh(["git", "add", "model"], repo, env)
        sh(["git", "commit", "-q", "-m", version], repo, env)
    lm.write_version(data, "finetune2", dims, progress=True)
    (repo / ".git" / "stash-history-ready").write_text("")
    return repo


class Sampler:
    """Every 50 ms, each process of the cgroup: the largest RssAnon and RssFile seen (by pid and command line),
    and the largest sum of RssAnon over the processes alive at once."""

    def __init__(self, cg: MemoryCgroup):
        self.cg, self.peaks, self.anon_sum = cg, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self.cg.pids():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                kib = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
                       if line.startswith(("RssAnon:", "RssFile:"))}
                if not cmd.strip():
                    continue  # a process between fork and exec
                key = (pid, " ".join(cmd.split())[:100])
                old = self.peaks.get(key, {})
                self.peaks[key] = {k: max(v, old.get(k, 0)) for k, v in kib.items()}
                total += kib.get("RssAnon", 0)
            self.anon_sum = max(self.anon_sum, total * 1024)
            self._stop.wait(0.05)


def busy(on: bool) -> list[subprocess.Popen]:
    """Two busy loops and a disk writer, or nothing."""
    if not on:
        return []
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    target = Path("/var/tmp") / f"stash-memory-load-{os.getpid()}"
    procs.append(subprocess.Popen(["sh", "-c", f"while true; do dd if=/dev/zero of={target} bs=1M count=2000 "
                                   f"conv=fsync status=none; rm -f {target}; done"]))
    return procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/theta-bench"))
    ap.add_argument("--scale", type=float, default=1.0, help="every dimension of the model times this")
    ap.add_argument("--mem-limit", type=float, default=1.0, metavar="GIB", help="the cgroup's limit (default 1)")
    ap.add_argument("--load", action="store_true", help="stash while two busy loops and a writer run")
    args = ap.parse_args()
    why = MemoryCgroup.unavailable_reason()
    if why:
        print(f"no memory cgroup can be made here: {why}")
        return 0
    dims = lm.LLAMA3_8B_4L if args.scale == 1 else lm.LLAMA3_8B_4L.scaled(args.scale)
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = git_env(args.workdir / "home", pythonpath=True)
    for tool in ("lfs", "theta"):
        sh(["git", tool, "install"], args.workdir, env)
    repo = history(args.workdir, dims, env)
    sh(["git", "reset", "-q", "--hard"], repo, env)
    sh(["git", "stash", "clear"], repo, env)
    shard = lm.SHARDS[1]
    shutil.copyfile(lm.version_dir(args.workdir / "data", "finetune2", dims) / shard, repo / "model" / shard)
    time.sleep(1.1)  # past git's racy-stat second: the stash, not a refresh before it, cleans the shard
    cg = MemoryCgroup.create("stash-memory", int(args.mem_limit * (1 << 30)))
    load = busy(args.load)
    try:
        t0 = time.perf_counter()
        with Sampler(cg) as s:
            p = subprocess.run(["git", "stash", "-q"], cwd=repo, env=env, preexec_fn=cg.join,
                               capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    finally:
        for q in load:
            q.kill()
        subprocess.run(["sh", "-c", "rm -f /var/tmp/stash-memory-load-*"])
    print(f"{dims.nbytes() / 1e9:.2f} GB model, largest tensor {dims.vocab * dims.hidden * 2 / 1e9:.2f} GB; "
          f"`git stash` in {args.mem_limit:g} GiB{' under load' if args.load else ''}: exit {p.returncode}, "
          f"{seconds:.1f} s, cgroup peak {cg.peak() / MiB:.0f} MiB, OOM kills {cg.oom_kills()}, "
          f"largest sum of anonymous memory {s.anon_sum / MiB:.0f} MiB")
    if p.stderr.strip():
        print(p.stderr.strip()[-2000:])
    print(f"{'pid':>7} {'anon MiB':>9} {'file MiB':>9}  command")
    for (pid, cmd), kib in sorted(s.peaks.items()):
        if kib.get("RssAnon", 0) + kib.get("RssFile", 0) >= 1024:
            print(f"{pid:>7} {kib.get('RssAnon', 0) / 1024:9.0f} {kib.get('RssFile', 0) / 1024:9.0f}  {cmd}")
    killed = cg.oom_kills()
    cg.remove(kill=True)
    return 0 if p.returncode == 0 and not killed else 1


if __name__ == "__main__":
    sys.exit(main())
