"""GIT_THETA_THREADS: 1 runs every pool inline (no worker thread: a one-core baseline), more runs them on
threads; the metadata and blobs a clean produces do not depend on it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CLEAN = r"""
import json, sys, threading
import numpy as np, safetensors.numpy
from pathlib import Path
from theta.base import parallel
from theta.model.clean import clean_checkpoint
from theta.storage import metadata
from theta.storage.store import LfsStore
work = Path(sys.argv[1])
rng = np.random.default_rng(0)
arrays = {f"w{i}": rng.standard_normal((300, 700), dtype=np.float32) for i in range(3)}  # several 4 MiB frames
safetensors.numpy.save_file(arrays, str(work / "m.safetensors"))
store = LfsStore(work / "lfs" / "objects")
first = clean_checkpoint(work / "m.safetensors", store)
arrays["w1"] = arrays["w1"] * np.float32(1.001)
safetensors.numpy.save_file(arrays, str(work / "m.safetensors"))
second = clean_checkpoint(work / "m.safetensors", store, first)
blobs = sorted(str(p.relative_to(store.objects_dir)) for p in store.objects_dir.rglob("*") if p.is_file())
print(json.dumps({"threads": parallel.CODEC_THREADS, "live": threading.active_count(),
                  "inline": all(isinstance(p, parallel.Inline) for p in parallel._pools.values()),
                  "meta": [metadata.dumps(first), metadata.dumps(second)], "blobs": blobs}))
"""


def clean_with(threads: str, work: Path) -> dict:
    work.mkdir()
    env = {**os.environ, "GIT_THETA_THREADS": threads, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CLEAN, str(work)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_one_thread_runs_inline_and_stores_what_two_threads_store(tmp_path):
    one, two = clean_with("1", tmp_path / "one"), clean_with("2", tmp_path / "two")
    assert one["threads"] == 1 and one["inline"] and one["live"] == 1  # no worker thread was ever started
    assert two["threads"] == 2 and not two["inline"] and two["live"] > 1
    assert one["meta"] == two["meta"] and one["blobs"] == two["blobs"] and len(one["blobs"]) >= 4


def test_inline_executor_reports_failures_through_the_future():
    from theta.base.parallel import Inline

    f = Inline().submit(lambda x: 1 / x, 0)
    assert f.done() and isinstance(f.exception(), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        f.result()
    assert Inline().submit(pow, 2, 10).result() == 1024
