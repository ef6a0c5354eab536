"""fsck's chain check and squash, frame by frame (theta.updates.chain_check, theta.squash): the same verdicts as
rebuilding each value whole -- every step's value against its recorded name, the last against the group's --
and the same stored group, in a few frames of memory. Real blobs in a real store."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from theta.base import lsh
from theta.base.errors import ChainError
from theta.model.squash import squash_meta
from theta.storage import codec
from theta.storage.metadata import CheckpointMeta
from theta.storage.store import LfsStore
from theta.updates import steps, stream
from theta.updates.rebuild import reconstruct
from theta.updates.chain_check import check_chain

from support.traced import traced_peak
from test_merge_streaming import chain, poked, tuned, weights


@pytest.fixture(autouse=True)
def small_frames(monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 4096)
    monkeypatch.setattr(stream, "BLOCK", 1000)


def history(store, rng, shape=(97, 61)):
    v = [weights(rng, shape)]
    v.append(tuned(rng, v[-1]))
    v.append(poked(rng, v[-1], 40))
    v.append(tuned(rng, v[-1]))
    return v, chain(store, v, ["delta", "sparse", "delta"])


def test_a_good_chain_passes_and_a_forged_step_name_is_found_at_its_step(tmp_path):
    store = LfsStore(tmp_path / "objects")
    _, group = history(store, np.random.default_rng(1))
    check_chain(group, store, "m.pt")
    for i in (1, 2):  # an intermediate step whose recorded name is not its value's
        bad = dataclasses.replace(group, steps=[s if j != i else dataclasses.replace(s, hash="blake3:" + "0" * 64)
                                                for j, s in enumerate(group.steps)])
        with pytest.raises(ChainError, match=rf"step {i}.*hash differs") as e:
            check_chain(bad, store, "m.pt")
        with pytest.raises(ChainError, match=rf"step {i}"):  # what rebuilding it whole says
            reconstruct(bad, store, file="m.pt")
        assert "m.pt" in str(e.value)
    forged = dataclasses.replace(group, hash="blake3:" + "1" * 64)
    with pytest.raises(ChainError, match="hash differs"):
        check_chain(forged, store, "m.pt")


def test_a_chain_read_by_position_is_checked_step_by_step(tmp_path):
    store = LfsStore(tmp_path / "objects")
    rng = np.random.default_rng(2)
    a = weights(rng, (30, 8))
    b = tuned(rng, np.ascontiguousarray(a[::-1]))
    group = chain(store, [a, np.ascontiguousarray(a[::-1]), b], ["rows", "delta"])  # rows moved
    assert isinstance(stream.source(group, store), stream.PositionalSource)
    check_chain(group, store)
    bad = dataclasses.replace(group, steps=[group.steps[0], dataclasses.replace(group.steps[1], hash="2" * 64),
                                            group.steps[2]])
    with pytest.raises(ChainError, match="hash differs"):
        check_chain(bad, store)


def test_a_check_holds_a_few_frames_not_the_value(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    monkeypatch.setattr(stream, "BLOCK", 1 << 15)
    store = LfsStore(tmp_path / "objects")
    values, group = history(store, np.random.default_rng(3), shape=(2048, 1024))  # 8 MiB
    size = values[0].nbytes
    del values
    _, peak = traced_peak(check_chain, group, store)
    assert peak < size / 4, peak / size


def test_squash_stores_what_the_whole_value_would_give_in_a_few_frames(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 128 << 10)
    monkeypatch.setattr(stream, "BLOCK", 1 << 15)
    lsh._pool()
    store = LfsStore(tmp_path / "objects")
    values, group = history(store, np.random.default_rng(4), shape=(2048, 1024))
    meta = CheckpointMeta(format="safetensors", order=["w"], groups={"w": group})
    (squashed, report), peak = traced_peak(squash_meta, meta, store, "m.safetensors")
    g = squashed.groups["w"]
    assert report.rewritten == 1 and len(g.steps) == 1 and g.steps[0].type == "dense"
    want = steps.store_dense(values[-1], store)  # the whole value, stored the way squash stored it before
    assert g.steps[0] == want and (g.hash, g.lsh, g.fast) == (group.hash, group.lsh, group.fast)
    assert np.array_equal(reconstruct(g, store).view(np.uint32), values[-1].view(np.uint32))
    assert peak < values[0].nbytes / 2, peak / values[0].nbytes
