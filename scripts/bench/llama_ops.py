"""The steps of scripts/bench/llama.py that are not git commands: zipslice's convert (a cast to float32: a 7.7 GB
zip64 torch file), show and diff of the Llama-shaped checkpoint, and theta's `git theta diff`, `git diff` (the
diff driver's norms), fsck, squash, export, merge-resolve with each numeric strategy and
``theta.load(path, rev=...).get_slice``, each measured in theta's memory cgroup like the git steps (wall, the
cgroup's peak with page cache, the peak RSS of the process tree) and checked:

- convert: the output read back by ``torch.load(mmap=True)``, every tensor equal bit for bit to torch's cast of
  the source (row blocks at a time, outside the cgroup, unmeasured);
- show: the element count and the maximum against the source's; zipslice diff: every tensor 0 elements changed;
- git theta diff / git diff: every group reported modified; fsck: exit 0 and "OK"; squash: the staged groups
  name the same values as HEAD's (only their steps changed), then unstaged; export: the exported shard equal bit
  for bit to the version's file;
- merge-resolve: from a merge left in conflict (no strategy configured; unmeasured), both shards resolved with
  the strategy; the staged result re-cleaned by git from the work tree gives the same metadata (as llama.py's
  merges are checked); then the merge is aborted;
- get_slice: 10 rows of the 1 GB embedding of ``HEAD~1`` equal to those of the version's file.

Only theta is measured here (git-lfs has none of these operations; the floor of a convert is the cp of its
output: printed with the convert).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import llama_model as lm
from harness import run_measured

STRATEGIES = ("average", "task-arithmetic", "ties", "dare", "slerp")
GET_SLICE = """
import sys
import numpy as np
import theta
from safetensors import safe_open
rev, path, name, version_file = sys.argv[1:5]
with theta.load(path, rev=rev) as lsd:
    got = lsd.get_slice(name, framework="np")[1000:1010]
with safe_open(version_file, "np") as f:
    import ml_dtypes  # (safetensors gives bfloat16 as ml_dtypes arrays)
    want = f.get_slice(name)[1000:1010]
ok = got.shape == want.shape and np.array_equal(got.view(np.uint16), want.view(np.uint16))
print("ok" if ok else f"differs: {got.shape} vs {want.shape}")
"""


def zipslice_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from zipslice.cli import main; main()", *args]


def check_convert(src_index: Path, out: Path) -> str:
    """The float32 torch file against torch's cast of the source, tensor by tensor, row blocks at a time."""
    import torch
    from safetensors import safe_open

    index = json.loads(src_index.read_text())["weight_map"]
    got = torch.load(out, weights_only=True, mmap=True)
    if sorted(got) != sorted(index):
        return f"tensors differ: {sorted(set(got) ^ set(index))[:3]}"
    for name, shard in index.items():
        with safe_open(src_index.parent / shard, "pt") as f:
            src = f.get_slice(name)
            rows = src.get_shape()[0]
            step = max(1, (16 << 20) // max(1, int(got[name][0].numel())))
            for r in range(0, rows, step):
                want = src[r:r + step].float()
                if got[name].dtype != torch.float32 or not torch.equal(got[name][r:r + step].view(torch.int32),
                                                                       want.view(torch.int32)):
                    return f"{name} rows {r}:{r + step} differ"
    return "ok"


def steps(c, wanted, record) -> None:
    """The steps above, on llama.py's context ``c`` (its theta repository after the git steps, on main at the
    partial version, branch ft2 beside it); ``record(step, measure, tree, note)`` prints and keeps a result
    (``measure.stdout``: what the command printed)."""
    repo, env, cg = c.repo, c.env, c.cgroup
    base, ft = c.version("base"), c.version("finetune")
    shard1, shard2 = (f"model/{s}" for s in lm.SHARDS)

    def measured(cmd, cwd=None):
        with tempfile.TemporaryFile() as f:
            m = run_measured(cmd, cwd or repo, env, cg, check=False, stdout=f)
            f.seek(0)
            m.stdout = f.read().decode(errors="replace")
        return m

    # -- zipslice --------------------------------------------------------------------------------------------
    out = c.root / "llama-float32.pt"
    if wanted("convert --dtype float32"):
        m = measured(zipslice_cmd("convert", str(base / lm.INDEX), str(out), "--dtype", "float32", "-q"))
        tree = check_convert(base / lm.INDEX, out) if m.ok else "n/a"
        size = out.stat().st_size if m.ok else 0
        record("convert --dtype float32", m, tree, f"{size / 1e9:.2f} GB" + (" (zip64)" if size >= 1 << 32 else "")
               if m.ok else "")
        cp = run_measured(["cp", str(out), str(out) + ".cp"], c.root, env, None, check=False)
        Path(str(out) + ".cp").unlink(missing_ok=True)
        record("cp of the convert's output", cp, "n/a", "the floor of writing it (no limit)")
    if (wanted("zipslice show (stats)") or wanted("zipslice diff")) and not out.exists():
        subprocess.run(zipslice_cmd("convert", str(base / lm.INDEX), str(out), "--dtype", "float32", "-q"),
                       env=env, check=True)
    if wanted("zipslice show (stats)"):
        m = measured(zipslice_cmd("show", str(out), "model.embed_tokens.weight", "--json"))
        tree = "n/a"
        if m.ok:
            stats = json.loads(m.stdout)["stats"]
            tree = "ok" if stats["count"] == c.dims.vocab * c.dims.hidden else f"count {stats['count']}"
        record("zipslice show (stats)", m, tree)
    if wanted("zipslice diff"):
        m = measured(zipslice_cmd("diff", str(base / lm.INDEX), str(out), "--json"))
        tree = "n/a"
        if m.returncode in (0, 1) and not m.oom_killed and m.stdout:
            changed = [t["name"] for t in json.loads(m.stdout)["tensors"] if t["n_changed"]]
            tree = "ok" if not changed else f"{len(changed)} tensors changed, e.g. {changed[0]}"
            m.returncode = 0  # 1: the dtypes differ, as they must
        record("zipslice diff", m, tree)
    out.unlink(missing_ok=True)

    # -- theta: diffs, fsck, squash, export, get_slice (history: main = base, finetune, partial) ------------
    if wanted("git theta diff (norms)"):
        m = measured(["git", "theta", "diff", "HEAD~2", "HEAD~1", "--json"])
        tree = "n/a"
        if m.ok:
            docs = json.loads(m.stdout)["files"]
            stats = [g for d in docs for g in d["groups"] if g["status"] == "modified" and g.get("stats")]
            tree = "ok" if len(stats) == len(c.dims.tensors()) else f"{len(stats)} groups with statistics"
        record("git theta diff (norms)", m, tree)
    if wanted("git diff (diff driver)"):
        m = measured(["git", "diff", "HEAD~2", "HEAD~1", "--", "model"])
        record("git diff (diff driver)", m, "ok" if m.ok and "model.embed_tokens.weight" in m.stdout
               else "n/a")
    if wanted("git theta fsck"):
        m = measured(["git", "theta", "fsck"])
        record("git theta fsck", m, "ok" if m.ok and "OK" in (m.stdout + m.stderr) else "n/a")
    if wanted("git theta squash"):
        m = measured(["git", "theta", "squash", shard1, shard2])
        record("git theta squash", m, _restaged(c) if m.ok else "n/a")
    if wanted("git theta export"):
        dest = c.root / "export" / lm.SHARDS[0]
        dest.parent.mkdir(exist_ok=True)
        m = measured(["git", "theta", "export", f"HEAD~1:{shard1}", str(dest)])
        tree = "n/a"
        if m.ok:
            same = lm.sha256_files(dest.parent, (lm.SHARDS[0],)) == lm.sha256_files(ft, (lm.SHARDS[0],))
            tree = "ok" if same else "differs from the version's file"
        record("git theta export", m, tree)
        shutil.rmtree(dest.parent, ignore_errors=True)
    if wanted("theta.load get_slice"):
        m = measured([sys.executable, "-c", GET_SLICE, "HEAD~1", shard1, "model.embed_tokens.weight",
                      str(ft / lm.SHARDS[0])])
        record("theta.load get_slice", m, m.stdout.strip() if m.ok else "n/a")

    # -- merge-resolve: a merge left in conflict, resolved with each strategy --------------------------------
    for strategy in STRATEGIES:
        step = f"merge-resolve ({strategy})"
        if not wanted(step):
            continue
        bare = {k: v for k, v in env.items() if k != "GIT_THETA_MERGE_STRATEGY"}
        subprocess.run(["git", "config", "--unset", "theta.merge.strategy"], cwd=repo, env=bare, capture_output=True)
        p = subprocess.run(["git", "merge", "-q", "--no-edit", "ft2"], cwd=repo, env=bare, capture_output=True,
                           text=True)
        if p.returncode == 0:
            record(step, None, "n/a", "the merge did not stop in conflict")
            c.git("reset", "-q", "--hard", "main@{1}")
            continue
        ms = [measured(["git", "theta", "merge-resolve", path, "--strategy", strategy]) for path in (shard1, shard2)]
        m = _combine(ms)
        record(step, m, _recleaned(c) if m.ok else "n/a")
        subprocess.run(["git", "merge", "--abort"], cwd=repo, env=env, capture_output=True)
        subprocess.run(["git", "reset", "-q", "--hard", "HEAD"], cwd=repo, env=env, capture_output=True)
        subprocess.run(["git", "theta", "checkout"], cwd=repo, env=env, capture_output=True)


def _combine(ms):
    from llama import combine

    return combine(*ms)


def _recleaned(c) -> str:
    """The staged result against the work tree, re-cleaned by git (touched: git cannot trust its stat data)."""
    from llama import reclean

    problems = reclean(c, c.repo)
    return "ok" if not problems else "; ".join(problems)


def _restaged(c) -> str:
    """After a squash: each staged (squashed) group names the same value as HEAD's and is one dense step, and
    something was rewritten; then the squash is unstaged (`git reset`)."""
    problems, rewritten = [], 0
    for path in (f"model/{s}" for s in lm.SHARDS):
        def groups(spec: str) -> dict:
            text = c.git("cat-file", "-p", spec).stdout
            return {d["group"]: d for d in map(json.loads, (x for x in text.splitlines() if x.startswith("{")))
                    if "group" in d}
        head, staged = groups(f"HEAD:{path}"), groups(f":{path}")
        if {n: g["hash"] for n, g in head.items()} != {n: g["hash"] for n, g in staged.items()}:
            problems.append(f"{Path(path).name}: the squashed groups name other values")
        if any(len(g["steps"]) != 1 or g["steps"][0]["type"] != "dense" for g in staged.values()):
            problems.append(f"{Path(path).name}: a group is not one dense step")
        rewritten += sum(head[n]["steps"] != g["steps"] for n, g in staged.items() if n in head)
    if not rewritten:
        problems.append("nothing squashed")
    c.git("reset", "-q", "--", "model")
    return "ok" if not problems else "; ".join(problems)
