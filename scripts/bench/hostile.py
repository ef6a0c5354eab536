"""What checking untrusted input costs: side by side with the code before the checks.

    python3 scripts/bench/hostile.py [--groups 100000] [--mib 256] [--repeat 3]
    python3 scripts/bench/hostile.py --clones

1. **parse**: ``theta.storage.metadata.loads`` of a metadata text of ``--groups`` groups, with the schema
   checks (this branch) vs the parser before them (``loads`` at the branch's base commit, no checks);
2. **checkout**: rebuilding a ``--mib`` MiB checkpoint to /dev/null (``smudge_to_stream``, torch) in
   ``verify="hash"``, ``"frames"`` on a fresh clone (no bindings: every group is hashed once and bound), and
   ``"frames"`` once bound (a later checkout: no hashing, as before the fix);
3. **hdf5**: ``clean_checkpoint`` of an HDF5 file in-process vs ``isolate=True`` (libhdf5 in a child);
4. **crafted clones** (``--clones``): the issue's hostile repositories (tests/support/crafted.py) cloned with
   theta installed under a 60 s limit and a 1 GiB memory cgroup (root): seconds and the cgroup's peak. The
   peer is the issue's own measurement before the fix (>60 s for 10,000 steps; out of memory for 100,000
   groups); it is not re-run here (it would run for hours or be killed).

Each contender runs in a fresh child process; the figures are the CPU seconds of the measured work (user +
system, its own child processes included: robust on a shared machine), of the whole child, and the peak RSS
of its whole process tree (the largest sum of RSS over the child and its children -- for ``isolate`` the
HDF5 parser too -- sampled every 20 ms). Best of ``--repeat`` runs; ratios are ours / peer.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_COMMIT = "6808bb7"  # the branch's base: the metadata parser without schema checks
MiB = 1 << 20


def _clock() -> float:
    """CPU seconds of this process and its finished children: robust on a shared, busy machine (wall time
    there measures the neighbours); the parent also prints each child's wall time."""
    self_, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


# -- the work of each contender (run in a child) ----------------------------------------------------------
def _old_loads():
    src = subprocess.run(["git", "show", f"{BASE_COMMIT}:theta/storage/metadata.py"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "metadata_before.py"
    path.write_bytes(src)
    spec = importlib.util.spec_from_file_location("metadata_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["metadata_before"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod.loads


def _report(res: dict) -> None:
    print(json.dumps(res))


def child(task: str, workdir: Path) -> None:
    sys.path.insert(0, str(ROOT))
    if task in ("parse-before", "parse-checked"):
        text = (workdir / "meta.txt").read_bytes()
        if task == "parse-before":
            loads = _old_loads()
        else:
            from theta.storage.metadata import loads
        t0 = _clock()
        meta = loads(text)
        _report({"seconds": _clock() - t0, "groups": len(meta.groups)})
    elif task.startswith("checkout-"):
        from theta.model.smudge import smudge_to_stream
        from theta.storage.metadata import loads
        from theta.storage.store import LfsStore

        mode = task.split("-", 1)[1]
        store = LfsStore(workdir / "lfs" / "objects")
        meta = loads((workdir / "ckpt.meta").read_bytes())
        if mode == "frames-fresh":  # a fresh clone: the store has the objects but no bindings
            import shutil

            shutil.rmtree(workdir / "lfs" / "theta-verified", ignore_errors=True)
        with open(os.devnull, "wb") as out:
            t0 = _clock()
            smudge_to_stream(meta, store, out, "model.pt", verify="hash" if mode == "hash" else "frames")
        _report({"seconds": _clock() - t0})
    elif task in ("hdf5-inprocess", "hdf5-isolated"):
        from theta.model.clean import CleanOptions, clean_checkpoint
        from theta.storage.store import LfsStore

        store = LfsStore(Path(tempfile.mkdtemp()) / "objects")
        t0 = _clock()
        clean_checkpoint(workdir / "m.h5", store, None, CleanOptions(isolate=task == "hdf5-isolated"))
        _report({"seconds": _clock() - t0})
    else:
        raise SystemExit(f"unknown task {task}")


def run(task: str, workdir: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", task, str(workdir)], stdout=subprocess.PIPE)
    peak = 0
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:  # the largest sum of RSS over the child's process tree, every 20 ms
        try:
            tree = [ps] + ps.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.Error:
            pass
        time.sleep(0.02)
    stdout = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{task} failed ({proc.returncode})")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads(stdout.decode().strip().splitlines()[-1])
    res["rss"] = peak
    res.update(wall=wall, cpu=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return res


# -- inputs ----------------------------------------------------------------------------------------------
def make_metadata(workdir: Path, groups: int) -> None:
    sys.path.insert(0, str(ROOT))
    from theta.base import lsh
    from theta.storage.metadata import CheckpointMeta, GroupMeta, Step, dumps
    from theta.storage.store import BlobRef

    import hashlib

    gs = {}
    for i in range(groups):
        h = hashlib.sha256(str(i).encode()).hexdigest()
        oid = hashlib.sha256(h.encode()).hexdigest()
        gs[f"model.layers.{i // 10}.w{i % 10}"] = GroupMeta(
            f"model.layers.{i // 10}.w{i % 10}", "bfloat16", (4096, 1024), h,
            [Step("dense", BlobRef(oid, 6 << 20), {}, h)], lsh=list(range(-8, 8)), is_parameter=True)
    meta = CheckpointMeta("torch", sorted(gs), gs, structure={"dict": [[n, {"tensor": n}] for n in sorted(gs)]},
                          lsh=dict(lsh.PARAMS))
    (workdir / "meta.txt").write_text(dumps(meta))


def make_checkpoint(workdir: Path, mib: int) -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch
    from theta.model.clean import clean_checkpoint
    from theta.storage.metadata import dumps
    from theta.storage.store import LfsStore

    g = torch.Generator().manual_seed(0)
    n = 32
    sd = {f"layer{i}.w": torch.randn((mib * MiB) // (4 * n), generator=g) for i in range(n)}
    torch.save(sd, workdir / "src.pt")
    meta = clean_checkpoint(workdir / "src.pt", LfsStore(workdir / "lfs" / "objects"))
    (workdir / "ckpt.meta").write_text(dumps(meta))
    os.unlink(workdir / "src.pt")
    import h5py

    with h5py.File(workdir / "m.h5", "w") as f:
        for i in range(100):
            f.create_dataset(f"l{i}/kernel", data=np.random.default_rng(i).standard_normal(64 << 10).astype(np.float32))


def clones() -> None:
    """The crafted repositories of the issue, each cloned once (see the module docstring)."""
    import numpy as np

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's theta, not an installed one
    from support.crafted import Attacker, group_line, meta_text, step, value_hash, victim_clone
    from support.gitrepo import GitEnv

    with tempfile.TemporaryDirectory() as d:
        for case in ("10,000 dense steps of one blob", "100,000 groups of 64 MiB", "oid ../../../../etc/hostname"):
            genv = GitEnv.create(Path(d) / case.split()[0].replace(",", ""))
            evil = Attacker.create(genv)
            zeros = np.zeros(16 << 20, dtype=np.float32)  # 64 MiB of zeros: a 3 KB blob
            ref, h = evil.blob({"values": zeros}), value_hash(zeros)
            if case.startswith("10,000"):
                groups = [group_line("w", "float32", [16 << 20], [step("dense", ref, h)] * 10_000)]
            elif case.startswith("100,000"):
                groups = [group_line(f"g{i:06d}", "float32", [16 << 20], [step("dense", ref, h)])
                          for i in range(100_000)]
            else:
                groups = [group_line("w", "float32", [4], [step("dense", {"oid": "../../../../etc/hostname",
                                                                          "size": 8}, h)])]
            text = meta_text(groups)
            evil.commit({"model.pt": text})
            evil.push()
            res, _ = victim_clone(genv, evil.url, "clone")
            error = next((ln for ln in res.err.splitlines() if "error:" in ln), "")
            peak = f"{res.peak_bytes / MiB:.0f} MiB" if res.peak_bytes else "n/a (no cgroup)"
            print(f"{case:34} metadata {len(text) / MiB:5.1f} MiB, blob {ref.size} B: clone exit {res.returncode} "
                  f"in {res.seconds:.1f} s, cgroup peak {peak}, oom {res.oom_killed}\n    {error[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("TASK", "DIR"))
    ap.add_argument("--groups", type=int, default=100_000)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clones", action="store_true", help="only the crafted clones (section 4)")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    if args.clones:
        clones()
        return
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        make_metadata(work, args.groups)
        make_checkpoint(work, args.mib)
        size = (work / "meta.txt").stat().st_size
        print(f"metadata: {args.groups} groups, {size / MiB:.1f} MiB; checkpoint {args.mib} MiB in 32 groups; "
              f"HDF5: 100 datasets, 25 MiB; best of {args.repeat}")
        rows = [("parse", "parse-before", "parse-checked"),
                ("checkout: frames fresh clone vs bound", "checkout-frames-bound", "checkout-frames-fresh"),
                ("checkout: hash vs frames bound", "checkout-frames-bound", "checkout-hash"),
                ("hdf5 clean: isolated vs in-process", "hdf5-inprocess", "hdf5-isolated")]
        print(f"{'comparison (ours / peer)':40} {'peer':>22} {'ours':>22} {'work':>7} {'cpu':>7} {'rss':>7}")
        for label, peer, ours in rows:
            results = {}
            for task in (peer, ours):
                runs = []
                for _ in range(args.repeat):
                    if task == "checkout-frames-bound":  # bind first (what a fresh clone's checkout leaves)
                        run("checkout-frames-fresh", work)
                    runs.append(run(task, work))
                results[task] = min(runs, key=lambda r: r["seconds"])
            p, o = results[peer], results[ours]
            print(f"{label:40} {peer:>22} {ours:>22} {o['seconds'] / p['seconds']:>6.2f}x "
                  f"{o['cpu'] / p['cpu']:>6.2f}x {o['rss'] / p['rss']:>6.2f}x")
            for task in (peer, ours):
                r = results[task]
                print(f"    {task:36} work {r['seconds']:.3f} s CPU, whole child {r['cpu']:.2f} s CPU "
                      f"({r['wall']:.2f} s wall), peak rss {r['rss'] / MiB:.0f} MiB")


if __name__ == "__main__":
    main()
