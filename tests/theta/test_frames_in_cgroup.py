"""theta's operations on a group bigger than a memory cgroup's limit, each run by a process inside the cgroup
(page cache counted): merges, fsck's chain check, squash and the diff statistics of a 256 MiB bfloat16 group (512
MiB as float32 work values) in 192 MiB -- about 40 MiB of it the interpreter and theta's modules, 50 MiB the
codec's frames in flight: a group held whole, or its float32 copy, would not fit. The results are checked
outside the cgroup against the same computations on the whole values (merge: bit for bit the whole computation; squash: the value; diff: the
statistics of the whole arrays). Real blobs in a real store; no git (the git commands are the Llama benchmark's,
scripts/bench/llama.py). Both slow; the same for a 1 GB group in 1 GiB too. The default run bounds the same
operations in-process (tests/theta/test_merge_frames.py, test_chain_check.py, test_diff_frames.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from theta.merges import get as get_strategy
from theta.model.diff import change_stats
from theta.storage.metadata import CheckpointMeta, GroupMeta, dumps
from theta.storage.store import LfsStore
from theta.updates import content_hash, get, steps

from support.limits import run_limited

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from pathlib import Path
from theta.merges.plan import MergePlan, Pending, execute
from theta.model.diff import MetaSide, change_stats
from theta.model.squash import squash_meta
from theta.storage.metadata import loads
from theta.storage.store import LfsStore
from theta.updates.chain_check import check_chain

work = Path(sys.argv[1])
op = sys.argv[2]
store = LfsStore(work / "objects")
meta = {n: loads((work / f"{n}.meta").read_bytes()) for n in ("o", "a", "b")}
g = {n: m.groups["w"] for n, m in meta.items()}
out = {}
if op.startswith("merge:"):
    strategy = op.split(":", 1)[1]
    plan = MergePlan(path="m.safetensors", ours=meta["a"], pending=[Pending("w", g["a"], g["b"], g["o"], strategy, {})],
                     header={"format": "safetensors", "order": ["w"], "structure": None, "metadata": {}, "lsh": {}})
    merged = execute(plan, store).groups["w"]
    out = {"hash": merged.hash, "oid": merged.steps[0].blob.oid, "lsh": merged.lsh, "fast": merged.fast}
elif op == "fsck":
    check_chain(g["b"], store, "m.safetensors")
    out = {"ok": True}
elif op == "squash":
    squashed, report = squash_meta(meta["b"], store, "m.safetensors")
    s = squashed.groups["w"]
    out = {"hash": s.hash, "oid": s.steps[0].blob.oid, "steps": len(s.steps)}
elif op == "diff":
    sides = [MetaSide(meta[n], n, store=store) for n in ("a", "b")]
    st = change_stats(sides[0].value("w"), sides[1].value("w"))
    out = {"changed": st.changed, "l2": st.l2, "old_l2": st.old_l2, "max_abs": st.max_abs, "numel": st.numel}
print(json.dumps(out))
"""


def _values(rows: int, cols: int):
    """ancestor, ours, theirs: bfloat16 values made without a random draw (a hash of the position), two
    fine-tunes of the ancestor (low mantissa bits changed), all finite."""
    k = np.arange(rows * cols, dtype=np.uint32)
    k *= np.uint32(2654435761)
    o = ((k >> np.uint32(16)).astype(np.uint16) & np.uint16(0x3F7F)) | np.uint16(0x3C00)  # |x| in [2^-7, 2)
    a = o ^ ((k >> np.uint32(3)).astype(np.uint16) & np.uint16(0x0003))
    b = o ^ ((k >> np.uint32(7)).astype(np.uint16) & np.uint16(0x0005))
    del k
    shape = (rows, cols)
    return [x.view(ml_dtypes.bfloat16).reshape(shape) for x in (o, a, b)]


def _build(work: Path, rows: int, cols: int):
    store = LfsStore(work / "objects")
    o, a, b = _values(rows, cols)
    base = steps.store_dense(o, store)
    groups = {"o": [base]}
    for name, new in (("a", a), ("b", b)):
        enc = get("delta").encode(new, o)
        groups[name] = [base, steps.store_step("delta", enc.parts, enc.params, content_hash(new), store)]
    for name, value in (("o", o), ("a", a), ("b", b)):
        g = GroupMeta(name="w", dtype="bfloat16", shape=(rows, cols), hash=content_hash(value), steps=groups[name])
        meta = CheckpointMeta(format="safetensors", order=["w"], groups={"w": g})
        (work / f"{name}.meta").write_text(dumps(meta))
    return store, (o, a, b)


def _run(work: Path, op: str, limit: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = run_limited([sys.executable, "-c", SCRIPT, str(work), op], cwd=work, env=env, timeout=600, memory=limit)
    if not res.capped:
        pytest.skip("no memory cgroup can be made here (needs root and a memory controller): ran nothing")
    assert res.returncode == 0 and not res.oom_killed, (op, res.returncode, res.err[-3000:])
    return json.loads(res.stdout)


def _check_all(work: Path, store: LfsStore, values, limit: int, strategies) -> None:
    o, a, b = values
    for strategy in strategies:
        s = get_strategy(strategy)
        got = _run(work, f"merge:{strategy}", limit)
        whole = s.merge("w", a, b, o if s.needs_ancestor else None)
        like = GroupMeta(name="w", dtype="bfloat16", shape=o.shape, hash="", steps=[])
        want = steps.dense_group(like, whole, store)
        del whole
        assert got == {"hash": want.hash, "oid": want.steps[0].blob.oid, "lsh": want.lsh, "fast": want.fast}, strategy
    assert _run(work, "fsck", limit) == {"ok": True}
    squashed = _run(work, "squash", limit)
    assert squashed["hash"] == content_hash(b) and squashed["steps"] == 1
    assert squashed["oid"] == steps.store_dense(b, store).blob.oid
    stats = _run(work, "diff", limit)
    want = change_stats(a, b)
    assert stats == {"changed": want.changed, "l2": want.l2, "old_l2": want.old_l2, "max_abs": want.max_abs,
                     "numel": want.numel}


@pytest.mark.slow  # ~3 minutes on a loaded 2-core machine; the default run bounds each in-process (tracemalloc)
def test_merge_fsck_squash_and_diff_of_a_group_bigger_than_the_cgroup(tmp_path):
    """A 256 MiB bfloat16 group (and its 512 MiB of float32 work values) in a 192 MiB cgroup."""
    store, values = _build(tmp_path, 16384, 8192)
    _check_all(tmp_path, store, values, 192 << 20, ["ties"])


@pytest.mark.slow
def test_every_strategy_on_a_1_gib_group_in_a_1_gib_cgroup(tmp_path):
    """The Llama-3-8B embedding's size (128256 x 4096 bfloat16: 1.05 GB) in 1 GiB, every numeric strategy."""
    store, values = _build(tmp_path, 128256, 4096)
    _check_all(tmp_path, store, values, 1 << 30, ["average", "task-arithmetic", "ties", "dare", "slerp"])
