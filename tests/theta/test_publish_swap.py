"""Publishing a materialized checkpoint over its placeholder (theta.base.scratch.exchange, materialize._publish) and
the CRC-32 the torch writer needs (zipslice.crc): real files, real races (the placeholder rewritten at the worst
moments), values checked against zlib's."""
from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

from theta.base import scratch
from theta.commands.filter import materialize
from zipslice import crc

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")


@linux_only
def test_exchange_swaps_two_files_in_one_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"new checkpoint")
    b.write_bytes(b"placeholder")
    ino_a, ino_b = a.stat().st_ino, b.stat().st_ino
    assert scratch.exchange(a, b) is True
    assert (a.read_bytes(), b.read_bytes()) == (b"placeholder", b"new checkpoint")
    assert (a.stat().st_ino, b.stat().st_ino) == (ino_b, ino_a)  # names swapped, no copy


@linux_only
def test_exchange_with_a_missing_file_raises_and_changes_nothing(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"x")
    with pytest.raises(FileNotFoundError):
        scratch.exchange(a, tmp_path / "missing")
    assert a.read_bytes() == b"x" and not (tmp_path / "missing").exists()


def _pair(tmp_path):
    tmp, target = tmp_path / "tmp", tmp_path / "model.pt"
    tmp.write_bytes(b"the whole checkpoint")
    target.write_bytes(b"theta-metadata 1\n...")
    return tmp, target, os.stat(target)


def test_publish_replaces_the_placeholder_and_removes_it(tmp_path):
    tmp, target, before = _pair(tmp_path)
    assert materialize._publish(tmp, target, before) is True
    assert target.read_bytes() == b"the whole checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_publish_keeps_a_placeholder_rewritten_before_it(tmp_path):
    tmp, target, before = _pair(tmp_path)
    (tmp_path / "theirs").write_bytes(b"the user's own file")
    os.replace(tmp_path / "theirs", target)
    assert materialize._publish(tmp, target, before) is False
    assert target.read_bytes() == b"the user's own file" and tmp.read_bytes() == b"the whole checkpoint"


@linux_only
def test_publish_swaps_back_when_the_placeholder_changed_during_the_swap(tmp_path, monkeypatch):
    """The write lands between the check and the exchange: the check saw the placeholder (stale stat), the
    exchange took the user's file; it is put back under the real name."""
    tmp, target, before = _pair(tmp_path)
    (tmp_path / "theirs").write_bytes(b"the user's own file")
    os.replace(tmp_path / "theirs", target)
    real_stat = os.stat
    monkeypatch.setattr(materialize.os, "stat", lambda p, *a, **k: before if str(p) == str(target)
                        else real_stat(p, *a, **k))
    assert materialize._publish(tmp, target, before) is False
    monkeypatch.undo()
    assert target.read_bytes() == b"the user's own file" and tmp.read_bytes() == b"the whole checkpoint"


@pytest.mark.parametrize("n", [0, 1, 4095, 1 << 20, (3 << 20) + 17])
def test_crc32_is_zlibs(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert crc.crc32(data) == zlib.crc32(data)
    half = n // 2
    assert crc.crc32(data[half:], crc.crc32(data[:half])) == zlib.crc32(data)  # continued, as zlib's
    assert crc.crc32(memoryview(data.view(np.uint8))) == zlib.crc32(data.tobytes())
