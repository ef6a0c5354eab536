"""theta.storage.schema: every field of a metadata text is checked against a limit before anything uses it,
each violation naming the file, the line, the group and the field; what theta writes passes the same checks
and what zipslice reads back. One test per class of defect, each with several members."""
from __future__ import annotations

import time

import numpy as np
import pytest

from theta.base.errors import ChainError, MetadataError, StoreError
from theta.storage import metadata, schema
from theta.storage.metadata import loads
from theta.storage.store import BlobRef, LfsStore
from theta.updates import bounds

from support.crafted import group_line, meta_text, step, value_hash

ARR = np.arange(12, dtype=np.float32).reshape(3, 4)
H = value_hash(ARR)
OID = "ab" * 32


def good_group(**changes) -> dict:
    g = group_line("layer.w", "float32", [3, 4], [step("dense", {"oid": OID, "size": 200}, H)])
    g.update(changes)
    return g


def parse(groups, **kw):
    return loads(meta_text(groups, **kw), file="model.pt")


def refused(groups, field, *fragments, group="layer.w", **kw) -> MetadataError:
    with pytest.raises(MetadataError) as e:
        parse(groups, **kw)
    err = e.value
    assert err.file == "model.pt" and str(err).startswith("model.pt: line ")
    assert err.field == field, str(err)
    if group is not None:
        assert err.group == group and f"group {group!r}" in str(err)
    for f in fragments:
        assert f in str(err), str(err)
    return err


def test_a_good_text_parses():
    meta = parse([good_group()])
    assert meta.groups["layer.w"].steps[0].blob == BlobRef(OID, 200)


@pytest.mark.parametrize("oid", ["../../../etc/passwd", "/etc/hostname", "A" * 64, "a" * 63, "a" * 65,
                                 "g" * 64, "a" * 63 + "\n", 12, None, ["a" * 64]])
def test_oids_are_64_lowercase_hex(oid):
    g = good_group()
    g["steps"][0]["oid"] = oid
    refused([g], "steps[0].oid", "64 lowercase hex")


@pytest.mark.parametrize("oid", ["../x", "/etc/hostname", "A" * 64, "", "a" * 63])
def test_blobref_and_store_path_refuse_non_hex_oids(oid, tmp_path):
    with pytest.raises(StoreError, match="64 lowercase hex"):
        BlobRef(oid, 1)
    with pytest.raises(StoreError, match="64 lowercase hex"):
        LfsStore(tmp_path).path(oid)


@pytest.mark.parametrize("size", [-1, True, 1.5, "10", 1 << 63, None])
def test_blob_sizes(size):
    g = good_group()
    g["steps"][0]["size"] = size
    refused([g], "steps[0].size")


@pytest.mark.parametrize("shape,fragment", [
    ([-3, 4], "out of range"), ([10 ** 30], "out of range"), ([1 << 40, 1 << 40], "exceeds"),
    ([1] * 65, "65 dimensions"), ("3x4", "list of dimensions"), ([True, 4], "expected an integer"),
    ([3.0, 4], "expected an integer"),
])
def test_shapes(shape, fragment):
    refused([good_group(shape=shape)], "shape", fragment)


@pytest.mark.parametrize("dtype", ["float33", "object", "", 5, "<f4"])
def test_dtypes(dtype):
    refused([good_group(dtype=dtype)], "dtype", "unknown dtype")


@pytest.mark.parametrize("kind", ["os:system", "os.system", "Dense", "", "a" * 65, "dense;rm", 3])
def test_step_type_syntax(kind):
    g = good_group()
    g["steps"][0]["type"] = kind
    refused([g], "steps[0].type", "update type name")


def test_chain_length_and_consistency():
    st = step("dense", {"oid": OID, "size": 200}, H)
    refused([good_group(steps=[st] * (schema.MAX_STEPS + 1))], "steps", "exceeds the limit of 64")
    refused([good_group(steps=[])], "steps", "non-empty")
    refused([good_group(hash="0" * 64)], "steps[-1].hash", "differs from the group's hash")


def test_a_value_larger_than_its_blob_can_hold_is_refused():
    """zstd expands at most 32768x: a 3-byte blob cannot hold a 1 GiB value."""
    g = group_line("layer.w", "float32", [1 << 28], [step("dense", {"oid": OID, "size": 3}, H)])
    refused([g], "steps[0].size", "cannot hold a value of 1073741824 bytes")


@pytest.mark.parametrize("name", ["", "a\x1b[31m", "x\ny", "\x00", "n" * (schema.MAX_NAME_CHARS + 1)])
def test_names(name):
    g = good_group(group=name)
    with pytest.raises(MetadataError) as e:
        parse([g], order=[name])
    assert e.value.field in ("group", "order") and e.value.file == "model.pt"


def test_params_are_small_flat_json():
    g = good_group()
    g["steps"][0]["params"] = {"a": [[[[[[[[[[1]]]]]]]]]]}
    refused([g], "steps[0].params", "nested deeper than 8")
    g["steps"][0]["params"] = {"a": "x" * (schema.MAX_PARAMS_BYTES + 1)}
    refused([g], "steps[0].params", "exceed the limit of 16384")
    g["steps"][0]["params"] = {"shape": [-1]}
    refused([g], "steps[0].params.shape", "out of range")
    g["steps"][0]["params"] = {"dtype": "evil"}
    refused([g], "steps[0].params.dtype", "unknown dtype")


def test_unknown_and_missing_fields():
    refused([good_group(extra=1)], "extra", "unknown field")
    g = good_group()
    del g["hash"]
    refused([g], "hash", "needs this field")
    g = good_group()
    g["steps"][0]["evil"] = 1
    refused([g], "steps[0].evil", "unknown field")


def test_json_constants_duplicates_and_nesting_never_reach_the_parser_unchecked():
    text = meta_text([good_group()])
    for bad, fragment in [(text.replace('"lsh":null', '"lsh":NaN'), "not JSON"),
                          (text.replace('"param":false', '"param":false,"param":true'), "twice"),
                          (text.replace('{"order":', '{"order":' + "[" * 50_000 + "]" * 50_000 + ',"x":'),
                           "nested 50001 levels deep"),
                          (text.replace('{"structure":null}', '{"structure":' + '{"a":' * 2000 + "1" + "}" * 2000
                                        + "}"), "nested 2001 levels deep")]:
        t0 = time.monotonic()
        with pytest.raises(MetadataError, match=fragment) as e:
            loads(bad, file="model.pt")
        assert time.monotonic() - t0 < 5 and e.value.file == "model.pt"


def test_json_depth_counts_only_brackets_outside_strings():
    assert schema.json_depth('{"a":"[[[[{{{{","b":[1,[2]]}') == 3
    assert schema.json_depth('["\\\\", ["\\"]]]]"]]') == 2
    assert schema.json_depth("[" * 1000 + "]" * 1000) == 1000


def test_file_level_metadata_matches_what_zipslice_reads_back():
    big = {"k": "x" * (schema.MAX_FILE_METADATA_BYTES - 8)}
    refused([good_group()], "metadata", "zipslice reads back", group=None, file_meta=big)
    ok = {"k": "x" * (schema.MAX_FILE_METADATA_BYTES - 20)}
    assert parse([good_group()], file_meta=ok).metadata == ok
    # non-ASCII characters count as the torch writer stores them (\uXXXX escapes)
    refused([good_group()], "metadata", group=None, file_meta={"k": "\u00e9" * (schema.MAX_FILE_METADATA_BYTES // 6 + 1)})
    refused([good_group()], "metadata", group=None, file_meta={"k": 3})


@pytest.mark.parametrize("node,fragment", [
    ({"torch": "dtype", "value": "load"}, "unknown dtype 'load'"),
    ({"torch": "device", "value": "cuda; rm -rf /"}, "torch device"),
    ({"torch": "module", "value": "os"}, "unknown torch leaf kind"),
    ({"value": {"a": 1}}, "a value leaf holds"),
    ({"float": "not-a-float"}, "hex float"),
    ({"bytes": "***"}, "base64"),
    ({"dict": [["a"]]}, r"\[key, node\] pair"),
    ({"dict": [[{"k": 1}, {"value": 1}]]}, "dict key"),
    ({"list": {"a": 1}}, "list node"),
    ({"tensor": "nope"}, "neither a group nor an alias"),
    ({"global": "os.system"}, "not a structure node"),
])
def test_structure_nodes(node, fragment):
    structure = {"dict": [["layer.w", {"tensor": "layer.w"}], ["x", node]]}
    with pytest.raises(MetadataError, match=fragment) as e:
        parse([good_group()], structure=structure)
    assert "structure" in (e.value.field or "")


def test_structure_depth_is_the_torch_readers():
    def nested(depth):
        node = {"tensor": "layer.w"}
        for _ in range(depth):
            node = {"list": [node]}
        return node

    assert parse([good_group()], structure=nested(schema.MAX_STRUCTURE_DEPTH)).structure is not None
    with pytest.raises(MetadataError, match="deeper than 200"):
        parse([good_group()], structure=nested(schema.MAX_STRUCTURE_DEPTH + 1))


def test_group_count_is_limited(monkeypatch):
    assert schema.MAX_GROUPS == 1_000_000
    monkeypatch.setattr(schema, "MAX_GROUPS", 3)
    groups = [good_group(group=f"g{i}") for i in range(4)]
    with pytest.raises(MetadataError, match="more than 3 groups"):
        parse(groups, order=["g0", "g1", "g2"])
    with pytest.raises(MetadataError, match="4 names exceed the limit of 3"):
        parse(groups[:3], order=[f"g{i}" for i in range(4)])


def test_text_size_is_limited(monkeypatch):
    monkeypatch.setattr(schema, "MAX_TEXT_BYTES", 1000)
    with pytest.raises(MetadataError, match="exceeds the limit of 1000"):
        parse([good_group(group=f"g{i}") for i in range(10)])


def test_comment_lines_are_tolerated():
    text = meta_text([good_group()])
    lines = text.splitlines()
    text = "\n".join([lines[0] + " (stored by git-theta)", "# a hint for humans: run `git theta install`",
                      *lines[1:]]) + "\n"
    assert "layer.w" in loads(text).groups


def test_what_dumps_writes_passes_the_same_checks():
    meta = parse([good_group()])
    meta.groups["layer.w"].shape = (-1, 4)
    with pytest.raises(MetadataError, match="field 'shape'"):
        metadata.dumps(meta, file="out.pt")
    meta = parse([good_group()])
    meta.metadata = {"k": "x" * schema.MAX_FILE_METADATA_BYTES}
    with pytest.raises(MetadataError, match="zipslice reads back"):
        metadata.dumps(meta)


# ---------- chains: checked from metadata before any blob is read (theta.updates.bounds) ----------------------

def _group(steps, shape=(3, 4)):
    from theta.storage.metadata import GroupMeta

    return GroupMeta.from_json(group_line("w", "float32", list(shape), steps))


@pytest.mark.parametrize("kinds,fragment", [
    (["dense", "dense"], "self-contained but not first"),
    (["delta"], "needs a previous value but is first"),
    (["dense", "delta", "dense"], "self-contained but not first"),
    (["dense", "evil"], "unknown update type 'evil'"),
])
def test_chain_shape(kinds, fragment):
    g = _group([step(k, {"oid": OID, "size": 200}, H, {"op": "xor"} if k == "delta" else {}) for k in kinds])
    with pytest.raises(ChainError, match=fragment) as e:
        bounds.check_group(g, "model.pt")
    assert e.value.file == "model.pt" and e.value.group == "w" and str(e.value).startswith("model.pt: group 'w'")


def test_chain_work_is_bounded_by_the_groups_size():
    # a small final value after huge intermediate ones (rows steps) cannot make the chain expensive
    huge = {"shape": [1 << 24, 4]}
    steps = [step("dense", {"oid": OID, "size": 1 << 20}, H, huge)] + \
            [step("rows", {"oid": OID, "size": 100}, H, huge) for _ in range(20)] + [step("rows", {"oid": OID, "size": 100}, H)]
    with pytest.raises(ChainError, match="would materialise"):
        bounds.check_group(_group(steps), "model.pt")


def test_declared_output_over_the_maximum_is_refused():
    meta = parse([good_group()])
    assert bounds.check_output(meta, "model.pt") == 48
    with pytest.raises(MetadataError, match="over the limit of 47 bytes"):
        bounds.check_output(meta, "model.pt", max_output=47)


def test_max_checkout_bytes_from_environment_and_config(monkeypatch, tmp_path):
    import subprocess

    from theta import settings
    from theta.base.errors import ThetaError

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.delenv("GIT_THETA_MAX_CHECKOUT_BYTES", raising=False)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    assert settings.max_checkout_bytes(tmp_path) == bounds.DEFAULT_MAX_OUTPUT == 1 << 40
    subprocess.run(["git", "-C", str(tmp_path), "config", "theta.maxCheckoutBytes", "512g"], check=True)
    assert settings.max_checkout_bytes(tmp_path) == 512 << 30
    monkeypatch.setenv("GIT_THETA_MAX_CHECKOUT_BYTES", "2t")
    assert settings.max_checkout_bytes(tmp_path) == 2 << 40
    for bad in ("-1", "0", "lots", "1e9", ""):
        monkeypatch.setenv("GIT_THETA_MAX_CHECKOUT_BYTES", bad)
        with pytest.raises(ThetaError, match="GIT_THETA_MAX_CHECKOUT_BYTES"):
            settings.max_checkout_bytes(tmp_path)


@pytest.mark.parametrize("field,value", [("max_chain", 65), ("max_chain", 0), ("rtol", float("nan")),
                                         ("atol", -1.0), ("level", 99), ("isolate_timeout", 0.0)])
def test_clean_options_are_checked(field, value):
    from theta.model.clean import CleanOptions
    from theta.base.errors import ThetaError

    with pytest.raises(ThetaError, match=field):
        CleanOptions(**{field: value})
