"""Reading repositories committed by the real Git-Theta 0.2.0 (fixtures/git_theta, made by its make_fixtures.py).

The bundle is cloned with real git, its LFS objects are put in the clone's store and read back through
`git lfs smudge`, metadata comes from `git cat-file` at each commit, and every group of every tracked file of
every commit is compared with what Git-Theta itself checked out (expected.json + values.npz): bit for bit,
except groups whose chain holds a low-rank R @ C product (a BLAS matmul: float rounding).
Then hostile inputs: each must fail with an error naming the file, the group and the problem.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from support.gitrepo import GitEnv

from theta.base.errors import (BlobCorruptError, BlobMissingError, GitThetaFormatError,  # noqa: E402
                               GitThetaUpdateTypeError, MetadataError, ThetaDependencyError, ThetaError)
from theta.peers.gittheta import arithmetic as gt_arithmetic, blobs as gt_blobs, chains as gt_chains, metadata as gt_metadata  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "git_theta"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def le_sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()).hexdigest()


class GitReader:
    """read_object over a real repository: `git cat-file` for metadata, `git lfs smudge` for blobs."""

    def __init__(self, env: GitEnv):
        self.env = env
        self.calls: list[gt_chains.ObjectRef] = []
        self._lfs: dict[str, bytes | None] = {}  # each object smudged once per reader

    def __call__(self, repo_dir, ref):
        self.calls.append(ref)
        if isinstance(ref, gt_chains.GitBlob):
            spec = f"{ref.commit}:{ref.path}"
            if self.env.run(["git", "cat-file", "-e", spec], cwd=repo_dir, check=False).returncode != 0:
                return None
            return self.env.run(["git", "cat-file", "blob", spec], cwd=repo_dir).stdout
        if ref.oid not in self._lfs:
            proc = self.env.run(["git", "lfs", "smudge"], cwd=repo_dir, input=ref.pointer.encode(), check=False)
            self._lfs[ref.oid] = proc.stdout if proc.returncode == 0 else None
        return self._lfs[ref.oid]


@pytest.fixture(scope="module")
def peer_repo(tmp_path_factory):
    """A clone of the Git-Theta bundle with its LFS objects in place (no filter configured: nothing smudges)."""
    base = tmp_path_factory.mktemp("gittheta")
    env = GitEnv.create(base)
    repo = base / "repo"
    env.run(["git", "clone", "-q", "--no-checkout", str(FIXTURE / "repo.bundle"), str(repo)], cwd=base)
    shutil.copytree(FIXTURE / "lfs" / "objects", repo / ".git" / "lfs" / "objects")
    return env, repo


@pytest.fixture(scope="module")
def values():
    with np.load(FIXTURE / "values.npz") as npz:
        return {k: npz[k] for k in npz.files}


def metadata_at(env, repo, commit, path) -> bytes:
    return env.run(["git", "cat-file", "blob", f"{commit}:{path}"], cwd=repo).stdout


# ---------------------------------------------------------------- the fixture itself

def test_fixture_covers_every_git_theta_update_and_stays_small():
    types = {t["update_type"] for c in EXPECTED["commits"] for f in c["files"].values() for t in f.values()}
    assert types == {"dense", "sparse", "low-rank", "ia3"}
    assert EXPECTED["versions"]["git-theta"] == "0.2.0"
    assert len(EXPECTED["commits"]) == 8
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    assert size < 1_000_000, size


# ---------------------------------------------------------------- every commit, every group

def test_every_group_of_every_commit_checks_out_as_git_theta_does(peer_repo, values):
    env, repo = peer_repo
    reader = GitReader(env)
    chain_types: set[tuple[str, ...]] = set()
    compared = 0
    for commit in EXPECTED["commits"]:
        for path, tensors in commit["files"].items():
            meta = gt_metadata.parse_metadata(metadata_at(env, repo, commit["sha"], path), f"{commit['sha']}:{path}")
            # Git-Theta sorts groups by name and writes the checkout in that order.
            assert [g.name for g in meta.groups.values()] == sorted(tensors)
            resolver = gt_chains.ChainResolver(repo, path, reader)
            for name, got in gt_chains.resolve_file(repo, path, meta, reader):
                want = tensors[name]
                group = meta.group(name)
                types = tuple(g.theta.update_type for g, _ in resolver.chain(group, meta.file))
                chain_types.add(types)
                assert types[0] == want["update_type"]
                assert str(got.dtype) == want["dtype"], (commit["subject"], path, name)
                assert list(got.shape) == want["shape"], (commit["subject"], path, name)
                expected_value = values[want["sha256"]]
                if _has_matmul(group, resolver, meta.file):
                    np.testing.assert_allclose(got, expected_value, rtol=1e-6, atol=1e-6,
                                               err_msg=f"{commit['subject']} {path} {name}")
                else:
                    assert le_sha256(got) == want["sha256"], (commit["subject"], path, name, types)
                    np.testing.assert_array_equal(got, expected_value)
                compared += 1
    assert compared == sum(len(t) for c in EXPECTED["commits"] for t in c["files"].values())
    # Chains the fixture was built to hold: update on update on dense, in each direction.
    assert ("low-rank", "sparse", "dense") in chain_types
    assert ("ia3", "low-rank", "dense") in chain_types
    assert ("sparse", "dense") in chain_types and ("ia3", "dense") in chain_types


def _has_matmul(group, resolver, file) -> bool:
    """True when the chain holds a low-rank R @ C (not a plain stored difference)."""
    for g, gfile in resolver.chain(group, file):
        if g.theta.update_type == "low-rank":
            parts = resolver._blob(g, gfile)
            if "R" in parts:
                return True
    return False


def test_resolve_group_follows_a_three_step_chain_across_commits(peer_repo, values):
    env, repo = peer_repo
    c4 = EXPECTED["commits"][4]
    assert c4["subject"].startswith("C4 low-rank")
    reader = GitReader(env)
    got = gt_chains.resolve_group(repo, "model.pt", c4["sha"], "fc1.weight", reader)
    np.testing.assert_allclose(got, values[c4["files"]["model.pt"]["fc1.weight"]["sha256"]], rtol=1e-6, atol=1e-6)
    # It read C4's metadata, then C3's (sparse) and C2's (dense): one text per commit, and three LFS objects.
    commits_read = [r.commit for r in reader.calls if isinstance(r, gt_chains.GitBlob)]
    assert commits_read == [c4["sha"], EXPECTED["commits"][3]["sha"], EXPECTED["commits"][2]["sha"]]
    assert sum(isinstance(r, gt_chains.LfsObject) for r in reader.calls) == 3


def test_sparse_chain_is_bit_exact_and_equals_scipy_reference(peer_repo, values):
    """C3's emb.weight (float64, sparse on dense) computed with Git-Theta's own formula through scipy."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    env, repo = peer_repo
    c3, c2 = EXPECTED["commits"][3], EXPECTED["commits"][2]
    reader = GitReader(env)
    meta = gt_metadata.parse_metadata(metadata_at(env, repo, c3["sha"], "model.pt"), "model.pt")
    group = meta.group("emb.weight")
    assert group.theta.update_type == "sparse" and group.theta.last_commit == c2["sha"]
    update = gt_blobs.decode_group_blob(reader(repo, gt_chains.LfsObject(group.lfs.oid, group.lfs.size, group.lfs.pointer_text())))
    previous = values[c2["files"]["model.pt"]["emb.weight"]["sha256"]]
    reference = np.reshape(scipy_sparse.csr_matrix((update["data"], update["indices"], update["indptr"]),
                                                   shape=(1, np.prod(update["shape"]))).toarray(),
                           update["shape"]) + previous
    got = gt_chains.resolve_group(repo, "model.pt", c3["sha"], "emb.weight", reader)
    assert le_sha256(got) == le_sha256(reference) == c3["files"]["model.pt"]["emb.weight"]["sha256"]


def test_metadata_parse_keeps_every_field_git_theta_wrote(peer_repo):
    env, repo = peer_repo
    pointers_checked = set()
    for commit in EXPECTED["commits"][1:]:
        for path in commit["files"]:
            raw = metadata_at(env, repo, commit["sha"], path)
            assert gt_metadata.is_git_theta_metadata(raw)
            meta = gt_metadata.parse_metadata(raw, path)
            tree = json.loads(raw)
            assert list(meta.groups) == [(k,) for k in tree]
            for (name,), g in meta.groups.items():
                src = tree[name]
                assert str(g.tensor.shape) == src["tensor_metadata"]["shape"]
                assert g.tensor.dtype == src["tensor_metadata"]["dtype"]
                assert list(g.tensor.lsh) == src["tensor_metadata"]["hash"] and len(g.tensor.lsh) == 16
                assert (g.lfs.oid, str(g.lfs.size), g.lfs.version) == (
                    src["lfs_metadata"]["oid"], src["lfs_metadata"]["size"], src["lfs_metadata"]["version"])
                assert (g.theta.update_type, g.theta.last_commit) == (
                    src["theta_metadata"]["update_type"], src["theta_metadata"]["last_commit"])
                if g.lfs.oid in pointers_checked:
                    continue
                pointers_checked.add(g.lfs.oid)
                # The pointer text is the one git-lfs itself produces for the object.
                obj = FIXTURE / "lfs" / "objects" / g.lfs.oid[:2] / g.lfs.oid[2:4] / g.lfs.oid
                pointer = env.run(["git", "lfs", "pointer", f"--file={obj}"], cwd=repo).stdout.decode()
                assert pointer == g.lfs.pointer_text()
    assert len(pointers_checked) == len(list((FIXTURE / "lfs" / "objects").rglob("*/*/*")))


def test_multi_chunk_group_decodes(peer_repo, values):
    """big.mask (1100 x 1000 uint8) is stored by tensorstore as two zarr chunks, the second one padded."""
    env, repo = peer_repo
    c1 = EXPECTED["commits"][1]
    meta = gt_metadata.parse_metadata(metadata_at(env, repo, c1["sha"], "model.pt"))
    g = meta.group("big.mask")
    blob = (FIXTURE / "lfs" / "objects" / g.lfs.oid[:2] / g.lfs.oid[2:4] / g.lfs.oid).read_bytes()
    files = msgpack.unpackb(blob, raw=False)["parameter"]
    assert sorted(files) == [".zarray", "0.0", "1.0"]
    parts = gt_blobs.decode_group_blob(blob, file="model.pt", group="big.mask")
    np.testing.assert_array_equal(parts["parameter"], values[c1["files"]["model.pt"]["big.mask"]["sha256"]])


# ---------------------------------------------------------------- sniffing

def test_sniff_tells_git_theta_metadata_from_ours_and_from_checkpoints(peer_repo):
    env, repo = peer_repo
    assert gt_metadata.is_git_theta_metadata(metadata_at(env, repo, EXPECTED["commits"][7]["sha"], "head.pt"))
    assert gt_metadata.is_git_theta_metadata(b"{}")  # an empty checkpoint's metadata
    assert not gt_metadata.is_git_theta_metadata(b'theta-metadata 1\n{"checkpoint":{}}\n')
    assert not gt_metadata.is_git_theta_metadata(b"PK\x03\x04" + bytes(100))
    assert not gt_metadata.is_git_theta_metadata(b"[1, 2]")
    assert not gt_metadata.is_git_theta_metadata(b"\xff\xfe{")
    assert not gt_metadata.is_git_theta_metadata(b'{"w": {"lfs_metadata": {}}}')  # no tensor/theta sections
    assert not gt_metadata.is_git_theta_metadata(b'{"w": 3}')


# ---------------------------------------------------------------- hostile metadata

def _leaf(**over) -> dict:
    leaf = {"tensor_metadata": {"shape": "(2, 3)", "dtype": "float32", "hash": [1, -2]},
            "lfs_metadata": {"version": "https://git-lfs.github.com/spec/v1", "oid": "a" * 64, "size": "10"},
            "theta_metadata": {"update_type": "dense", "last_commit": None}}
    for dotted, value in over.items():
        sec, key = dotted.split("__")
        if value is KeyError:
            del leaf[sec][key]
        else:
            leaf[sec][key] = value
    return leaf


@pytest.mark.parametrize("over, field, problem", [
    ({"lfs_metadata__oid": "A" * 64}, "lfs_metadata.oid", "64 lowercase hex"),
    ({"lfs_metadata__oid": "a" * 63}, "lfs_metadata.oid", "64 lowercase hex"),
    ({"lfs_metadata__oid": "../../../etc/passwd"}, "lfs_metadata.oid", "64 lowercase hex"),
    ({"lfs_metadata__size": "-1"}, "lfs_metadata.size", "non-negative"),
    ({"lfs_metadata__size": "12x"}, "lfs_metadata.size", "non-negative"),
    ({"lfs_metadata__size": KeyError}, "lfs_metadata.size", "missing"),
    ({"lfs_metadata__version": "v 1\noid"}, "lfs_metadata.version", "without spaces"),
    ({"tensor_metadata__shape": "(2, -3)"}, "tensor_metadata.shape", "tuple of sizes"),
    ({"tensor_metadata__shape": "[2, 3]"}, "tensor_metadata.shape", "tuple of sizes"),
    ({"tensor_metadata__shape": "(99999999999, 99999999999)"}, "tensor_metadata.shape", "too large"),
    ({"tensor_metadata__shape": [2, 3]}, "tensor_metadata.shape", "expected a string"),
    ({"tensor_metadata__dtype": "object"}, "tensor_metadata.dtype", "unsupported dtype"),
    ({"tensor_metadata__hash": ["x"]}, "tensor_metadata.hash", "integers"),
    ({"theta_metadata__update_type": "rm -rf /"}, "theta_metadata.update_type", "update type name"),
    ({"theta_metadata__last_commit": "HEAD~1"}, "theta_metadata.last_commit", "commit id"),
    ({"theta_metadata__last_commit": KeyError}, "theta_metadata.last_commit", "missing"),
])
def test_bad_metadata_fields_are_named(over, field, problem):
    text = json.dumps({"enc.weight": _leaf(**over)})
    with pytest.raises(GitThetaFormatError) as e:
        gt_metadata.parse_metadata(text, "model.pt")
    msg = str(e.value)
    assert "model.pt" in msg and "'enc.weight'" in msg and field in msg and problem in msg, msg
    assert (e.value.file, e.value.group, e.value.field) == ("model.pt", "enc.weight", field)
    assert isinstance(e.value, MetadataError)


@pytest.mark.parametrize("text, problem", [
    (b"\xff{}", "not UTF-8"),
    ("{", "not valid JSON"),
    ('{"a": NaN}', "not valid JSON"),
    ("[]", "JSON object at the top"),
    ('{"a": 1}', "expected an object"),
    ('{"a": {"b": 1}}', "expected an object"),
    ('{"a": {"lfs_metadata": {}}}', "missing or not an object"),
    ('{"a": {}, "a": {}}', "duplicate key"),
    ("{" + '"a": {' * 70 + "}" * 71, "nested deeper"),
])
def test_malformed_metadata_texts_are_refused(text, problem):
    with pytest.raises(GitThetaFormatError, match=problem):
        gt_metadata.parse_metadata(text, "model.pt")


def test_averaged_merge_leaf_of_git_theta_is_refused_by_name():
    """Git-Theta 0.2.0's averaging merge writes lfs_metadata as a [pointer, null] list (see the format doc)."""
    leaf = _leaf()
    leaf["lfs_metadata"] = [leaf["lfs_metadata"], None]
    with pytest.raises(GitThetaFormatError) as e:
        gt_metadata.parse_metadata(memoryview(json.dumps({"dec.bias": leaf}).encode()), "model.pt")
    assert (e.value.group, e.value.field) == ("dec.bias", "lfs_metadata")
    assert "missing or not an object" in str(e.value)


def test_nested_metadata_groups_are_keyed_by_path():
    """Nested checkpoints (flax, tensorflow) give nested metadata; torch state dicts a flat one."""
    meta = gt_metadata.parse_metadata(json.dumps({"enc": {"layer": {"w": _leaf()}}, "b": _leaf()}), "m")
    assert list(meta.groups) == [("enc", "layer", "w"), ("b",)]
    assert meta.group("enc/layer/w").key == ("enc", "layer", "w")
    assert meta.group(("b",)).tensor.shape == (2, 3)
    assert meta.group("nope") is None


# ---------------------------------------------------------------- hostile chains

class DictReader:
    """read_object over in-memory texts and blobs (for chains no Git-Theta could write)."""

    def __init__(self, texts: dict[tuple[str, str], str], blobs: dict[str, bytes]):
        self.texts, self.blobs = texts, blobs

    def __call__(self, repo_dir, ref):
        if isinstance(ref, gt_chains.GitBlob):
            t = self.texts.get((ref.commit, ref.path))
            return None if t is None else t.encode()
        return self.blobs.get(ref.oid)


@pytest.fixture(scope="module")
def peer_blobs(peer_repo):
    """{group: (blob, leaf)} of C5's model.pt (ia3, low-rank, sparse and dense groups), from the fixture."""
    env, repo = peer_repo
    c5 = EXPECTED["commits"][5]
    tree = json.loads(metadata_at(env, repo, c5["sha"], "model.pt"))
    out = {}
    for name, leaf in tree.items():
        oid = leaf["lfs_metadata"]["oid"]
        out[name] = ((FIXTURE / "lfs" / "objects" / oid[:2] / oid[2:4] / oid).read_bytes(), leaf)
    return out


def _one_group_repo(leaf: dict, blob: bytes, name: str = "w", commit: str = "c" * 40,
                    previous: tuple[dict, bytes] | None = None, prev_commit: str = "b" * 40):
    texts = {(commit, "model.pt"): json.dumps({name: leaf})}
    blobs = {leaf["lfs_metadata"]["oid"]: blob}
    if previous is not None:
        texts[(prev_commit, "model.pt")] = json.dumps({name: previous[0]})
        blobs[previous[0]["lfs_metadata"]["oid"]] = previous[1]
    return DictReader(texts, blobs)


def _with_blob(leaf: dict, blob: bytes, **theta) -> dict:
    leaf = copy.deepcopy(leaf)
    leaf["lfs_metadata"].update(oid=hashlib.sha256(blob).hexdigest(), size=str(len(blob)))
    leaf["theta_metadata"].update(theta)
    return leaf


def test_unknown_update_type_names_file_group_and_type(peer_blobs):
    blob, leaf = peer_blobs["fc1.weight"]
    bad = _with_blob(leaf, blob, update_type="delta", last_commit="b" * 40)
    reader = _one_group_repo(bad, blob, name="fc1.weight")
    with pytest.raises(GitThetaUpdateTypeError) as e:
        gt_chains.resolve_group("/nonexistent", "model.pt", "c" * 40, "fc1.weight", reader)
    msg = str(e.value)
    assert "'delta'" in msg and "'fc1.weight'" in msg and "model.pt" in msg and "theta_metadata.update_type" in msg


def test_incremental_update_without_previous_commit_is_refused(peer_blobs):
    blob, leaf = peer_blobs["fc2.weight"]  # an ia3 group in C5
    reader = _one_group_repo(_with_blob(leaf, blob, last_commit=None), blob, name="fc2.weight")
    with pytest.raises(GitThetaFormatError, match="without a previous version"):
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "fc2.weight", reader)


def test_previous_commit_without_the_group_or_file_is_refused(peer_blobs):
    blob, leaf = peer_blobs["fc2.weight"]
    other_blob, other_leaf = peer_blobs["fc2.bias"]
    leaf = _with_blob(leaf, blob, last_commit="b" * 40)
    reader = _one_group_repo(leaf, blob, name="fc2.weight")
    with pytest.raises(GitThetaFormatError, match="commit b{40} has no model.pt"):
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "fc2.weight", reader)
    reader.texts[("b" * 40, "model.pt")] = json.dumps({"fc2.bias": other_leaf})
    with pytest.raises(GitThetaFormatError, match="has no such group"):
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "fc2.weight", reader)


def test_chain_loop_is_refused(peer_blobs):
    blob, leaf = peer_blobs["fc2.weight"]
    a = _with_blob(leaf, blob, last_commit="b" * 40)
    b = _with_blob(leaf, blob, last_commit="c" * 40)
    reader = DictReader({("c" * 40, "model.pt"): json.dumps({"w": a}), ("b" * 40, "model.pt"): json.dumps({"w": b})},
                        {a["lfs_metadata"]["oid"]: blob})
    with pytest.raises(GitThetaFormatError, match="loops back"):
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "w", reader)


def test_missing_and_corrupt_lfs_objects(peer_blobs):
    blob, leaf = peer_blobs["fc2.bias"]
    reader = _one_group_repo(leaf, blob, name="fc2.bias")
    reader.blobs.clear()
    with pytest.raises(BlobMissingError) as e:
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "fc2.bias", reader)
    assert leaf["lfs_metadata"]["oid"] in str(e.value) and "'fc2.bias'" in str(e.value)
    reader.blobs[leaf["lfs_metadata"]["oid"]] = blob[:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(BlobCorruptError, match="fc2.bias"):
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "fc2.bias", reader)


def test_dense_blob_disagreeing_with_its_metadata_is_refused(peer_blobs):
    blob, leaf = peer_blobs["fc2.bias"]
    leaf = copy.deepcopy(leaf)
    leaf["tensor_metadata"]["shape"] = "(5,)"
    reader = _one_group_repo(leaf, blob, name="fc2.bias")
    with pytest.raises(GitThetaFormatError, match=r"blob holds float32\[4\], the metadata says float32\[5\]"):
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "fc2.bias", reader)


def test_sparse_indices_out_of_range_are_refused(peer_blobs):
    blob, leaf = peer_blobs["emb.weight"]  # sparse on a dense base
    outer = msgpack.unpackb(blob, raw=False)
    idx = gt_blobs.decode_group_blob(blob)["indices"]
    assert idx.tolist() == [14]  # one entry, the last of 5 x 3
    # Re-encode 'indices' as [15] with the same zarr settings: numcodecs' blosc is what tensorstore used.
    from numcodecs import Blosc
    z = json.loads(outer["indices"][".zarray"])
    outer["indices"]["0"] = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE).encode(
        np.array([15], dtype=z["dtype"]))
    bad_blob = msgpack.packb(outer, use_bin_type=True)
    base_blob, base_leaf = peer_blobs["fc2.bias"]
    base_leaf = copy.deepcopy(base_leaf)
    base_leaf["tensor_metadata"].update(shape="(5, 3)", dtype="float64")
    base = np.arange(15, dtype=np.float64).reshape(5, 3)
    base_blob = _zarr_blob({"parameter": base})
    base_leaf = _with_blob(base_leaf, base_blob)
    reader = _one_group_repo(_with_blob(leaf, bad_blob, last_commit="b" * 40), bad_blob, name="emb.weight",
                             previous=(base_leaf, base_blob))
    with pytest.raises(GitThetaFormatError, match=r"indices must lie in \[0, 15\)") as e:
        gt_chains.resolve_group("/x", "model.pt", "c" * 40, "emb.weight", reader)
    assert "'emb.weight'" in str(e.value)


def _zarr_blob(arrays: dict[str, np.ndarray]) -> bytes:
    """A blob laid out as Git-Theta's tensorstore writes one: single chunk, blosc lz4 level 5, shuffle -1
    (tensorstore's "auto": bit-shuffle for 1-byte items, byte-shuffle otherwise), typesize = itemsize."""
    from numcodecs import Blosc
    out = {}
    for name, a in arrays.items():
        z = {"chunks": list(a.shape), "compressor": {"blocksize": 0, "clevel": 5, "cname": "lz4", "id": "blosc",
                                                     "shuffle": -1}, "dimension_separator": ".",
             "dtype": a.dtype.str, "fill_value": None, "filters": None, "order": "C", "shape": list(a.shape),
             "zarr_format": 2}
        key = ".".join("0" for _ in a.shape) or "0"
        shuffle = Blosc.BITSHUFFLE if a.dtype.itemsize == 1 else Blosc.SHUFFLE
        chunk = Blosc(cname="lz4", clevel=5, shuffle=shuffle).encode(np.ascontiguousarray(a).reshape(-1))
        out[name] = {".zarray": json.dumps(z, separators=(",", ":")).encode(), key: chunk}
    return msgpack.packb(out, use_bin_type=True)


def test_hand_made_blob_matches_tensorstore_layout(peer_blobs, values):
    """_zarr_blob (used for hostile chains) reproduces real tensorstore blobs byte for byte."""
    c5 = EXPECTED["commits"][5]["files"]["model.pt"]
    for name in ("fc2.bias", "fc3.weight", "flags", "quant.zero", "bn.num_batches_tracked"):
        blob, _ = peer_blobs[name]
        assert _zarr_blob({"parameter": values[c5[name]["sha256"]]}) == blob, name


# ---------------------------------------------------------------- hostile blobs

def _mutate(blob: bytes, part: str, fn) -> bytes:
    outer = msgpack.unpackb(blob, raw=False)
    fn(outer[part])
    return msgpack.packb(outer, use_bin_type=True)


def _set_zarray(**over):
    def fn(files):
        z = json.loads(files[".zarray"])
        z.update(over)
        files[".zarray"] = json.dumps(z).encode()
    return fn


@pytest.mark.parametrize("mutation, problem", [
    (_set_zarray(compressor={"id": "pickle"}), "compressor must be blosc or null"),
    (_set_zarray(compressor={"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": -1, "blocksize": 0,
                             "typesize": 8}), "unexpected blosc settings"),
    (_set_zarray(dtype="|O"), "unsupported dtype"),
    (_set_zarray(dtype="<M8[ns]"), "unsupported dtype"),
    (_set_zarray(filters=[{"id": "delta", "dtype": "<f4"}]), "filters are not supported"),
    (_set_zarray(zarr_format=3), "zarr_format must be 2"),
    (_set_zarray(shape=[4, 4]), "must be lists of the same length"),
    (_set_zarray(shape=[400000000], chunks=[4]), "needs 100000000"),
    (_set_zarray(shape=[8], chunks=[8]), "blosc header says 16 bytes"),
    (lambda files: files.pop("0"), "0 chunk(s) present"),
    (lambda files: files.update({"1": files["0"]}), "2 chunk(s) present"),
    (lambda files: files.update({"x": files.pop("0")}), "unexpected file 'x'"),
    (lambda files: files.update({"0": files["0"][:10]}), "too short for a blosc header"),
    (lambda files: files.update({"0": files["0"][:-1]}), "compressed to 32"),
    (lambda files: files.update({"0": files["0"][:4] + (2**31).to_bytes(4, "little") + files["0"][8:]}),
     "2147483648 bytes"),
    (lambda files: files.pop(".zarray"), ".zarray: missing"),
])
def test_bad_blobs_are_refused_before_zarr_reads_them(peer_blobs, mutation, problem):
    blob, _ = peer_blobs["fc2.bias"]  # dense zeros(4) float32: one 18-byte blosc chunk
    bad = _mutate(blob, "parameter", mutation)
    with pytest.raises(GitThetaFormatError) as e:
        gt_blobs.decode_group_blob(bad, file="model.pt", group="fc2.bias")
    msg = str(e.value)
    assert problem in msg and "model.pt" in msg and "'fc2.bias'" in msg and "part 'parameter'" in msg, msg


@pytest.mark.parametrize("blob, problem", [
    (b"", "not a msgpack map"),
    (b"\xc1", "not a msgpack map"),
    (msgpack.packb([1, 2]), "not a non-empty msgpack map"),
    (msgpack.packb({}), "not a non-empty msgpack map"),
    (msgpack.packb({"parameter": {".zarray": "text, not bytes"}}), "map of zarr file names to bytes"),
    (msgpack.packb({f"p{i}": {} for i in range(17)}), "at most 16"),
])
def test_blobs_that_are_not_git_theta_maps_are_refused(blob, problem):
    with pytest.raises(GitThetaFormatError, match=problem):
        gt_blobs.decode_group_blob(blob, file="model.pt", group="g")


def test_max_bytes_bounds_what_decoding_allocates(peer_blobs):
    blob, _ = peer_blobs["big.mask"]
    assert gt_blobs.decode_group_blob(blob, max_bytes=1_100_000)["parameter"].nbytes == 1_100_000
    with pytest.raises(GitThetaFormatError, match="over the limit of 1099999"):
        gt_blobs.decode_group_blob(blob, file="model.pt", group="big.mask", max_bytes=1_099_999)


def test_missing_zarr_says_what_to_install(peer_blobs, monkeypatch):
    blob, _ = peer_blobs["fc2.bias"]
    monkeypatch.setitem(sys.modules, "zarr", None)  # what an environment without the extra looks like
    with pytest.raises(ThetaDependencyError) as e:
        gt_blobs.decode_group_blob(blob)
    assert str(e.value) == ("zarr is not installed, and reading Git-Theta's parameter blobs needs zarr >= 3.1: "
                            'pip install "zipslice-theta[gittheta]"')
    assert isinstance(e.value, ThetaError) and isinstance(e.value, ModuleNotFoundError) and e.value.name == "zarr"


# ---------------------------------------------------------------- update math

def test_update_math_matches_git_theta_formulas():
    rng = np.random.default_rng(0)
    prev = rng.standard_normal((4, 3)).astype(np.float32)
    # sparse: duplicates sum, as scipy's csr toarray does; -0.0 added to 0 gives +0.0
    parts = {"data": np.array([1.5, -0.0, 2.0], np.float32), "indices": np.array([5, 0, 5], np.int32),
             "indptr": np.array([0, 3], np.int32), "shape": np.array([4, 3])}
    want = prev.copy().reshape(-1)
    want[5] = (np.float32(0) + np.float32(1.5) + np.float32(2.0)) + want[5]
    want[0] = (np.float32(0) + np.float32(-0.0)) + want[0]
    got = gt_arithmetic.apply_update("sparse", parts, prev)
    assert got.dtype == np.float32 and got.tobytes() == want.reshape(4, 3).tobytes()
    # low-rank: R @ C + previous, or a stored difference
    R, C = rng.standard_normal((4, 2)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    assert gt_arithmetic.apply_update("low-rank", {"R": R, "C": C}, prev).tobytes() == (R @ C + prev).tobytes()
    d = rng.standard_normal((4, 3)).astype(np.float32)
    assert gt_arithmetic.apply_update("low-rank", {"parameter": d}, prev).tobytes() == (d + prev).tobytes()
    # ia3: broadcast product; numpy promotion decides the dtype, as in Git-Theta
    s = rng.standard_normal((4, 1))
    got = gt_arithmetic.apply_update("ia3", {"ia3": s}, prev)
    assert got.dtype == np.float64 and got.tobytes() == (prev * s).tobytes()
    with pytest.raises(GitThetaFormatError, match=r"turns shape \[4, 3\] into \[2, 4, 3\]"):
        gt_arithmetic.apply_update("ia3", {"ia3": np.ones((2, 1, 1))}, prev, file="m", group="g")
    with pytest.raises(GitThetaFormatError, match="holds named parts"):
        gt_arithmetic.apply_update("sparse", {"parameter": prev}, prev)
    with pytest.raises(GitThetaFormatError, match="cannot apply the low-rank update"):
        gt_arithmetic.apply_update("low-rank", {"R": R}, prev)
    with pytest.raises(GitThetaUpdateTypeError, match="'rows'"):
        gt_arithmetic.apply_update("rows", {}, prev)
