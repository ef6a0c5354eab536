"""Bounded mutation fuzz of theta's metadata parser and of the rebuild it feeds.

A valid metadata text (several groups, chains, aliases, a structure) is mutated -- bytes flipped, lines cut,
swapped or duplicated, JSON values replaced by hostile ones -- and parsed. The parser must either return
metadata that passes its own checks again (dumps -> loads gives the same object) or raise MetadataError
naming the file; nothing else (no KeyError, TypeError, RecursionError, MemoryError...). Parsed metadata is
then rebuilt from a real store under a byte budget: only theta's own errors may come out.
"""
from __future__ import annotations

import json
import re
import tracemalloc

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from theta.base.errors import MetadataError, ThetaError
from theta.model.smudge import smudge_checkpoint
from theta.storage.metadata import dumps, loads
from theta.storage.store import LfsStore
from theta.model.clean import clean_checkpoint

HOSTILE_VALUES = [None, True, -1, 0, 1 << 63, 10 ** 30, 1.5, float("1e308"), "", "../../etc/passwd", "A" * 64,
                  "os:system", [], [-1], [1 << 40, 1 << 40], {}, {"a": [[[[1]]]]}, "\x1b[2J", "x" * 5000,
                  [[[[[[[[[[[[]]]]]]]]]]]]]


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """(metadata text, store) of a real checkpoint with a chain of updates and a tied alias."""
    import torch
    from theta.model.clean import CleanOptions

    d = tmp_path_factory.mktemp("fuzz")
    store = LfsStore(d / "lfs" / "objects")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g)
    sd = {"model": {"w": w, "tied": w, "b": torch.zeros(8), "n": torch.arange(5)}, "epoch": 2, "name": "x"}
    torch.save(sd, d / "m.pt")
    opts = CleanOptions(update_type="sparse")
    meta = clean_checkpoint(d / "m.pt", store, None, opts)
    w2 = w.clone()
    w2[0, :3] += 1
    sd["model"]["w"] = w2
    sd["model"]["tied"] = w2
    torch.save(sd, d / "m.pt")
    meta = clean_checkpoint(d / "m.pt", store, meta, opts)
    assert any(len(g.steps) > 1 for g in meta.groups.values())
    return dumps(meta), store, d


def _mutations():
    byte_flip = st.tuples(st.just("flip"), st.integers(0, 10 ** 6), st.integers(0, 255))
    cut = st.tuples(st.just("cut"), st.integers(0, 10 ** 6), st.just(0))
    line_op = st.tuples(st.sampled_from(["drop", "dup", "swap"]), st.integers(0, 50), st.integers(0, 50))
    value = st.tuples(st.just("value"), st.integers(0, 10 ** 6), st.integers(0, len(HOSTILE_VALUES) - 1))
    # well-formed but lying: two sha256s (oids, hashes) of the text swapped, or a blob size changed
    swap = st.tuples(st.just("swap-hex"), st.integers(0, 10 ** 6), st.integers(0, 10 ** 6))
    resize = st.tuples(st.just("size"), st.integers(0, 10 ** 6), st.integers(0, 4096))
    return st.lists(st.one_of(byte_flip, cut, line_op, value, swap, resize), min_size=1, max_size=4)


def _apply(text: str, muts) -> bytes:
    """The mutated text, as bytes (a flipped byte need not leave valid UTF-8)."""
    raw = text.encode()
    for op, a, b in muts:
        if op == "flip":
            buf = bytearray(raw)
            if buf:
                buf[a % len(buf)] = b
            raw = bytes(buf)
        elif op == "cut":
            raw = raw[: a % (len(raw) + 1)]
        elif op == "swap-hex":
            found = [m.span() for m in re.finditer(rb'"[0-9a-f]{64}"', raw)]
            if len(found) >= 2:
                (i0, i1), (j0, j1) = found[a % len(found)], found[b % len(found)]
                if i0 > j0:
                    (i0, i1), (j0, j1) = (j0, j1), (i0, i1)
                raw = raw[:i0] + raw[j0:j1] + raw[i1:j0] + raw[i0:i1] + raw[j1:]
        elif op == "size":
            found = [m.span(1) for m in re.finditer(rb'"size":(\d+)', raw)]
            if found:
                i0, i1 = found[a % len(found)]
                raw = raw[:i0] + str(b).encode() + raw[i1:]
        elif op in ("drop", "dup", "swap"):
            lines = raw.split(b"\n")
            i, j = a % len(lines), b % len(lines)
            if op == "drop":
                del lines[i]
            elif op == "dup":
                lines.insert(i, lines[j])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            raw = b"\n".join(lines)
        else:  # replace one JSON value of one line by a hostile one
            lines = raw.split(b"\n")
            i = a % len(lines)
            try:
                obj = json.loads(lines[i])
            except ValueError:
                continue
            paths = list(_paths(obj))
            if paths:
                _set(obj, paths[a % len(paths)], HOSTILE_VALUES[b])
                lines[i] = json.dumps(obj, separators=(",", ":")).encode()
                raw = b"\n".join(lines)
    return raw


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(muts=_mutations())
def test_mutated_metadata_parses_or_fails_cleanly(valid, muts):
    text, _, _ = valid
    bad = _apply(text, muts)
    try:
        meta = loads(bad, file="model.pt")
    except MetadataError as e:
        assert e.file == "model.pt" and str(e).startswith("model.pt")
        return
    again = dumps(meta, file="model.pt")  # what was accepted can be written back...
    assert loads(again) == meta           # ...and reads back the same


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(muts=_mutations())
@example(muts=[("value", 15890, 18), ("size", 0, 0)])  # the structure's key "model" made null: names differ
def test_mutated_metadata_rebuilds_or_fails_with_thetas_errors(valid, muts):
    """What parses is rebuilt from the real store: a correct checkpoint or one of theta's errors, within a
    memory budget (never a declared size, never a traceback)."""
    text, store, d = valid
    try:
        meta = loads(_apply(text, muts), file="model.pt")
    except MetadataError:
        return
    out = d / "out.pt"
    out.unlink(missing_ok=True)  # one failing example must not leave its output to the next
    tracemalloc.start()
    try:
        smudge_checkpoint(meta, store, out, verify="frames", max_output=1 << 26)
    except ThetaError:
        assert not out.exists()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 << 20, f"rebuild allocated {peak} bytes"
    if out.exists():  # a successful rebuild is a checkpoint theta reads back to the metadata's tensors
        back = clean_checkpoint(out, store, None)
        # names come from the (possibly mutated) structure, so compare contents: every tensor read back is
        # one of the metadata's groups, bit for bit
        assert {g.hash for g in back.groups.values()} <= {g.hash for g in meta.groups.values()}
