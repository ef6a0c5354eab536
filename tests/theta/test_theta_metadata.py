"""theta.storage.metadata: deterministic text, round trips, clear errors on bad input."""
import json

import pytest

from theta.storage import metadata
from theta.base.errors import MetadataError
from theta.storage.metadata import Alias, CheckpointMeta, GroupMeta, Step
from theta.storage.store import BlobRef


def H(c):
    return c * 64


def make(order=("b", "a", "t")):
    ga = GroupMeta("a", "float32", (2, 3), H("1"), [Step("dense", BlobRef(H("a"), 10), {}, H("1"))],
                   lsh=[1, -2, 3], is_parameter=True, requires_grad=True)
    gb = GroupMeta("b", "int64", (4,), H("2"), [Step("dense", BlobRef(H("b"), 20), {}, H("3")),
                                                Step("sparse", BlobRef(H("c"), 5), {"k": 1, "a": [1.5]}, H("2"))])
    groups = {n: g for n, g in (("a", ga), ("b", gb)) if n in order}
    return CheckpointMeta(format="torch", order=list(order), groups=groups,
                          structure={"dict": [["b", {"tensor": "b"}], ["a", {"tensor": "a"}],
                                              ["t", {"tensor": "t"}], ["n", {"value": 3}]]},
                          aliases={"t": Alias("t", "a", True, False)}, metadata={"k": "v"}, lsh={"k": 3})


def test_round_trip_and_determinism():
    m = make()
    text = metadata.dumps(m)
    assert text.startswith("theta-metadata 1\n") and text.endswith("\n")
    back = metadata.loads(text)
    assert back == m
    assert metadata.dumps(back) == text
    # groups/aliases inserted in another order, params dict in another order -> same bytes
    m2 = make()
    m2.groups = dict(reversed(list(m2.groups.items())))
    m2.groups["b"].steps[1] = Step("sparse", BlobRef(H("c"), 5), {"a": [1.5], "k": 1}, H("2"))
    assert metadata.dumps(m2) == text


def test_one_group_per_line_sorted_keys():
    lines = metadata.dumps(make()).splitlines()
    group_lines = [json.loads(l) for l in lines if l.startswith('{"dtype"')]
    assert [g["group"] for g in group_lines] == ["a", "b"]
    assert lines[1] == metadata.HINT
    for l in lines[2:]:
        obj = json.loads(l)
        assert l == json.dumps(obj, sort_keys=True, separators=(",", ":"))


def test_blob_refs_each_once():
    m = make()
    m.groups["a"].steps.append(Step("dense", BlobRef(H("b"), 20), {}, H("1")))
    assert [r.oid[0] for r in m.blob_refs()] == ["a", "b", "c"]


def test_is_metadata():
    text = metadata.dumps(make())
    assert metadata.is_metadata(text) and metadata.is_metadata(text.encode()[:100])
    assert not metadata.is_metadata(b"PK\x03\x04....")
    assert not metadata.is_metadata("version https://git-lfs.github.com/spec/v1\n")


@pytest.mark.parametrize("mutate,match", [
    (lambda t: "hello\n" + t, "not theta metadata"),
    (lambda t: t.replace("theta-metadata 1", "theta-metadata 9"), "version 9 is not supported"),
    (lambda t: t.replace('{"dtype":"float32"', '{"dtype":"float32",'), "line"),
    (lambda t: t + "[1,2]\n", "must be a JSON object"),
    (lambda t: "\n".join(l for l in t.splitlines() if not l.startswith('{"order"')), "order"),
    (lambda t: t.replace('"of":"a"', '"of":"zz"'), "unknown group"),
    (lambda t: t + t.splitlines()[-1] + "\n", "appears twice"),
    (lambda t: t.replace('"steps":[{', '"stepz":[{', 1), "line"),
])
def test_bad_metadata_raises_metadata_error(mutate, match):
    with pytest.raises(MetadataError, match=match):
        metadata.loads(mutate(metadata.dumps(make())))


def test_non_utf8():
    with pytest.raises(MetadataError, match="UTF-8"):
        metadata.loads(b"theta-metadata 1\n\xff\xfe")


def test_hint_line_is_one_stable_comment_and_old_text_still_reads():
    text = metadata.dumps(make())
    first, second = text.split("\n")[:2]
    assert first == "theta-metadata 1" and second == metadata.HINT
    assert second.startswith("# ") and "\n" not in second
    assert "git theta pull" in second and "pip install" in second and "git theta install" in second
    # written before the hint existed: no comment line; reads to the same metadata
    old = text.replace(metadata.HINT + "\n", "")
    assert metadata.loads(old) == metadata.loads(text)
    assert metadata.same_content(old, text) and metadata.same_content(old.encode(), text)
    assert not metadata.same_content(old, text.replace('"a"', '"z"'))
    # any comment line anywhere after the first line is skipped
    assert metadata.loads(text.replace("\n{", "\n# note\n{", 1)) == metadata.loads(text)
    assert metadata.is_metadata(old) and metadata.is_metadata(text)
