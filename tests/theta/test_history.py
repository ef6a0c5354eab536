"""The data layer of `git theta log` (theta.model.history: a cell per group and commit from metadata alone) and
its page (theta.commands.heatmap), without git: metadata built here."""
from __future__ import annotations

import math
from html.parser import HTMLParser

import pytest

from theta.base import lsh
from theta.commands import heatmap
from theta.model.history import (Cell, Commit, History, Totals, _model_order, compare, estimated_norm, fold,
                                 layer_of)
from theta.storage.metadata import CheckpointMeta, GroupMeta, Norms, Step
from theta.storage.store import BlobRef


def h(c: str) -> str:
    return "blake3:" + c * 64


def group(name, value, *steps, shape=(4, 4), dtype="float32", norms=None, sig=None) -> GroupMeta:
    """A group whose value is named ``h(value)``, stored as ``steps`` ((type, oid letter, size) each)."""
    st = [Step(t, BlobRef(o * 64, size), {}, h(value)) for t, o, size in steps]
    return GroupMeta(name, dtype, shape, h(value), st, lsh=sig, norms=norms)


@pytest.mark.parametrize("name, layer", [
    ("model.layers.7.mlp.up_proj.weight", "model.layers.7"), ("encoder.layer.3.output.dense.bias", "encoder.layer.3"),
    ("transformer.h.11.attn.c_attn.weight", "transformer.h.11"), ("h.0.ln_1.weight", "h.0"),
    ("model/layers/2/w", "model/layers/2"), ("lm_head.weight", None), ("model.embed_tokens.weight", None),
    ("layers.10", None), ("blocks.0.attn.qkv", "blocks.0"), ("x.12abc.y", None)])
def test_layer_of(name, layer):
    assert layer_of(name) == layer


def meta(names, fmt="torch") -> CheckpointMeta:
    return CheckpointMeta(format=fmt, order=list(names), groups={n: group(n, "a", ("dense", "a", 1)) for n in names})


def test_model_order_keeps_the_newest_order_and_puts_removed_groups_where_they_were():
    new = meta(["emb", "layers.0.w", "layers.1.w", "head"])
    old = meta(["emb", "layers.0.w", "gone", "layers.1.w", "head", "tail"])
    assert _model_order([new, old]) == ["emb", "layers.0.w", "gone", "layers.1.w", "head", "tail"]
    # safetensors sorts names: natural order instead (layers.2 before layers.10)
    st = meta(["a.layers.10.w", "a.layers.2.w", "lm_head"], fmt="safetensors")
    assert _model_order([st]) == ["a.layers.2.w", "a.layers.10.w", "lm_head"]


def test_compare_reads_status_storage_and_size_from_metadata():
    base = group("w", "a", ("dense", "a", 1000), norms=Norms(10.0))
    assert compare(None, None, set()).status == "absent"
    added = compare(None, base, set())
    assert (added.status, added.stored, added.stored_bytes, added.numel) == ("added", "dense", 1000, 16)
    assert compare(base, None, {"a" * 64}).status == "removed"
    same = compare(base, base, {"a" * 64})
    assert (same.status, same.stored, same.stored_bytes, same.relative) == ("unchanged", "unchanged", 0, 0.0)
    # a delta on top of the previous value, its norms recorded: nothing estimated
    tuned = group("w", "b", ("dense", "a", 1000), ("delta", "b", 300),
                  norms=Norms(10.5, source=h("a"), change=0.5, changed=12))
    c = compare(base, tuned, {"a" * 64})
    assert (c.status, c.stored, c.stored_bytes, c.how, c.changed) == ("modified", "delta", 300, "recorded", 12)
    assert c.relative == 0.05
    # the recorded change is from another value than the parent's: estimated from the signatures
    other = group("w", "c", ("dense", "a", 1000), ("sparse", "c", 40), ("low-rank", "d", 60),
                  norms=Norms(11.0, source=h("z"), change=9.0, changed=1), sig=[3] * 16)
    c = compare(group("w", "a", ("dense", "a", 1000), norms=Norms(10.0), sig=[1] * 16), other, {"a" * 64})
    assert (c.stored, c.stored_bytes, c.how) == ("sparse+low-rank", 100, "estimated")
    assert c.change == lsh.estimated_distance([1] * 16, [3] * 16) and c.base == 10.0
    # no norms on the parent: its norm estimated too
    c = compare(group("w", "a", ("dense", "a", 1000), sig=[5] * 16), other, {"a" * 64})
    assert c.base == estimated_norm([5] * 16) == pytest.approx(5 * lsh.BUCKET_WIDTH) and c.how == "estimated"
    # no signatures (an integer group): the size of the change is unknown
    c = compare(group("i", "a", ("dense", "a", 8), dtype="int64"), group("i", "b", ("dense", "b", 8), dtype="int64"),
                {"a" * 64})
    assert (c.status, c.relative, c.how) == ("modified", None, None)
    # back to a value stored before: nothing new stored
    c = compare(tuned, base, {"a" * 64, "b" * 64})
    assert (c.stored, c.stored_bytes) == ("reused", 0)
    assert compare(base, group("w", "b", ("dense", "b", 9), shape=(2, 8)), set()).status == "reshaped"
    assert compare(base, group("w", "b", ("dense", "b", 9), dtype="float16"), set()).status == "retyped"


def test_fold_sums_a_layer_s_changes():
    cells = [Cell("modified", "delta", 10, 3.0, 4.0, how="recorded"), Cell("unchanged", "unchanged", 0, 0.0, 3.0),
             Cell("added", "dense", 5), Cell("absent")]
    f = fold(cells)
    assert f.statuses == {"modified": 1, "unchanged": 1, "added": 1, "absent": 1}
    assert f.stored == {"delta": 1, "dense": 1} and f.stored_bytes == 15 and f.changed_groups == 2
    assert (f.change, f.base) == (3.0, 5.0) and f.relative == 0.6 and f.how == {"recorded"}
    assert fold([Cell("modified", "dense", 1)]).relative is None
    assert Cell("modified", change=1.0, base=0.0).relative == math.inf


def history() -> History:
    names = ["emb", "layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b", "head"]
    commits = [Commit(c * 40, [], "2024-01-0%dT00:00:00+00:00" % (i + 1), "me", f"commit {i}")
               for i, c in enumerate("abc")]
    added = [Cell("added", "dense", 100) for _ in names]
    second = [Cell("unchanged", "unchanged", 0, 0.0, 1.0), Cell("modified", "delta", 7, 1e-3, 1.0, 5, 16, "recorded"),
              Cell("unchanged", "unchanged", 0, 0.0, 1.0), Cell("modified", "sparse", 3, 0.5, 1.0, 1, 16, "estimated"),
              Cell("removed"), Cell("reshaped", "rows", 9)]
    third = [Cell("unchanged", "unchanged", 0, 0.0, 1.0)] * 4 + [Cell("absent"), Cell("modified", "dense", 50)]
    return History("model.pt", commits, names, [added, second, third],
                   [Totals(6, 600, 600), Totals(4, 19, 619), Totals(1, 50, 660)])


class Cells(HTMLParser):
    """The page's table: per row (class, data-*), its cells' data-* attributes."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[dict, list[dict]]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr":
            self.rows.append((a, []))
        elif tag == "td" and "cell" in (a.get("class") or "").split():
            self.rows[-1][1].append(a)


def test_the_page_has_a_cell_per_group_and_commit_and_a_folded_row_per_layer():
    hist = history()
    page = heatmap.log_page(hist)
    p = Cells()
    p.feed(page)
    groups = [(a, cells) for a, cells in p.rows if "group" in (a.get("class") or "").split()]
    layers = [(a, cells) for a, cells in p.rows if a.get("class") == "layer"]
    assert [a["data-group"] for a, _ in groups] == hist.groups
    assert [a["data-layer"] for a, _ in layers] == ["layers.0", "layers.1"]
    assert all(len(cells) == 3 for _, cells in groups + layers)
    assert sum("hidden" in a for a, _ in groups) == 4  # the layers' groups start folded
    by = {a["data-group"]: cells for a, cells in groups}
    c = by["layers.0.a"][1]
    assert (c["data-status"], c["data-stored"], c["data-bytes"], c["data-rel"], c["data-changed"], c["data-how"]) == \
        ("modified", "delta", "7", "0.001", "5", "recorded")
    assert "stored: delta, 7 B" in c["title"] and "elements changed: 5 of 16 (31.2%)" in c["title"]
    assert by["layers.1.b"][1]["data-status"] == "removed" and by["head"][1]["data-status"] == "reshaped"
    l1 = layers[1][1][1]  # layers.1 at the second commit
    assert l1["data-status"] == "removed" and l1["data-changed-groups"] == "2"
    # the layer's relative change: sqrt(0.5²) over sqrt(1²) of the groups with known norms
    assert float(l1["data-rel"]) == 0.5
    assert 'data-groups="6" data-commits="3" data-layers="2"' in page
    assert "http" not in page.replace('content="git theta"', "")


def test_colours_marks_and_scale():
    s = heatmap.scale_of([1e-3, 0.5, None, 0.0, math.inf])
    assert (s.lo, s.hi) == (-3, 0)
    assert s.colour(1e-3) == heatmap.VIRIDIS[0] and s.colour(1.0) == heatmap.VIRIDIS[-1]
    assert s.colour(1e-9) == heatmap.VIRIDIS[0] and s.colour(math.inf) == heatmap.VIRIDIS[-1]
    assert heatmap.scale_of([]) == heatmap.Scale(-6, 0) and heatmap.scale_of([0.3]) == heatmap.Scale(-1, 0)
    assert heatmap.cell_look("added", None, s) == (heatmap.ABSENT, "+")
    assert heatmap.cell_look("unchanged", 0.0, s) == (heatmap.UNCHANGED, "")
    assert heatmap.cell_look("modified", None, s) == (heatmap.UNCHANGED, "?")
    assert heatmap.cell_look("reshaped", None, s)[1] == "\u2194"


def test_the_pair_page_has_a_bar_per_group_and_the_merge_s_view():
    hist = history()
    one = History(hist.path, hist.commits[1:2], hist.groups, hist.cells[1:2], hist.totals[1:2])
    merge = {n: heatmap.MergeRow("from parent 1 (only it changed the group)") for n in hist.groups}
    merge["layers.1.a"] = heatmap.MergeRow("changed on both parents: merged into a new value",
                                          "strategy configured now: ties (git config)")
    page = heatmap.diff_page(one, "HEAD~1", merge)
    assert page.count('<tr class="bar') == len(hist.groups) and page.count('class="merge"') == len(hist.groups)
    assert "merged into a new value (strategy configured now: ties (git config))" in page
    assert 'width:' in page and "4 of 6 groups differ" in page
