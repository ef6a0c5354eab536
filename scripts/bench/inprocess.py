#!/usr/bin/env python3
"""Benchmark: commits straight from a training loop (theta.ThetaTrainerCallback, theta.save_to_git).

train   A Hugging Face Trainer fine-tunes a GPT-2 built from its config (no download; --layers/--embd, default
        6 x 384 with GPT-2's 50257-token vocabulary: ~30 M parameters, a 120 MB model.safetensors) on
        synthetic text (token ids drawn from a Zipf law, as words are; --batch x --seq tokens a step, AdamW,
        --lr). It saves every --save-steps steps, --saves times; the callback commits each checkpoint's
        model.safetensors as the next version of one tracked path. Printed: per save, the Trainer's own
        save (writing the checkpoint directory), the commit, and the new bytes stored; then the bytes theta
        stored for all of them (its LFS store, plus the git objects the commits added) against the bytes of
        the checkpoint files themselves (what keeping them, or git-lfs, stores), and the time a save adds
        to the step it ends: the commit's median (and range) beside a median training step.
replay  The same checkpoint files committed again, one after another in rounds, by three tools side by side
        (the order within each round rotates): the in-process commit (this process, as the callback runs:
        no interpreter start), `git add` + `git commit` through theta's filter (the file copied into the
        work tree first, not timed), and the same with git-lfs. Bytes each repository stored, and the
        median seconds per commit of each (with their spread).
memory  One process builds a state dict with a --big-mib float32 group (and a few small ones), then saves it
        three times with save_to_git (each version a small step from the last) and prints, for each save,
        the peak RSS above the process's RSS before it (VmHWM reset before each save). With root and memory
        cgroups, the same run is repeated inside a cgroup limited to that baseline plus half the big group.

    python3 scripts/bench/inprocess.py                       # train + replay + memory (~10 min on 2 cores)
    python3 scripts/bench/inprocess.py --only train --saves 10 --save-steps 5
    python3 scripts/bench/inprocess.py --only memory --big-mib 512
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))       # this checkout's packages first
sys.path.insert(1, str(HERE))

from harness import MemoryCgroup, dir_bytes, git_env, sh  # noqa: E402

MB = 1e6


def repo_bytes(repo: Path) -> tuple[int, int]:
    """(bytes in the LFS store, bytes of git's own objects) of a repository."""
    git = repo / ".git"
    return dir_bytes(git / "lfs" / "objects"), dir_bytes(git / "objects")


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"


def new_repo(root: Path, name: str, env: dict, tool: str | None) -> Path:
    repo = root / name
    sh(["git", "init", "-q", repo], root, env)
    (repo / "README").write_text("a training run\n")
    if tool == "lfs":
        sh(["git", "lfs", "install", "--local"], repo, env)
        sh(["git", "lfs", "track", "model.safetensors"], repo, env)
    elif tool == "theta":
        sh(["git", "theta", "install", "--local"], repo, env)
        sh(["git", "theta", "track", "model.safetensors"], repo, env)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-q", "-m", "start"], repo, env)
    return repo


# -- train ----------------------------------------------------------------------------------------------------
def train(args, work: Path, env: dict) -> dict:
    import numpy as np
    import torch
    import transformers

    import theta

    repo = new_repo(work, "run-repo", env, tool=None)  # the callback tracks model.safetensors itself
    os.environ.update(env)

    class ZipfTokens(torch.utils.data.Dataset):
        def __init__(self, n: int, seq: int, vocab: int):
            rng = np.random.default_rng(0)
            ranks = rng.zipf(1.1, size=(n, seq)) - 1
            perm = rng.permutation(vocab)  # frequent words are not the first ids
            self.ids = torch.from_numpy(perm[np.minimum(ranks, vocab - 1)].astype(np.int64))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Timer(transformers.TrainerCallback):
        """Step times, and the Trainer's own save: from the end of the step to on_save (this callback is
        called before theta's)."""

        def __init__(self):
            self.steps, self.saves, self._t = [], [], 0.0

        def on_step_begin(self, a, s, c, **k):
            self._t = time.perf_counter()

        def on_step_end(self, a, s, c, **k):
            now = time.perf_counter()
            self.steps.append(now - self._t)
            self._t = now

        def on_save(self, a, s, c, **k):
            self.saves.append(time.perf_counter() - self._t)

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=max(1, args.embd // 64),
                                     n_positions=max(args.seq, 64))
    model = transformers.GPT2LMHeadModel(config)
    out = work / "trainer-out"
    targs = transformers.TrainingArguments(
        output_dir=str(out), max_steps=args.saves * args.save_steps, save_steps=args.save_steps,
        per_device_train_batch_size=args.batch, learning_rate=args.lr, logging_steps=args.save_steps,
        report_to=[], save_only_model=True, use_cpu=True, disable_tqdm=True, seed=0)
    timer = Timer()
    commits = theta.ThetaTrainerCallback("model.safetensors", repo=repo, tag="step-{step}")
    data = ZipfTokens(args.batch * args.saves * args.save_steps, args.seq, config.vocab_size)
    transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[timer, commits]).train()

    files = [Path(c.source) for c in commits.committed]
    ckpt_bytes = sum(f.stat().st_size for f in files)
    lfs, objects = repo_bytes(repo)
    params = sum(p.numel() for p in model.parameters())
    save_steps = set(range(args.save_steps - 1, len(timer.steps), args.save_steps))
    plain_steps = [t for i, t in enumerate(timer.steps) if i not in save_steps]
    print(f"\n== train: GPT-2 {args.layers} layers x {args.embd}, {params / 1e6:.1f} M parameters, "
          f"model.safetensors {files[0].stat().st_size / MB:.1f} MB; {args.saves} saves every {args.save_steps} "
          f"steps (batch {args.batch} x {args.seq} tokens, AdamW lr {args.lr})")
    print(f"{'step':>6} {'trainer save':>13} {'commit':>8} {'new bytes':>11} {'groups stored':>14}")
    for c, trainer_save in zip(commits.committed, timer.saves):
        print(f"{c.step:>6} {trainer_save:>11.2f} s {c.seconds:>6.2f} s {c.new_blob_bytes / MB:>8.1f} MB "
              f"{c.changed_groups:>6} of {c.groups}")
    print(f"stored by theta: {lfs / MB:.1f} MB LFS objects + {objects / MB:.2f} MB git objects = "
          f"{(lfs + objects) / MB:.1f} MB, against {ckpt_bytes / MB:.1f} MB of {len(files)} safetensors files "
          f"({(lfs + objects) / ckpt_bytes:.2f}x)")
    later = commits.committed[1:]
    if later:
        print(f"after the first save: {sum(c.new_blob_bytes for c in later) / len(later) / MB:.1f} MB stored per "
              f"save on average, against {files[0].stat().st_size / MB:.1f} MB per file "
              f"({sum(c.new_blob_bytes for c in later) / len(later) / files[0].stat().st_size:.2f}x)")
    print(f"time a save adds: commit {spread([c.seconds for c in commits.committed])}; the Trainer's own save "
          f"{spread(timer.saves)}; a training step without a save {spread(plain_steps)}")
    return {"files": [str(f) for f in files], "params": params, "ckpt_bytes": ckpt_bytes, "lfs": lfs,
            "objects": objects, "commits": [c.__dict__ for c in commits.committed], "trainer_saves": timer.saves,
            "steps": plain_steps}


# -- replay ---------------------------------------------------------------------------------------------------
def replay(files: list[Path], work: Path, env: dict, rounds_note: bool = True) -> dict:
    import zipslice

    from theta.inprocess.commit import commit_checkpoint

    repos = {"in-process": new_repo(work, "replay-inprocess", env, tool=None),
             "theta git add": new_repo(work, "replay-theta", env, tool="theta"),
             "git-lfs": new_repo(work, "replay-lfs", env, tool="lfs")}
    os.environ.update(env)
    times: dict[str, list[float]] = {k: [] for k in repos}
    order = list(repos)
    for i, f in enumerate(files):
        for tool in order[i % 3:] + order[:i % 3]:  # each tool first in a third of the rounds
            repo = repos[tool]
            if tool == "in-process":
                t0 = time.perf_counter()
                with zipslice.load(f) as lsd:
                    commit_checkpoint(lsd, repo / "model.safetensors", f"save {i}", progress=False)
                times[tool].append(time.perf_counter() - t0)
            else:
                shutil.copyfile(f, repo / "model.safetensors")
                t0 = time.perf_counter()
                sh(["git", "add", "model.safetensors"], repo, env)
                sh(["git", "commit", "-q", "-m", f"save {i}"], repo, env)
                times[tool].append(time.perf_counter() - t0)
    total = sum(f.stat().st_size for f in files)
    print(f"\n== replay: the {len(files)} checkpoint files committed by each tool, in rotating order")
    print(f"{'tool':<15} {'LFS objects':>12} {'git objects':>12} {'x files':>8}  seconds per commit")
    out = {}
    for tool, repo in repos.items():
        lfs, objects = repo_bytes(repo)
        print(f"{tool:<15} {lfs / MB:>9.1f} MB {objects / MB:>9.2f} MB {(lfs + objects) / total:>8.2f}  "
              f"{spread(times[tool])}")
        out[tool] = {"lfs": lfs, "objects": objects, "seconds": times[tool]}
    print(f"(checkpoint files: {total / MB:.1f} MB; the in-process times include no interpreter start, the "
          f"git ones their filter's)")
    return out


# -- memory ---------------------------------------------------------------------------------------------------
MEMORY_CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
import theta

PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

class Peak:
    # RSS sampled every 5 ms on a thread while a save runs (VmHWM cannot be reset on every kernel)
    def __enter__(self):
        self.peak, self.done = rss(), threading.Event()
        def poll():
            while not self.done.is_set():
                self.peak = max(self.peak, rss())
                self.done.wait(0.005)
        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        return self
    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss())

big = int(sys.argv[2])
g = torch.Generator().manual_seed(0)
sd = {"embed.weight": torch.randn(big // 4, generator=g).reshape(-1, 1024)}
for i in range(4):
    sd[f"layer.{i}.weight"] = torch.randn(256, 256, generator=g)
theta.save_to_git({"warm": torch.ones(4)}, "warm.pt", "imports and pools")  # every module loaded before measuring
for v in range(3):
    if v:
        with torch.no_grad():
            for t in sd.values():
                t.add_(1e-3)
    before = rss()
    t0 = time.perf_counter()
    with Peak() as p:
        theta.save_to_git(sd, "model.pt", f"v{v + 1}")
    print(json.dumps({"version": v + 1, "before": before, "peak": p.peak, "seconds": time.perf_counter() - t0}),
          flush=True)
"""


def memory(args, work: Path, env: dict) -> dict:
    big = args.big_mib << 20
    results = {}

    def run(name: str, cgroup=None) -> dict | None:
        repo = new_repo(work, f"memory-{name}", env, tool=None)
        p = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(ROOT), str(big)], cwd=repo, env=env,
                           capture_output=True, text=True, preexec_fn=cgroup.join if cgroup else None)
        saves = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        if p.returncode != 0:
            return {"saves": saves, "failed": p.returncode, "stderr": p.stderr[-2000:]}
        return {"saves": saves}

    print(f"\n== memory: a state dict with a {args.big_mib} MiB float32 group, saved three times (small steps)")
    got = run("free")
    results["free"] = got
    if "failed" in got:
        print(f"failed: {got}")
        return results
    for s in got["saves"]:
        print(f"save v{s['version']}: peak RSS {(s['peak'] - s['before']) / 2**20:+.0f} MiB over the "
              f"{s['before'] / 2**20:.0f} MiB before it ({s['seconds']:.2f} s)")
    why = MemoryCgroup.unavailable_reason()
    if why is not None:
        print(f"(no memory cgroup: {why})")
        return results
    limit = max(s["before"] for s in got["saves"]) + big // 2
    cg = MemoryCgroup.create(f"inproc-mem-{os.getpid()}", limit)
    try:
        inside = run("cgroup", cg)
        results["cgroup"] = {"limit": limit, **inside, "peak": cg.peak(), "oom_kills": cg.oom_kills()}
    finally:
        cg.remove(wait=5, kill=True)
    c = results["cgroup"]
    done = [s["version"] for s in c.get("saves", [])]
    ended = "" if len(done) == 3 else f"; then killed (OOM kills: {c['oom_kills']})"
    print(f"in a memory cgroup of {limit / 2**20:.0f} MiB (the process before a save + half the big group; "
          f"page cache counted): saves {', '.join(f'v{v}' for v in done) or 'none'} completed{ended}; the "
          f"kernel's peak {c['peak'] / 2**20:.0f} MiB")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="train,replay,memory")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--big-mib", type=int, default=256)
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = ap.parse_args()
    only = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-inprocess-", dir=args.work))
    env = git_env(work / "home", pythonpath=True)
    sh(["git", "theta", "install"], work, env)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; work in {work}")
    out = {}
    try:
        if "train" in only or "replay" in only:
            out["train"] = train(args, work, env)
        if "replay" in only:
            out["replay"] = replay([Path(f) for f in out["train"]["files"]], work, env)
        if "memory" in only:
            out["memory"] = memory(args, work, env)
    finally:
        if args.json:
            args.json.write_text(json.dumps(out, indent=1, default=str))
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
