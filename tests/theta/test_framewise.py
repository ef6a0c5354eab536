"""theta.model.framewise: a big group cleaned frame by frame stores, bit for bit, the blobs and metadata the
whole-value clean stores -- for every decision the clean makes (new, delta, chained previous, sparse, dense
wins, close, chain full, previous not fetched, dense asked for, NaN) and for the float dtypes it takes --
and a file that changes between two reads of a frame, or differs from git's bytes, is refused, leaving
nothing in the store.

Real torch checkpoints (plain stored members), a real store. Frames are made small (512 KiB) and the
streaming threshold 1 MiB, so groups of a few MiB cross several frames."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import zipslice
from theta.model import framewise
from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
from theta.base.errors import FileChanged
from theta.storage import codec, metadata
from theta.storage.store import LfsStore


@pytest.fixture(autouse=True)
def small_frames(monkeypatch):
    monkeypatch.setattr(codec, "FRAME_BYTES", 512 << 10)  # 2 LSH rows of float32 per frame
    monkeypatch.setattr(framewise, "STREAM_BYTES", 1 << 20)


@pytest.fixture
def passes(monkeypatch):
    """How many groups went through a frame pass."""
    count = [0]
    real = framewise.first_pass

    def counted(*a, **k):
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(framewise, "first_pass", counted)
    return count


def model(seed=0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        "embed": torch.from_numpy(rng.standard_normal((3000, 256), dtype=np.float32) * 0.02),  # 2.9 MiB
        "wide": torch.from_numpy(rng.standard_normal((600, 512)) * 0.02),                       # float64, 2.3 MiB
        "half": torch.from_numpy(rng.standard_normal((1100, 1024), dtype=np.float32)).to(torch.bfloat16),
        "small": torch.from_numpy(rng.standard_normal((96, 64), dtype=np.float32)),            # read whole
    }


def tuned(t: torch.Tensor, seed=1, scale=1e-3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (t.double() * (1 + scale * torch.randn(t.shape, generator=g, dtype=torch.float64))).to(t.dtype)


def blobs(store: LfsStore) -> dict[str, bytes]:
    root = store.objects_dir
    return {p.name: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def clean_both(tmp_path, versions, options=CleanOptions(), prepare=None):
    """Clean ``versions`` one after another, each against the one before, once frame by frame and once
    whole, each way in a store of its own; returns, per way, the metadata texts, the stores' blobs and the
    stats of the last clean."""
    out = {}
    for way, threshold in (("frames", 1 << 20), ("whole", 1 << 60)):
        framewise.STREAM_BYTES = threshold
        store = LfsStore(tmp_path / way / "objects")
        path = tmp_path / way / "model.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        previous, texts, stats = None, [], None
        for i, v in enumerate(versions):
            torch.save(v, path)
            if prepare is not None and i == len(versions) - 1:
                prepare(store, previous)
            stats = CleanStats()
            previous = clean_checkpoint(path, store, previous, options, stats=stats)
            texts.append(metadata.dumps(previous))
        out[way] = (texts, blobs(store), stats, previous)
    framewise.STREAM_BYTES = 1 << 20
    return out


def same_both_ways_meta(out):
    """:func:`same_both_ways`, then the last metadata."""
    same_both_ways(out)
    return out["frames"][3]


def same_both_ways(out) -> CleanStats:
    (t1, b1, s1, _), (t2, b2, s2, _) = out["frames"], out["whole"]
    assert t1 == t2
    assert b1 == b2
    assert (s1.written, s1.unchanged, s1.close, s1.by_type, s1.new_blob_bytes) == \
           (s2.written, s2.unchanged, s2.close, s2.by_type, s2.new_blob_bytes)
    return s1


NO_KEYFRAMES = CleanOptions(keyframe_ratio=float("inf"))  # every change a step on the previous version


def kinds(meta, key) -> list[str]:
    """The chain of a group: step types, with a delta's op."""
    return [s.type + (f":{s.params['op']}" if s.type == "delta" else "") for s in meta.groups[key].steps]


def test_a_first_version_is_stored_as_autos_keyframe_as_read_whole(tmp_path, passes):
    meta = same_both_ways_meta(clean_both(tmp_path, [model()]))
    assert kinds(meta, "embed") == ["dense", "delta:split18"] and kinds(meta, "wide") == ["dense", "delta:split50"]
    assert kinds(meta, "half") == ["dense"] and kinds(meta, "small") == ["dense"]  # bfloat16, small: one blob
    assert passes[0] == 3  # embed, wide, half (small is read whole)


def test_a_fine_tuned_group_is_stored_as_the_same_step(tmp_path, passes):
    v1 = model()
    v2 = {k: tuned(t) if k != "wide" else t for k, t in v1.items()}
    out = clean_both(tmp_path, [v1, v2])
    stats = same_both_ways(out)
    assert stats.unchanged == 1
    assert passes[0] == 3 + 2  # v1: three; v2: embed and half (wide is unchanged, not read)
    meta = out["frames"][3]
    # float32: rebased on v1's keyframe; bfloat16: its small delta appended; the small group self-contained
    assert kinds(meta, "embed") == ["dense", "delta:split18"] and kinds(meta, "half") == ["dense", "delta:zigzag"]
    assert kinds(meta, "small") == ["dense"]
    store = LfsStore(tmp_path / "frames" / "objects")
    from theta.updates.rebuild import reconstruct
    for k in ("embed", "half"):
        assert reconstruct(meta.groups[k], store).tobytes() == v2[k].view(torch.uint8).numpy().tobytes()
    out = clean_both(tmp_path / "chained", [v1, v2], NO_KEYFRAMES)
    assert same_both_ways(out).by_type == {"delta": 3}


def test_a_chained_previous_version_is_rebuilt_and_compared_alike(tmp_path):
    v1 = model()
    v2 = {k: tuned(t, 1) for k, t in v1.items()}
    v3 = {k: tuned(t, 2) for k, t in v2.items()}
    out = clean_both(tmp_path, [v1, v2, v3], NO_KEYFRAMES)
    same_both_ways(out)
    assert len(out["frames"][3].groups["embed"].steps) == 4  # the keyframe's two steps, a delta each
    out = clean_both(tmp_path / "rebased", [v1, v2, v3])
    same_both_ways(out)
    first, last = (metadata.loads(t) for t in (out["frames"][0][0], out["frames"][0][2]))
    assert last.groups["embed"].steps[0] == first.groups["embed"].steps[0]  # on v1's keyframe, two steps
    assert kinds(last, "embed") == ["dense", "delta:split18"]


def test_few_changed_elements_are_stored_sparse(tmp_path):
    v1 = model()
    v2 = dict(v1)
    e = v1["embed"].clone()
    e.view(-1)[::997] += 1.0
    v2["embed"] = e
    stats = same_both_ways(clean_both(tmp_path, [v1, v2]))
    assert stats.by_type == {"sparse": 1}


def test_a_value_replaced_outright_is_stored_self_contained(tmp_path):
    v1 = model()
    v2 = dict(v1, embed=model(seed=5)["embed"] * 40)  # nothing in common with v1's bits
    out = clean_both(tmp_path, [v1, v2])
    stats = same_both_ways(out)
    assert stats.written == 1 and kinds(out["frames"][3], "embed") == ["dense", "delta:split18"]
    assert out["frames"][3].groups["embed"].steps[0] != metadata.loads(out["frames"][0][0]).groups["embed"].steps[0]


def test_a_value_within_tolerance_keeps_the_previous_one(tmp_path, passes):
    v1 = model()
    v2 = dict(v1, embed=tuned(v1["embed"], scale=1e-7), wide=tuned(v1["wide"], scale=1e-9))
    out = clean_both(tmp_path, [v1, v2])
    stats = same_both_ways(out)
    assert stats.close == 2 and stats.written == 0
    assert out["frames"][0][0] == out["frames"][0][1]  # v2's text is v1's: the previous values are kept


def test_a_full_chain_or_dense_asked_for_stores_the_value(tmp_path):
    v1 = model()
    v2 = {k: tuned(t) for k, t in v1.items()}
    out = clean_both(tmp_path / "chain", [v1, v2], CleanOptions(max_chain=1))
    meta = same_both_ways_meta(out)
    # every value self-contained: a keyframe of its own (split for float32/64), nothing on v1's
    assert kinds(meta, "embed") == ["dense", "delta:split18"] and kinds(meta, "half") == ["dense"]
    assert meta.groups["embed"].steps[0] != metadata.loads(out["frames"][0][0]).groups["embed"].steps[0]
    assert same_both_ways(clean_both(tmp_path / "dense", [v1, v2], CleanOptions(update_type="dense"))).by_type == \
        {"dense": 4}


def test_a_previous_version_not_fetched_is_not_built_on(tmp_path):
    v1 = model()
    v2 = {k: tuned(t) for k, t in v1.items()}

    def unfetch(store, previous):
        os.unlink(store.path(previous.groups["embed"].steps[0].blob))

    stats = same_both_ways(clean_both(tmp_path, [v1, v2], prepare=unfetch))
    assert stats.by_type == {"dense": 1, "delta": 3}


def test_a_group_with_nan_has_no_signature_and_is_compared_exactly(tmp_path):
    v1 = model()
    e = tuned(v1["embed"])
    e[7, 7] = float("nan")
    out = clean_both(tmp_path, [v1, dict(v1, embed=e)])
    same_both_ways(out)
    assert out["frames"][3].groups["embed"].lsh is None


def test_a_frame_that_changes_between_two_reads_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(model(), path)
    with zipslice.load(path) as lsd:
        frames = framewise.GroupFrames(lsd, "embed", lsd.info("embed"), str(path))
        a, b = frames.bounds[1]
        frames.record(a, frames.read(a, b))
        assert frames.verified(a, b).tobytes() == frames.read(a, b).tobytes()
        _, offset, _ = lsd.plain_range("embed")
        with open(path, "r+b") as f:  # the same layout, one value of that frame changed
            f.seek(offset + a * 4 + 40)
            f.write(b"\x01\x02\x03\x04")
        with pytest.raises(FileChanged, match=r"model.pt: group 'embed' changed while theta was reading it"):
            frames.verified(a, b)


def test_a_file_rewritten_during_the_clean_leaves_nothing_in_the_store(tmp_path, monkeypatch):
    """The sparse candidate reads the group again: the file changed since the first pass, so the clean
    fails naming the group, and neither the delta staged by the first pass nor anything else is stored."""
    v1 = model()
    e = v1["embed"].clone()
    e.view(-1)[::997] += 1.0
    path = tmp_path / "model.pt"
    store = LfsStore(tmp_path / "objects")
    torch.save(v1, path)
    first = clean_checkpoint(path, store)
    torch.save(dict(v1, embed=e), path)
    before = blobs(store)
    real = framewise.first_pass

    def then_rewritten(frames, *a, **k):
        got = real(frames, *a, **k)
        e.view(-1)[5] += 1.0
        torch.save(dict(v1, embed=e), path)  # same layout, other bytes
        return got

    monkeypatch.setattr(framewise, "first_pass", then_rewritten)
    with pytest.raises(FileChanged, match="group 'embed' changed while theta was reading it"):
        clean_checkpoint(path, store, first)
    assert blobs(store) == before
    tmp = tmp_path / "tmp"  # where candidates are staged
    assert not tmp.exists() or not any(tmp.iterdir())


def test_a_group_git_sent_otherwise_is_refused(tmp_path):
    """git's bytes of a streamed group are not the file's: the first pass's fast hash differs from git's."""
    from theta.commands.filter.receive import receive
    from theta.model.git_bytes import GroupHashes

    v1 = model()
    path = tmp_path / "model.pt"
    store = LfsStore(tmp_path / "objects")
    torch.save(v1, path)
    first = clean_checkpoint(path, store)
    torch.save({k: tuned(t) for k, t in v1.items()}, path)
    data = bytearray(path.read_bytes())
    with zipslice.load(path) as lsd:
        _, offset, nbytes = lsd.plain_range("embed")
    data[offset + nbytes // 2] ^= 1  # what git "read": one bit of the embedding differs
    h = GroupHashes("model.pt")
    failure = []

    def clean():
        try:
            clean_checkpoint(path, store, first, git_bytes=h)
        except Exception as e:  # noqa: BLE001 (reported below)
            failure.append(e)
        finally:
            h.no_layout()

    t = threading.Thread(target=clean)
    t.start()
    receive(iter([bytes(data[i:i + 65516]) for i in range(0, len(data), 65516)]), tmp_path, path, h)
    t.join()
    assert len(failure) == 1 and isinstance(failure[0], FileChanged), failure
    assert "group 'embed' changed while git was reading the file" in str(failure[0])


@pytest.mark.parametrize("key", ["embed", "wide", "half"])
def test_one_pass_finds_what_the_whole_value_gives(tmp_path, key):
    """Hashes, signature, sample, changed elements and sum of squares of one frame pass equal those of the
    value read whole (the sum of squares to rounding: it only decides whether to compare)."""
    from theta.base import lsh
    from theta.updates import content_hash, fast_hash
    from theta.updates.auto import _sample
    from theta.updates.delta import changed_count

    v1 = model()
    path = tmp_path / "model.pt"
    torch.save(dict(v1, **{key: tuned(v1[key])}), path)
    store = LfsStore(tmp_path / "objects")
    with zipslice.load(path) as lsd:
        new = lsd.numpy(key, raw=True).view(framewise.GroupFrames(lsd, key, lsd.info(key), "m").dtype)
        old = v1[key].view(torch.uint8).numpy().view(new.dtype).reshape(new.shape)
        for previous in (None, framewise._ArrayFrames(old)):
            frames = framewise.GroupFrames(lsd, key, lsd.info(key), str(path))
            got = framewise.first_pass(frames, previous, codec.DEFAULT_LEVEL, store)
            assert (got.digest, got.fast, got.sig) == (content_hash(new), fast_hash(new), lsh.signature(new))
            assert got.sample.tobytes() == _sample(new).tobytes()
            assert got.changed == (new.size if previous is None else changed_count(new, old))
            assert got.squares == pytest.approx(lsh.squares(new), rel=1e-4)  # float32 dot products
            assert got.kind == ("dense" if previous is None else "delta")
            got.staged.discard()


def test_the_groups_of_a_sharded_checkpoint_are_streamed_from_their_shards(tmp_path, passes):
    """A Hugging Face sharded checkpoint (index + safetensors shards): its big groups are read frame by frame
    from their shard files, and stored as when read whole."""
    import json

    import safetensors.torch

    def write(where, tensors):
        where.mkdir(parents=True, exist_ok=True)
        weight_map = {}
        for s, names in enumerate((["embed", "small"], ["wide", "half"])):
            fname = f"model-{s + 1:05d}-of-00002.safetensors"
            safetensors.torch.save_file({n: tensors[n].contiguous() for n in names}, str(where / fname))
            weight_map.update({n: fname for n in names})
        index = where / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return index

    v1 = model()
    v2 = dict(v1, embed=tuned(v1["embed"]), half=tuned(v1["half"]))
    texts = {}
    for way, threshold in (("frames", 1 << 20), ("whole", 1 << 60)):
        framewise.STREAM_BYTES = threshold
        store = LfsStore(tmp_path / way / "objects")
        first = clean_checkpoint(write(tmp_path / way / "v1", v1), store)
        texts[way] = (metadata.dumps(first), metadata.dumps(clean_checkpoint(write(tmp_path / way / "v2", v2), store,
                                                                             first)), blobs(store))
    framewise.STREAM_BYTES = 1 << 20
    assert texts["frames"] == texts["whole"]
    assert passes[0] == 3 + 2
