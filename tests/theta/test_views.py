"""theta.model.views without git: a committed checkpoint checked out in another format, read by that format's own
library, edited there, and recorded back in the committed format -- for every pair of formats.

The property that keeps `git status` clean: recording an unedited view gives the committed metadata byte for
byte, and recording an edited view gives metadata that a clean of the committed-format file rebuilt from it
gives again (so checking out in the committed format afterwards is clean too).
"""
from __future__ import annotations

from collections import OrderedDict

import h5py
import numpy as np
import pytest
import torch

from support import formats
from support.formats import SUFFIX, same_bits
from theta.model.clean import clean_checkpoint
from theta.base.errors import ViewError
from theta.model.smudge import smudge_checkpoint, smudge_to_stream
from theta.storage.metadata import dumps, loads
from theta.storage.store import LfsStore
from theta.model.views import as_committed, clean_as_committed, committed_form, view_of

PAIRS = [(c, v) for c in formats.FORMATS for v in formats.FORMATS if c != v]
# a tensor of each committed sample that is float32 and tied to nothing
EDIT = {"torch": "model/layer.0.weight", "safetensors": "layer.0.weight", "hdf5": "dense/kernel"}


@pytest.fixture
def store(tmp_path):
    return LfsStore(tmp_path / "lfs" / "objects")


def committed_file(tmp_path, fmt: str):
    """A small checkpoint written by ``fmt``'s own library, with what that format can hold beyond tensors:
    torch: nesting, a list, non-tensor values, a Parameter, a tied weight; safetensors: file metadata,
    bfloat16; HDF5: groups, a hard link (tie), root attributes."""
    g = torch.Generator().manual_seed(1)
    path = tmp_path / f"committed{SUFFIX[fmt]}"
    if fmt == "torch":
        sd = OrderedDict()
        sd["embed.weight"] = torch.nn.Parameter(torch.randn(8, 4, generator=g))
        sd["layer.0.weight"] = torch.randn(4, 4, generator=g)
        sd["layer.0.bias"] = torch.randn(4, generator=g).half()
        sd["count"] = torch.tensor(7)
        sd["head.weight"] = sd["embed.weight"]  # tied
        torch.save({"model": sd, "epoch": 3, "blocks": [torch.ones(2), torch.full((2,), 2.0)]}, path)
    elif fmt == "safetensors":
        import safetensors.torch

        safetensors.torch.save_file({"embed.weight": torch.randn(8, 4, generator=g),
                                     "layer.0.weight": torch.randn(4, 4, generator=g),
                                     "layer.0.bias": torch.randn(4, generator=g).bfloat16(),
                                     "count": torch.tensor(7)}, str(path), metadata={"format": "pt", "note": "hi"})
    else:
        rng = np.random.default_rng(1)
        with h5py.File(path, "w") as f:
            f.attrs["note"] = "keras-ish"
            f["dense/kernel"] = rng.standard_normal((4, 3)).astype(np.float32)
            f["dense/bias"] = np.arange(3, dtype=np.float64)
            f["emb/w"] = rng.standard_normal((5, 4)).astype(np.float32)
            f["head/w"] = f["emb/w"]  # a hard link: one dataset, two names
    return path


def check_out(meta, store, path, fmt=None):
    smudge_checkpoint(meta, store, path, fmt=fmt)
    return path


def assert_same_tensors(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bits(got[k], want[k]), k


@pytest.mark.parametrize("committed,view", PAIRS)
def test_view_reads_equal_records_unchanged_and_edits_one_group(tmp_path, store, committed, view):
    src = committed_file(tmp_path, committed)
    meta = loads(dumps(clean_checkpoint(src, store, None)))
    want = formats.read(src, committed)

    path = check_out(meta, store, tmp_path / f"view{SUFFIX[view]}", view)
    assert formats.sniff(path) == view
    assert_same_tensors(formats.read(path, view), want)
    if view != "torch":  # the committed file's metadata travels with the view where the format has a place
        assert formats.file_metadata(path, view) == meta.metadata
    # an unedited view records exactly the committed metadata: git add leaves the index as it was
    assert dumps(clean_as_committed(path, store, meta)) == dumps(meta)

    name = EDIT[committed]
    new = formats.read(path, view)[name] * 3 + 1
    formats.edit(path, name, new, view)
    got = clean_as_committed(path, store, meta)
    assert (got.format, got.structure, got.metadata, got.order, got.aliases) == \
           (meta.format, meta.structure, meta.metadata, meta.order, meta.aliases)
    assert {n for n in got.groups if got.groups[n] != meta.groups[n]} == {name}
    g = got.groups[name]
    assert (g.is_parameter, g.requires_grad) == (meta.groups[name].is_parameter, meta.groups[name].requires_grad)

    # checked out in the committed format: the edit, everything else bit for bit, and a clean index
    out = check_out(got, store, tmp_path / f"out{SUFFIX[committed]}")
    assert_same_tensors(formats.read(out, committed), {**want, name: new})
    assert dumps(clean_checkpoint(out, store, got)) == dumps(got)


def test_torch_view_streams_like_the_file_view(tmp_path, store):
    """The filter streams torch output to git: the streamed view is byte-identical to the written one."""
    import io

    meta = clean_checkpoint(committed_file(tmp_path, "safetensors"), store, None)
    written = check_out(meta, store, tmp_path / "model.safetensors", "torch").read_bytes()
    buf = io.BytesIO()
    smudge_to_stream(meta, store, buf, "model.safetensors", fmt="torch")
    assert buf.getvalue() == written


def test_torch_committed_keeps_structure_values_and_parameters(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "torch"), store, None)
    path = check_out(meta, store, tmp_path / "v.safetensors", "safetensors")
    formats.edit(path, "model/layer.0.bias", torch.zeros(4).half())
    got = clean_as_committed(path, store, meta)
    out = check_out(got, store, tmp_path / "out.pt")
    obj = torch.load(out, weights_only=True)
    assert obj["epoch"] == 3 and isinstance(obj["model"], OrderedDict) and len(obj["blocks"]) == 2
    assert isinstance(obj["model"]["embed.weight"], torch.nn.Parameter)
    assert obj["model"]["head.weight"].data_ptr() == obj["model"]["embed.weight"].data_ptr()  # still tied
    assert torch.equal(obj["model"]["layer.0.bias"], torch.zeros(4).half())


def test_editing_one_name_of_a_tie_unties_it(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "torch"), store, None)
    assert meta.aliases["model/head.weight"].of == "model/embed.weight"
    path = check_out(meta, store, tmp_path / "v.safetensors", "safetensors")
    new = torch.full((8, 4), 0.5)
    formats.edit(path, "model/head.weight", new)
    got = clean_as_committed(path, store, meta)
    assert not got.aliases and got.groups["model/head.weight"].hash != got.groups["model/embed.weight"].hash
    obj = torch.load(check_out(got, store, tmp_path / "out.pt"), weights_only=True)["model"]
    assert torch.equal(obj["head.weight"], new) and obj["head.weight"].data_ptr() != obj["embed.weight"].data_ptr()
    assert dumps(clean_checkpoint(tmp_path / "out.pt", store, got)) == dumps(got)

    # the same value given to both names (or a view that keeps only one of them) stays tied
    path = check_out(meta, store, tmp_path / "v2.safetensors", "safetensors")
    formats.edit(path, "model/head.weight", new)
    formats.edit(path, "model/embed.weight", new)
    assert clean_as_committed(path, store, meta).aliases == meta.aliases
    path = check_out(meta, store, tmp_path / "v3.safetensors", "safetensors")
    formats.edit(path, "model/head.weight", None)  # what safetensors' save_model does with a tied duplicate
    assert dumps(clean_as_committed(path, store, meta)) == dumps(meta)


@pytest.mark.parametrize("committed,view", PAIRS)
def test_added_and_removed_tensors(tmp_path, store, committed, view):
    meta = clean_checkpoint(committed_file(tmp_path, committed), store, None)
    path = check_out(meta, store, tmp_path / f"v{SUFFIX[view]}", view)
    new_name = {"torch": "model/extra.weight", "safetensors": "extra.weight", "hdf5": "dense/extra"}[committed]
    gone = {"torch": "model/count", "safetensors": "count", "hdf5": "dense/bias"}[committed]
    if committed == "torch" and view == "torch":
        return
    added = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    formats.edit(path, new_name, added, view)
    formats.edit(path, gone, None, view)
    got = clean_as_committed(path, store, meta)
    assert got.format == meta.format and new_name in got.groups and gone not in got.order
    out = check_out(got, store, tmp_path / f"out{SUFFIX[committed]}")
    back = formats.read(out, committed)
    assert same_bits(back[new_name], added) and gone not in back
    assert dumps(clean_checkpoint(out, store, got)) == dumps(got)  # order and structure as the reader lists them


def test_new_tensor_goes_into_the_dict_that_prefixes_it(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "torch"), store, None)
    path = check_out(meta, store, tmp_path / "v.h5", "hdf5")
    formats.edit(path, "model/new.bias", torch.ones(3))
    formats.edit(path, "top", torch.ones(1))
    got = clean_as_committed(path, store, meta)
    obj = torch.load(check_out(got, store, tmp_path / "out.pt"), weights_only=True)
    assert list(obj["model"])[-1] == "new.bias" and torch.equal(obj["top"], torch.ones(1)) and obj["epoch"] == 3


def test_dtype_change_in_a_safetensors_view_reorders_like_the_library(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "safetensors"), store, None)
    path = check_out(meta, store, tmp_path / "v.pt", "torch")
    formats.edit(path, "embed.weight", torch.ones(8, 4, dtype=torch.float16))
    got = clean_as_committed(path, store, meta)
    assert got.groups["embed.weight"].dtype == "float16"
    out = check_out(got, store, tmp_path / "out.safetensors")
    assert dumps(clean_checkpoint(out, store, got)) == dumps(got)


# -- what the committed format cannot hold is refused, naming the group --------------------------------------

def refused(path, store, meta, *words):
    with pytest.raises(ViewError) as e:
        clean_as_committed(path, store, meta, name="model.x")
    for w in ("model.x", *words):
        assert w in str(e.value), (w, str(e.value))


def test_refused_dtype_the_committed_format_lacks(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "safetensors"), store, None)
    path = check_out(meta, store, tmp_path / "v.pt", "torch")
    formats.edit(path, "layer.0.weight", torch.zeros(2, dtype=torch.complex128))
    refused(path, store, meta, "'layer.0.weight'", "complex128", "safetensors")


def test_refused_non_tensor_value_in_a_flat_committed_format(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "safetensors"), store, None)
    path = check_out(meta, store, tmp_path / "v.pt", "torch")
    obj = torch.load(path, weights_only=True)
    obj["epoch"] = 3
    torch.save(obj, path)
    refused(path, store, meta, "'epoch'", "non-tensor")


def test_refused_names_hdf5_cannot_hold(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "hdf5"), store, None)
    path = check_out(meta, store, tmp_path / "v.safetensors", "safetensors")
    formats.edit(path, "dense", torch.ones(2))  # "dense" is a group of the committed file
    refused(path, store, meta, "'dense", "group")


def test_refused_list_items_added_or_removed(tmp_path, store):
    meta = clean_checkpoint(committed_file(tmp_path, "torch"), store, None)
    path = check_out(meta, store, tmp_path / "v.safetensors", "safetensors")
    formats.edit(path, "blocks/2", torch.ones(2))
    refused(path, store, meta, "'blocks/2'", "list")
    path = check_out(meta, store, tmp_path / "w.safetensors", "safetensors")
    formats.edit(path, "blocks/0", None)
    refused(path, store, meta, "'blocks/0'", "list")
    path = check_out(meta, store, tmp_path / "x.safetensors", "safetensors")
    formats.edit(path, "epoch/x", torch.ones(2))  # under a non-tensor value
    refused(path, store, meta, "'epoch/x'")


def test_checkout_refuses_what_the_view_format_cannot_hold(tmp_path, store):
    torch.save({"c": torch.zeros(2, dtype=torch.complex128), "a": torch.ones(1), "a/b": torch.ones(1)},
               tmp_path / "m.pt")
    meta = clean_checkpoint(tmp_path / "m.pt", store, None)
    with pytest.raises(ViewError, match=r"m\.pt: cannot check out as safetensors: group 'c': .*complex128"):
        smudge_checkpoint(meta, store, tmp_path / "m.pt", fmt="safetensors")
    with pytest.raises(ViewError, match=r"group 'a/b'.*both a tensor and a group"):
        view_of(meta, "hdf5", "m.pt")
    assert not (tmp_path / ".m.pt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["lfs", "m.pt"]


# -- an explicit change of the committed format --------------------------------------------------------------

@pytest.mark.parametrize("was,becomes", PAIRS)
def test_explicit_format_change(tmp_path, store, was, becomes):
    """`git theta add --format F`: the work-tree file (in the old format) recorded as F; F's writer and
    reader then agree with that record, and a later add of either file keeps F."""
    src = committed_file(tmp_path, was)
    meta = clean_checkpoint(src, store, None)
    if was == "torch" and becomes != "torch":
        with pytest.raises(ViewError, match="'epoch' is a non-tensor value"):
            clean_as_committed(src, store, meta, fmt=becomes)
        obj = torch.load(src, weights_only=True)
        del obj["epoch"]
        torch.save(obj, src)
    got = clean_as_committed(src, store, meta, fmt=becomes)
    assert got.format == becomes
    out = check_out(got, store, tmp_path / f"out{SUFFIX[becomes]}")
    assert_same_tensors(formats.read(out, becomes), formats.read(src, was))
    assert dumps(clean_checkpoint(out, store, got)) == dumps(got)
    assert dumps(clean_as_committed(src, store, got)) == dumps(got)  # the old-format file is now a view


def test_a_new_file_keeps_its_own_format(tmp_path, store):
    src = committed_file(tmp_path, "hdf5")
    view = clean_checkpoint(src, store, None)
    assert committed_form(view, None) is view and committed_form(view, None, "hdf5") is view
    with pytest.raises(ViewError, match="formats: torch, safetensors, hdf5"):
        committed_form(view, None, "npz")


def test_as_committed_is_pure_metadata(tmp_path, store):
    """The same view metadata against the same committed metadata: the same result, no file needed."""
    meta = clean_checkpoint(committed_file(tmp_path, "hdf5"), store, None)
    path = check_out(meta, store, tmp_path / "v.pt", "torch")
    view = clean_checkpoint(path, store, meta)
    assert view.format == "torch"
    assert dumps(as_committed(view, meta)) == dumps(as_committed(loads(dumps(view)), loads(dumps(meta)))) == dumps(meta)


@pytest.mark.parametrize("structure", [{"dict": "bogus"}, {"dict": [["model", {"odict": 3}]]}, {"list": None}, []])
def test_malformed_committed_structure_is_an_error_not_a_crash(tmp_path, store, structure):
    """The committed metadata comes from git (possibly from a remote): a damaged structure is reported."""
    meta = clean_checkpoint(committed_file(tmp_path, "torch"), store, None)
    path = check_out(meta, store, tmp_path / "v.safetensors", "safetensors")
    formats.edit(path, "model/extra", torch.ones(2))
    meta.structure = structure
    with pytest.raises(ViewError, match="model.x: the committed torch structure is malformed"):
        clean_as_committed(path, store, meta, name="model.x")
