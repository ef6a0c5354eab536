#!/usr/bin/env python3
"""The git-theta demo: version a small transformer-like model in git, beside plain git-lfs.

In a scratch repository under a temp dir (its own HOME and git config, so yours is untouched) it:
  1. makes a 4-layer transformer-like checkpoint (~64 MiB fp32, torch.save),
  2. commits it with theta, fine-tunes two layers and commits again (only the changed groups are stored),
  3. branches: the branch tunes the output head, main tunes another layer; `git diff` shows what changed,
  4. merges the branch with theta's merge driver (groups changed on one side only are taken from that side,
     no tensor is even read), checks the merged model tensor by tensor,
  5. checks out the first commit again (bit-for-bit equal tensors), lists the tracked checkpoints,
  6. replays the same history with plain git-lfs and prints time and stored bytes side by side.

    python3 scripts/demo.py [--keep] [--workdir DIR] [--layers N]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages; scripts/ (this folder) is already first

from bench.harness import dir_bytes, git_env  # the benchmarks' isolated git environment and measuring

MiB = 1 << 20


def say(msg: str = "") -> None:
    print(msg, flush=True)


class Repo:
    def __init__(self, path: Path, env: dict):
        self.path, self.env = path, env
        self.seconds = 0.0
        self.cpu = 0.0  # user + system seconds of the timed git commands and every process they started

    def git(self, *args: str, check: bool = True, timed: bool = False) -> subprocess.CompletedProcess:
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(["git", *args], cwd=self.path, env=self.env, capture_output=True, text=True)
        if timed:
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            self.seconds += time.perf_counter() - t0
            self.cpu += (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        if check and proc.returncode != 0:
            raise SystemExit(f"git {' '.join(args)} failed:\n{proc.stderr}")
        return proc

    def stored(self) -> int:
        return dir_bytes(self.path / ".git" / "objects", self.path / ".git" / "lfs" / "objects")

    def commit(self, src: Path, msg: str) -> float:
        shutil.copyfile(src, self.path / "model.pt")
        t0 = time.perf_counter()
        self.git("add", "model.pt", timed=True)
        self.git("commit", "-q", "-m", msg, timed=True)
        return time.perf_counter() - t0


def make_model(layers: int, seed: int = 0) -> OrderedDict:
    import torch

    d, ff, vocab = 512, 2048, 4096
    g = torch.Generator().manual_seed(seed)
    sd: OrderedDict = OrderedDict()
    sd["embed.weight"] = torch.randn(vocab, d, generator=g) * 0.02
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * d, d, generator=g) * 0.02
        sd[p + "attn.out.weight"] = torch.randn(d, d, generator=g) * 0.02
        sd[p + "mlp.fc1.weight"] = torch.randn(ff, d, generator=g) * 0.02
        sd[p + "mlp.fc2.weight"] = torch.randn(d, ff, generator=g) * 0.02
        sd[p + "norm.weight"] = torch.ones(d)
    sd["head.weight"] = torch.randn(vocab, d, generator=g) * 0.02
    return sd


def tweak(sd: OrderedDict, prefixes: tuple[str, ...], seed: int) -> OrderedDict:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = OrderedDict(sd)
    for k, v in sd.items():
        if k.startswith(prefixes):
            out[k] = v + torch.randn(v.shape, generator=g) * 1e-3
    return out


def save(sd: OrderedDict, path: Path) -> Path:
    import torch

    torch.save({"model": sd, "step": int(path.stem.split("-")[0][1:] or 0)}, path)
    return path


def same_tensors(path: Path, expected: OrderedDict) -> bool:
    import torch

    got = torch.load(path, weights_only=True)["model"]
    return list(got) == list(expected) and all(torch.equal(got[k], v) for k, v in expected.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the scratch repositories")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="theta-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"
    home.mkdir(exist_ok=True)
    env = git_env(home)
    for k, v in {"user.name": "Theta Demo", "user.email": "demo@example.com", "init.defaultBranch": "main",
                 "advice.detachedHead": "false"}.items():
        subprocess.run(["git", "config", "--global", k, v], env=env, check=True)
    t_start = time.perf_counter()
    try:
        run_demo(work, env, args.layers)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"\n(scratch kept in {work})")
    say(f"\ndemo finished in {time.perf_counter() - t_start:.0f}s")
    return 0


def run_demo(work: Path, env: dict, layers: int) -> None:
    data = work / "data"
    data.mkdir(exist_ok=True)
    say("== git-theta: a model versioned parameter group by parameter group ==")
    say(f"scratch directory: {work} (own HOME and git config)\n")

    v1 = make_model(layers)
    raw = sum(v.numel() * 4 for v in v1.values())
    say(f"1. model: {len(v1)} parameter groups, {raw / MiB:.1f} MiB fp32 (torch.save)")
    v2 = tweak(v1, ("layers.0.", "layers.1."), 1)                       # fine-tune two layers
    branch = tweak(v2, ("head.",), 2)                                     # branch: tune the head
    main_side = tweak(v2, (f"layers.{layers - 1}.mlp",), 3)              # main: tune the last MLP
    merged = OrderedDict((k, branch[k] if k.startswith("head.") else main_side[k]) for k in v2)
    files = {name: save(sd, data / f"{name}.pt") for name, sd in
             (("v1", v1), ("v2", v2), ("v3-branch", branch), ("v3-main", main_side))}

    theta = Repo(work / "theta", env)
    subprocess.run(["git", "init", "-q", str(theta.path)], env=env, check=True)
    theta.git("theta", "install", "--local")
    theta.git("theta", "track", "*.pt")
    theta.git("add", ".gitattributes")
    theta.git("commit", "-q", "-m", "track checkpoints with theta")
    base = theta.stored()
    say("2. git theta install --local; git theta track '*.pt'")

    t = theta.commit(files["v1"], "base model")
    s1 = theta.stored() - base
    say(f"3. commit base model            {t:5.1f}s   stored {s1 / MiB:6.1f} MiB ({s1 / raw:.2f} x raw)")
    t = theta.commit(files["v2"], "fine-tune layers 0-1")
    s2 = theta.stored() - base
    say(f"4. commit fine-tune (2 layers)  {t:5.1f}s   stored +{(s2 - s1) / MiB:5.1f} MiB (unchanged groups: 0 bytes)")
    theta.git("checkout", "-q", "-b", "head-tuning", timed=True)
    t = theta.commit(files["v3-branch"], "tune the output head")
    say(f"5. branch head-tuning: commit   {t:5.1f}s   (changes head.weight)")
    theta.git("checkout", "-q", "main", timed=True)
    t = theta.commit(files["v3-main"], f"tune layers.{layers - 1}.mlp")
    say(f"   main: commit                 {t:5.1f}s   (changes layers.{layers - 1}.mlp.*)")

    say("\n6. git diff main head-tuning -- model.pt   (theta's diff driver)")
    diff = theta.git("diff", "main", "head-tuning", "--", "model.pt", check=False)
    lines = (diff.stdout or diff.stderr).strip().splitlines()
    for line in lines[:14]:
        say("   " + line)
    if len(lines) > 14:
        say(f"   ... ({len(lines) - 14} more lines)")

    say("\n7. git merge head-tuning   (theta's merge driver: each side changed different groups)")
    t0 = time.perf_counter()
    m = theta.git("merge", "--no-edit", "-q", "head-tuning", check=False, timed=True)
    if m.returncode != 0:
        say("   merge failed:\n" + m.stdout + m.stderr)
        raise SystemExit(1)
    ok = same_tensors(theta.path / "model.pt", merged)
    say(f"   merged in {time.perf_counter() - t0:.1f}s; merged model has main's MLP and the branch's head: "
        f"{'yes' if ok else 'NO'}")
    if not ok:
        raise SystemExit("the merged checkpoint is not what was expected")
    shutil.copyfile(theta.path / "model.pt", data / "merged.pt")

    say("\n8. git checkout <base commit>")
    first = theta.git("rev-list", "--reverse", "HEAD").stdout.split()[1]
    t0 = time.perf_counter()
    theta.git("checkout", "-q", first, timed=True)
    ok = same_tensors(theta.path / "model.pt", v1)
    status = theta.git("status", "--porcelain").stdout.strip()
    say(f"   {time.perf_counter() - t0:.1f}s; tensors bit for bit equal to the base model: {'yes' if ok else 'NO'}; "
        f"git status clean: {'yes' if not status else 'NO'}")
    if not ok or status:
        raise SystemExit("checkout did not restore the base model")
    theta.git("checkout", "-q", "main", timed=True)

    say("\n9. git theta ls-files")
    for line in theta.git("theta", "ls-files").stdout.strip().splitlines():
        say("   " + line)
    say("\n10. git log --oneline")
    for line in theta.git("log", "--oneline", "--graph").stdout.strip().splitlines():
        say("   " + line)

    # -- the same history with plain git-lfs ----------------------------------------------------------
    say("\n11. the same history with plain git-lfs ...")
    lfs = Repo(work / "lfs", env)
    subprocess.run(["git", "init", "-q", str(lfs.path)], env=env, check=True)
    lfs.git("lfs", "install", "--local")
    lfs.git("lfs", "track", "*.pt")
    lfs.git("add", ".gitattributes")
    lfs.git("commit", "-q", "-m", "track checkpoints with git-lfs")
    lfs_base = lfs.stored()
    lfs.commit(files["v1"], "base model")
    lfs.commit(files["v2"], "fine-tune layers 0-1")
    lfs.git("checkout", "-q", "-b", "head-tuning", timed=True)
    lfs.commit(files["v3-branch"], "tune the output head")
    lfs.git("checkout", "-q", "main", timed=True)
    lfs.commit(files["v3-main"], f"tune layers.{layers - 1}.mlp")
    lfs.git("merge", "--no-edit", "-q", "head-tuning", check=False, timed=True)  # binary conflict
    lfs.commit(data / "merged.pt", "merge head-tuning (resolved by hand)")
    lfs.git("checkout", "-q", lfs.git("rev-list", "--reverse", "HEAD").stdout.split()[1], timed=True)
    lfs.git("checkout", "-q", "main", timed=True)

    th_stored, lfs_stored = theta.stored() - base, lfs.stored() - lfs_base
    say("\n== summary: the same history (5 model versions incl. a merge; checkouts) ==")
    say(f"{'':24}{'git-lfs':>12}{'git-theta':>12}{'ratio':>8}")
    say(f"{'git time (s)':<24}{lfs.seconds:12.1f}{theta.seconds:12.1f}{theta.seconds / lfs.seconds:8.2f}")
    say(f"{'git CPU seconds':<24}{lfs.cpu:12.1f}{theta.cpu:12.1f}{theta.cpu / lfs.cpu:8.2f}")
    say(f"{'stored (MiB)':<24}{lfs_stored / MiB:12.1f}{th_stored / MiB:12.1f}{th_stored / lfs_stored:8.2f}")
    say("git-lfs stores every version whole and cannot merge checkpoints (the demo resolved its conflict by hand);")
    say("theta stores only changed groups, compressed, and merged the branches itself.")
    say(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: git time is wall-clock and suffers "
        "when the load exceeds the cores; CPU seconds (of git and every process it started) do not)")


if __name__ == "__main__":
    sys.exit(main())
