"""theta.base.usercache: the LSH directions drawn once per user, read back by later processes, and never trusted
when the file is damaged."""
import os
import subprocess
import sys

import numpy as np
import pytest

from theta.base import usercache

SIGNATURE = """
import json, sys
import numpy as np
from theta.base import lsh
x = (np.sin(np.arange(300_000) * 0.37) * 0.02).astype(np.float32)  # (numpy.random must not be imported here)
print(json.dumps({"sig": lsh.signature(x), "random_imported": "numpy.random" in sys.modules}))
"""


def run_signature(cache_home, **env):
    out = subprocess.run([sys.executable, "-c", SIGNATURE], env={**os.environ, "XDG_CACHE_HOME": str(cache_home),
                                                                   **env},
                         capture_output=True, text=True, check=True).stdout
    import json

    return json.loads(out)


def drawn():
    return np.random.RandomState(20240917).standard_normal((1 << 16, 16))


def pool_file(cache_home):
    files = list((cache_home / "git-theta").glob("lsh-*"))
    assert len(files) == 1, files
    return files[0]


def test_the_directions_are_drawn_once_then_read_back_bit_for_bit(tmp_path):
    first = run_signature(tmp_path)
    assert first["random_imported"]  # drawn: nothing cached yet
    f = pool_file(tmp_path)
    assert f.stat().st_size == 16 + (1 << 16) * 16 * 8
    assert np.frombuffer(f.read_bytes(), "<f8", offset=16).tobytes() == drawn().astype("<f8").tobytes()
    second = run_signature(tmp_path)
    assert not second["random_imported"]  # read back: numpy.random never imported
    assert second["sig"] == first["sig"]


@pytest.mark.parametrize("damage", ["one byte flipped", "truncated", "grown", "empty"])
def test_a_damaged_cache_file_is_ignored_and_written_again(tmp_path, damage):
    clean = run_signature(tmp_path)
    f = pool_file(tmp_path)
    data = bytearray(f.read_bytes())
    if damage == "one byte flipped":
        data[1000] ^= 0x40
    elif damage == "truncated":
        del data[-8:]
    elif damage == "grown":
        data += b"\0" * 8
    else:
        data = bytearray()
    f.write_bytes(bytes(data))
    again = run_signature(tmp_path)
    assert again["random_imported"]  # not trusted: drawn again
    assert again["sig"] == clean["sig"]
    assert np.frombuffer(f.read_bytes(), "<f8", offset=16).tobytes() == drawn().astype("<f8").tobytes()


def test_an_unwritable_cache_only_means_drawing_each_time(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory would be")
    first = run_signature(blocker)
    second = run_signature(blocker)
    assert first["random_imported"] and second["random_imported"]
    assert first["sig"] == second["sig"]
    assert blocker.read_text() == "a file where the cache directory would be"


def test_without_a_home_nothing_is_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    assert usercache.directory() is None
    made = []
    got = usercache.cached_array("x.f8", "<f8", (3,), lambda: made.append(1) or np.arange(3.0))
    assert made == [1] and got.tolist() == [0.0, 1.0, 2.0]


def test_cached_array_reads_back_what_it_wrote(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = np.arange(12, dtype="<f4").reshape(3, 4)
    assert usercache.cached_array("a.f4", "<f4", (3, 4), lambda: want).tobytes() == want.tobytes()
    again = usercache.cached_array("a.f4", "<f4", (3, 4), lambda: pytest.fail("made again"))
    assert again.shape == (3, 4) and again.tobytes() == want.tobytes()
    assert not [p for p in (tmp_path / "git-theta").iterdir() if p.name.startswith(".")]  # no temp left
