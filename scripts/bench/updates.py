#!/usr/bin/env python3
"""Benchmark theta's update types side by side with dense theta and plain git-lfs.

Model: transformer-like fp32 checkpoint saved with torch.save (~300 MiB by default: d=1024, 5 layers of
q/k/v/o 1024x1024 + mlp 4096x1024 + 1024x4096 + norms, a 16000x1024 embedding; N(0, 0.02) weights).

1. LoRA: rank 8 on every attention matrix (new = W + B @ A, computed by torch), side-loaded
   (`git theta add --update-type low-rank --update-data lora.safetensors`) versus a dense theta commit and
   git-lfs: stored bytes (vs the factors' bytes), `git add` time, checkout time.
2. Full fine-tune: every float weight * (1 + 1e-3 N(0,1)), committed by plain `git add` (auto) versus a
   dense theta commit and git-lfs: stored bytes. Again with the model in bfloat16.
3. Chains: 7 further fine-tune commits under auto (the chain of every group reaches 8 steps), then peak RSS of
   the last `git add` and of a checkout that rebuilds every chain, against 2 x the largest group + 150 MiB.

Each git command runs in its own measuring subprocess: wall time, CPU time (user + sys of the whole
process tree: robust when the machine is busy), peak RSS (ru_maxrss of the largest process in the tree,
usually git itself, which buffers a smudged file whole with git-lfs too) and the theta filter process's own
peak RSS (psutil, polled every 10 ms). Files go under --workdir (default /tmp/theta-bench-updates), removed unless --keep.

    python3 scripts/bench/updates.py               # ~300 MiB
    python3 scripts/bench/updates.py --layers 1 --vocab 4000   # quick look (~70 MiB)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness import MiB, git_env, run_measured  # noqa: E402
from theta.storage.metadata import loads  # noqa: E402


def measured(cmd: list[str], cwd: Path, env: dict) -> dict:
    """The harness's measure of ``cmd`` as this benchmark's row: wall, CPU, largest process, theta filter."""
    m = run_measured(cmd, cwd, env)
    return {"rc": m.returncode, "wall": m.seconds, "cpu": m.cpu, "rss_mib": m.peak_proc_rss / 2**20,
            "filter_mib": m.peak_filter_rss / 2**20, "tree_mib": m.peak_tree_rss / 2**20}


class Env:
    """An isolated HOME with theta installed globally (filter, merge and diff drivers)."""

    def __init__(self, work: Path):
        self.work = work
        home = work / "home"
        self.env = git_env(home, pythonpath=True)  # measure this checkout's code
        self.run(["git", "theta", "install"], home)
        self.run(["git", "lfs", "install", "--skip-repo"], home)

    def run(self, cmd, cwd, extra=None) -> str:
        p = subprocess.run(cmd, cwd=cwd, env={**self.env, **(extra or {})}, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(map(str, cmd))} failed in {cwd}:\n{p.stderr}")
        return p.stdout

    def git(self, cwd, *args, extra=None) -> str:
        return self.run(["git", *args], cwd, extra)

    def repo(self, name: str, kind: str) -> Path:
        path = self.work / name
        self.git(self.work, "init", "-q", str(path))
        if kind == "theta":
            self.run(["git", "theta", "track", "*.pt"], path)
        else:
            self.git(path, "lfs", "track", "*.pt")
        self.git(path, "add", ".gitattributes")
        self.git(path, "commit", "-q", "-m", "attributes")
        return path

    def measure(self, cwd: Path, cmd: list[str], extra: dict | None = None) -> dict:
        return measured(cmd, cwd, {**self.env, **(extra or {})})


def lfs_bytes(repo: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (repo / ".git" / "lfs" / "objects").glob("??/??/*")}


def commit(env: Env, repo: Path, src: Path, message: str, cmd: list[str] | None = None,
           extra: dict | None = None) -> dict:
    """Copy ``src`` to repo/model.pt, `git add` it (measured), commit; returns the add measure + stored bytes."""
    before = lfs_bytes(repo)
    shutil.copyfile(src, repo / "model.pt")
    res = env.measure(repo, cmd or ["git", "add", "model.pt"], extra)
    env.git(repo, "commit", "-q", "-m", message)
    after = lfs_bytes(repo)
    res["stored"] = sum(v for k, v in after.items() if k not in before)
    return res


def checkout(env: Env, repo: Path) -> dict:
    os.unlink(repo / "model.pt")
    return env.measure(repo, ["git", "checkout", "--", "model.pt"])


# -- models ----------------------------------------------------------------------------------------------------
def base_state(d: int, layers: int, vocab: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict()
    sd["embed.weight"] = torch.randn(vocab, d, generator=g) * 0.02
    for i in range(layers):
        for m in ("q", "k", "v", "o"):
            sd[f"layers.{i}.attn.{m}.weight"] = torch.randn(d, d, generator=g) * 0.02
        sd[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * d, d, generator=g) * 0.02
        sd[f"layers.{i}.mlp.down.weight"] = torch.randn(d, 4 * d, generator=g) * 0.02
        sd[f"layers.{i}.norm1.weight"] = torch.ones(d)
        sd[f"layers.{i}.norm2.weight"] = torch.ones(d)
    return sd


def lora(sd, rank: int, seed: int = 1):
    """W + B @ A on every attention matrix; returns (new state, side-load tensors, factor bytes)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    new, side, nbytes = OrderedDict(sd), {}, 0
    for k, w in sd.items():
        if ".attn." in k:
            B = torch.randn(w.shape[0], rank, generator=g) * 0.01
            A = torch.randn(rank, w.shape[1], generator=g) * 0.01
            new[k] = w + B @ A
            side[f"{k}/R"], side[f"{k}/C"] = B, A
            nbytes += (B.numel() + A.numel()) * 4
    return new, side, nbytes


def finetune(sd, rel: float, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return OrderedDict((k, (v.float() * (1 + rel * torch.randn(v.shape, generator=g))).to(v.dtype)
                        if v.is_floating_point() else v) for k, v in sd.items())


def encode_table(n: int = 1 << 22) -> None:
    """Pure encode sizes (no git): auto's choice vs the dense blob for fine-tune noise of several sizes."""
    import ml_dtypes
    import numpy as np

    from theta.storage import codec
    from theta.updates.auto import choose

    rng = np.random.default_rng(0)
    base32 = (rng.standard_normal(n) * 0.02).astype(np.float32)
    print(f"\n2b. encode only ({n / 2**20:.0f} Mi elements, N(0, 0.02) weights * (1 + noise N(0,1))): auto / dense")
    for dt in (np.float32, ml_dtypes.bfloat16, np.float16):
        row = []
        for rel in (1e-4, 1e-3, 1e-2):
            prev = base32.astype(dt)
            new = (prev.astype(np.float32) * (1 + rel * rng.standard_normal(n).astype(np.float32))).astype(dt)
            changed = float(np.mean(prev.view(f"u{prev.itemsize}") != new.view(f"u{new.itemsize}")))
            c = choose(new, prev)
            dense = len(codec.encode_array(new))
            row.append(f"noise {rel:g}: {c.size / dense:5.3f} {c.update_type} ({changed:4.0%} changed)")
        print(f"  {np.dtype(dt).name:9s} " + " | ".join(row))


def fmt(res: dict) -> str:
    filt = f" (filter {res['filter_mib']:5.1f})" if res.get("filter_mib") else ""
    return f"{res['wall']:6.2f}s wall {res['cpu']:6.2f}s cpu {res['rss_mib']:6.1f} MiB peak{filt}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/theta-bench-updates")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: lora,finetune,bf16,encode,chain")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    import torch
    from safetensors.torch import save_file

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = Env(work)
    files = work / "files"
    files.mkdir()
    base = base_state(args.d, args.layers, args.vocab)
    largest = max(v.numel() * v.element_size() for v in base.values())
    torch.save(base, files / "base.pt")
    size = (files / "base.pt").stat().st_size
    print(f"model: {size / MiB:.0f} MiB fp32, {len(base)} groups, largest group {largest / MiB:.1f} MiB "
          f"(machine load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    results: dict = {"size": size, "largest": largest}

    if "lora" not in skip:
        new, side, factor_bytes = lora(base, args.rank)
        torch.save(new, files / "lora.pt")
        save_file(side, str(files / "lora.safetensors"))
        del new, side
        rows = {}
        for name, kind in (("git-lfs", "lfs"), ("theta dense", "theta"), ("theta low-rank", "theta")):
            repo = env.repo(name.replace(" ", "-") + "-lora", kind)
            commit(env, repo, files / "base.pt", "base")
            # both theta contenders go through `git theta add` (same wrapper start-up cost)
            if name == "theta low-rank":
                cmd = ["git", "theta", "add", "model.pt", "--update-type", "low-rank",
                       "--update-data", str(files / "lora.safetensors")]
            elif name == "theta dense":
                cmd = ["git", "theta", "add", "model.pt", "--update-type", "dense"]
            else:
                cmd = None
            res = commit(env, repo, files / "lora.pt", "lora", cmd)
            res["checkout"] = checkout(env, repo)
            rows[name] = res
            shutil.rmtree(repo)
        print(f"\n1. LoRA rank {args.rank} on {sum(1 for k in base if '.attn.' in k)} attention matrices, "
              f"factors {factor_bytes / MiB:.2f} MiB")
        for name, r in rows.items():
            print(f"  {name:15s} stored {r['stored'] / MiB:8.2f} MiB | add {fmt(r)} | checkout {fmt(r['checkout'])}")
        lr, dn = rows["theta low-rank"], rows["theta dense"]
        print(f"  low-rank stored / factors       {lr['stored'] / factor_bytes:6.3f}   (target <= 1.1)")
        print(f"  low-rank add / dense add        {lr['wall'] / dn['wall']:6.3f} wall, "
              f"{lr['cpu'] / dn['cpu']:6.3f} cpu   (target <= 0.3)")
        print(f"  low-rank checkout / dense       {lr['checkout']['wall'] / dn['checkout']['wall']:6.3f} wall, "
              f"{lr['checkout']['cpu'] / dn['checkout']['cpu']:6.3f} cpu   (target <= 1.2)")
        print(f"  low-rank stored / git-lfs       {lr['stored'] / rows['git-lfs']['stored']:8.5f}")
        results["lora"] = rows

    for part, dtype in (("finetune", torch.float32), ("bf16", torch.bfloat16)):
        if part in skip:
            continue
        b = OrderedDict((k, v.to(dtype)) for k, v in base.items())
        torch.save(b, files / f"{part}-base.pt")
        torch.save(finetune(b, 1e-3, seed=2), files / f"{part}-ft.pt")
        del b
        rows = {}
        for name, kind in (("git-lfs", "lfs"), ("theta dense", "theta"), ("theta auto", "theta")):
            repo = env.repo(name.replace(" ", "-") + "-" + part, kind)
            commit(env, repo, files / f"{part}-base.pt", "base")
            extra = {"GIT_THETA_UPDATE_TYPE": "dense"} if name == "theta dense" else None
            rows[name] = commit(env, repo, files / f"{part}-ft.pt", "fine-tune", extra=extra)
            if name == "theta auto":
                meta = loads(env.git(repo, "show", "HEAD:model.pt"))
                rows[name]["types"] = sorted({g.steps[-1].type for g in meta.groups.values()})
            shutil.rmtree(repo)
        print(f"\n2. full fine-tune ({str(dtype).removeprefix('torch.')}, every weight * (1 + 1e-3 N(0,1)))")
        for name, r in rows.items():
            print(f"  {name:15s} stored {r['stored'] / MiB:8.2f} MiB | add {fmt(r)}")
        print(f"  auto stored / dense theta       {rows['theta auto']['stored'] / rows['theta dense']['stored']:6.3f}"
              f"   (target <= 0.7; types used: {', '.join(rows['theta auto'].get('types', []))})")
        print(f"  auto stored / git-lfs           {rows['theta auto']['stored'] / rows['git-lfs']['stored']:6.3f}")
        results[part] = rows

    if "encode" not in skip:
        encode_table()

    if "chain" not in skip:
        repo = env.repo("theta-chain", "theta")
        commit(env, repo, files / "base.pt", "base")
        sd, adds = base, []
        for i in range(1, args.chain):
            sd = finetune(sd, 1e-4, seed=10 + i)
            torch.save(sd, files / "step.pt")
            adds.append(commit(env, repo, files / "step.pt", f"step {i}"))
        meta = loads(env.git(repo, "show", "HEAD:model.pt"))
        chain_len = max(len(g.steps) for g in meta.groups.values())
        co = checkout(env, repo)
        bound = 2 * largest / MiB + 150  # issue #17's bound (3 x before chains were rebuilt in place)
        print(f"\n3. chains: {args.chain - 1} fine-tune commits (1e-4 noise) under auto; longest chain {chain_len} steps")
        print(f"  last add      {fmt(adds[-1])}  stored {adds[-1]['stored'] / MiB:.1f} MiB")
        print(f"  checkout      {fmt(co)}")
        ok = lambda r: "OK" if r["filter_mib"] <= bound else "OVER"  # noqa: E731
        print(f"  theta filter peak RSS vs 2 x largest group + 150 MiB = {bound:.0f} MiB: add {ok(adds[-1])} "
              f"({adds[-1]['filter_mib']:.0f} MiB), checkout {ok(co)} ({co['filter_mib']:.0f} MiB)")
        results["chain"] = {"adds": adds, "checkout": co, "chain_len": chain_len, "bound_mib": bound}

    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
