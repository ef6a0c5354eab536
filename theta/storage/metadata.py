"""The metadata text git stores for a checkpoint: what to rebuild it from, one parameter group per line.

Format (version 1), UTF-8, one JSON value per line, keys sorted, no spaces::

    theta-metadata 1
    # git-theta: ... (HINT: one line for a person who meets this text without theta; readers skip it)
    {"checkpoint":{"format":"torch","lsh":{...},"metadata":{...}}}
    {"structure":{...}}                      zipslice structure tree (or null for flat formats)
    {"order":["a","b",...]}                  tensor names in file order (groups and aliases)
    {"alias":"b","grad":false,"of":"a","param":true}         one line per tied alias, sorted by name
    {"dtype":"float32","grad":false,"group":"a","hash":"<value name>","lsh":[...],"param":true,"shape":[2,3],
     "steps":[{"hash":"<value name>","oid":"<sha256>","params":{},"size":123,"type":"dense"}]}
                                             one line per group, sorted by name

The text depends only on content and on the names its values already had (a value keeps the name it was
committed with, theta.base.valuehash): the same checkpoint gives the same bytes, so `git status` stays clean
after a checkout, and a change to one group changes one line.

Version 2 adds one kind of file: one that theta tracks but that is not a checkpoint (a README matched by
``* filter=theta``), stored as ONE opaque blob, like git-lfs would, and checked out bit for bit::

    theta-metadata 2
    {"checkpoint":{"format":"opaque","lsh":{},"metadata":{}}}
    {"opaque":{"oid":"<sha256 of the file>","size":123}}
    {"order":[]}

Version 3 adds values named by BLAKE3 (``"hash":"blake3:<64 hex>"``, :mod:`theta.base.valuehash`): every value theta
hashes anew is named so, and a value named before keeps its sha256 name. A checkpoint is written as version 3
when any of its groups or steps holds a BLAKE3 name, else as version 1 (so a checkpoint committed before
keeps its text while its values do not change). Version 4 adds ``delta`` steps of op ``split18`` /
``split50``, the steps of keyframes (:mod:`theta.updates.keyframe`); a text is written as version 4 only when it
holds one. This reader reads all four. Lines starting
with ``#`` are comments: the human hint on the second line, and readers skip them, so text written
before the hint existed reads the same; :func:`same_content` treats two texts that differ only in comments
as equal (the filter keeps the committed bytes then, so upgrading theta dirties nothing). Every field is checked against
:mod:`theta.storage.schema` (types, limits) before use, and :func:`dumps` runs the same checks, so theta
never writes a text it would refuse to read.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from theta.base import valuehash
from theta.base.errors import MetadataError
from theta.storage import schema
from theta.storage.schema import Where
from theta.storage.store import BlobRef

MAGIC = "theta-metadata"
VERSION = 1           # checkpoints
OPAQUE_VERSION = 2    # adds files stored as one opaque blob
BLAKE3_VERSION = 3    # adds values named by BLAKE3 (theta.base.valuehash); written only by texts that hold such a name
SPLIT_VERSION = 4     # adds delta steps of op split18/split50 (keyframes, theta.updates.keyframe); written only
                      # by texts that hold one (a theta reading up to 3 then says to upgrade, before any download)
SUPPORTED_VERSIONS = (VERSION, OPAQUE_VERSION, BLAKE3_VERSION, SPLIT_VERSION)
FIRST_LINE = f"{MAGIC} {VERSION}"
MAX_METADATA_BYTES = schema.MAX_TEXT_BYTES  # git blobs larger than this are never read as metadata
# The second line: what this file is and how to get the model, for a collaborator without theta (a clone
# without it leaves this text where the checkpoint should be). Fixed text: the same for every file, stable.
HINT = ("# git-theta: this file stands for a model checkpoint whose tensors are stored in Git LFS; to get "
        "the model: pip install zipslice-theta && git theta install && git theta pull")
OPAQUE_FORMAT = "opaque"


@dataclass(frozen=True)
class Step:
    """One link of a group's update chain.

    ``type`` names the update type (entry point in ``theta.updates``), ``blob`` its stored parts,
    ``params`` small JSON-able values, ``hash`` the name of the group's value after this step (theta.base.valuehash).
    """

    type: str
    blob: BlobRef
    params: dict = field(default_factory=dict)
    hash: str = ""

    def to_json(self) -> dict:
        return {"type": self.type, "oid": self.blob.oid, "size": self.blob.size, "params": self.params,
                "hash": self.hash}

    @classmethod
    def from_json(cls, d: dict) -> "Step":
        return cls(type=d["type"], blob=BlobRef(d["oid"], int(d["size"])), params=dict(d.get("params") or {}),
                   hash=d["hash"])


@dataclass(frozen=True)
class Norms:
    """Norms of a float group's value, recorded by clean (:mod:`theta.model.norms`) so that a history is drawn from
    metadata alone: ``value`` is ‖value‖₂; ``source`` (``"from"`` in the text) names the previous value clean
    compared it with, ``change`` is ‖value − that value‖₂ and ``changed`` how many elements differ in their
    bits (all three absent when clean did not have that value at hand)."""

    value: float
    source: str | None = None
    change: float | None = None
    changed: int | None = None

    def to_json(self) -> dict:
        d: dict = {"value": self.value}
        if self.source is not None:
            d.update({"from": self.source, "change": self.change, "changed": self.changed})
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Norms":
        return cls(value=float(d["value"]), source=d.get("from"),
                   change=None if d.get("change") is None else float(d["change"]), changed=d.get("changed"))


@dataclass
class GroupMeta:
    """One parameter group (tensor): its identity and how to rebuild its value.

    ``hash`` names the value: the hash of its contiguous little-endian bytes (theta.base.valuehash: BLAKE3, or
    sha256 in names written before); ``lsh`` the E2LSH signature
    (None for int/bool groups, which are compared exactly); ``steps[0]`` is self-contained and each later step
    applies to the value the steps before it produce. ``fast`` is the xxh3-128 of the same bytes
    (:func:`theta.updates.fast_hash`), with which clean recognises an unchanged group without hashing it for a name;
    None in text written before theta recorded it (clean then compares value names, as it did). ``norms``: see
    :class:`Norms` (None for other dtypes, and in text written before theta recorded them).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str
    steps: list[Step]
    lsh: list[int] | None = None
    is_parameter: bool = False
    requires_grad: bool = False
    fast: str | None = None
    norms: Norms | None = None

    def to_json(self) -> dict:
        d = {"group": self.name, "dtype": self.dtype, "shape": list(self.shape), "hash": self.hash,
             "lsh": self.lsh, "param": self.is_parameter, "grad": self.requires_grad,
             "steps": [s.to_json() for s in self.steps]}
        if self.fast is not None:  # absent, not null: a group without it writes the text it always did
            d["xxh3"] = self.fast
        if self.norms is not None:  # (likewise)
            d["norms"] = self.norms.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "GroupMeta":
        return cls(name=d["group"], dtype=d["dtype"], shape=tuple(int(s) for s in d["shape"]), hash=d["hash"],
                   steps=[Step.from_json(s) for s in d["steps"]], lsh=d.get("lsh"),
                   is_parameter=bool(d.get("param", False)), requires_grad=bool(d.get("grad", False)),
                   fast=d.get("xxh3"), norms=Norms.from_json(d["norms"]) if "norms" in d else None)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Alias:
    """A tensor name tied to a group (same storage, same view): rebuilt tied, stored once."""

    name: str
    of: str
    is_parameter: bool = False
    requires_grad: bool = False

    def to_json(self) -> dict:
        return {"alias": self.name, "of": self.of, "param": self.is_parameter, "grad": self.requires_grad}

    @classmethod
    def from_json(cls, d: dict) -> "Alias":
        return cls(name=d["alias"], of=d["of"], is_parameter=bool(d.get("param", False)),
                   requires_grad=bool(d.get("grad", False)))


@dataclass
class CheckpointMeta:
    """Everything needed to rebuild one checkpoint file, with tensor data by reference."""

    format: str
    order: list[str]
    groups: dict[str, GroupMeta]
    structure: Any = None
    aliases: dict[str, Alias] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    lsh: dict = field(default_factory=dict)   # parameters of the LSH family that made the signatures
    version: int = VERSION
    opaque: BlobRef | None = None             # a file that is not a checkpoint: its bytes are this blob

    @property
    def is_opaque(self) -> bool:
        return self.opaque is not None

    def blob_refs(self) -> list[BlobRef]:
        """Every blob needed to rebuild the file, each once, in group order."""
        if self.opaque is not None:
            return [self.opaque]
        seen: set[BlobRef] = set()
        out = []
        for name in sorted(self.groups):
            for s in self.groups[name].steps:
                if s.blob not in seen:
                    seen.add(s.blob)
                    out.append(s.blob)
        return out

    def group_for(self, name: str) -> GroupMeta:
        """The group holding tensor ``name`` (following an alias)."""
        if name in self.aliases:
            name = self.aliases[name].of
        try:
            return self.groups[name]
        except KeyError:
            raise MetadataError(f"metadata has no group {name!r}") from None

    def validate(self, file: str | None = None) -> None:
        """Cross-line consistency (each line was checked on its own by theta.storage.schema)."""
        where = Where(file)
        if self.opaque is not None:
            if self.groups or self.aliases or self.order or self.format != OPAQUE_FORMAT:
                raise where.fail("opaque", f"a file stored as one opaque blob has format {OPAQUE_FORMAT!r} "
                                           "and no groups")
            return
        if self.format == OPAQUE_FORMAT:
            raise where.fail("format", f"format {OPAQUE_FORMAT!r} needs an opaque line")
        if len(self.groups) + len(self.aliases) > schema.MAX_GROUPS:
            raise where.fail(None, f"{len(self.groups) + len(self.aliases)} groups and aliases exceed the "
                                   f"limit of {schema.MAX_GROUPS}")
        names = set(self.groups) | set(self.aliases)
        if len(self.order) != len(set(self.order)) or set(self.order) != names:
            raise where.fail("order", "metadata 'order' does not list each group and alias exactly once")
        for a in self.aliases.values():
            if a.name in self.groups:
                raise where.at(group=a.name).fail("alias", "a name is both a group and an alias")
            if a.of not in self.groups:
                raise where.at(group=a.name).fail("of", f"alias refers to unknown group {a.of!r}")
        for g in self.groups.values():
            if not g.steps:
                raise where.at(group=g.name).fail("steps", "group has no steps")
        k = self.lsh.get("k")
        if isinstance(k, int):
            for g in self.groups.values():
                if g.lsh is not None and len(g.lsh) != k:
                    raise where.at(group=g.name).fail("lsh", f"signature of {len(g.lsh)} numbers, the "
                                                             f"checkpoint's LSH family has k={k}")
        if self.structure is not None:
            for t in schema.structure_tensors(self.structure):
                if t not in names:
                    raise where.fail("structure", f"the structure refers to tensor {t!r:.80}, which is neither "
                                                  "a group nor an alias")


def _line(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def dumps(meta: CheckpointMeta, file: str | None = None) -> str:
    """The deterministic text of ``meta`` (ends with a newline).

    Every line passes the same schema checks as :func:`loads` (MetadataError otherwise), so theta never
    writes metadata that it, or zipslice reading the checked-out file, would refuse.
    """
    where = Where(file)
    header = {"format": meta.format, "metadata": dict(meta.metadata or {}), "lsh": meta.lsh}
    schema.checkpoint(header, where.at(line=3))
    if meta.opaque is not None:
        body = {"oid": meta.opaque.oid, "size": meta.opaque.size}
        schema.opaque(body, where.at(line=4))
        lines = [f"{MAGIC} {OPAQUE_VERSION}", HINT, _line({"checkpoint": header}), _line({"opaque": body}),
                 _line({"order": []})]
        meta.validate(file)
        return _finish(lines, where)
    schema.structure(meta.structure, where.at(line=4))
    # the lowest version that can say it: a checkpoint whose values all keep sha256 names keeps its text
    first = FIRST_LINE
    if any(_splits(g) for g in meta.groups.values()):
        first = f"{MAGIC} {SPLIT_VERSION}"
    elif any(_names_blake3(g) for g in meta.groups.values()):
        first = f"{MAGIC} {BLAKE3_VERSION}"
    lines = [first, HINT, _line({"checkpoint": header}), _line({"structure": meta.structure}),
             _line({"order": schema.order(list(meta.order), where.at(line=5))})]
    for n in sorted(meta.aliases):
        obj = meta.aliases[n].to_json()
        lines.append(_line(schema.alias(obj, where.at(line=len(lines) + 1))))
    for n in sorted(meta.groups):
        obj = meta.groups[n].to_json()
        lines.append(_line(schema.group(obj, where.at(line=len(lines) + 1))))
    meta.validate(file)
    return _finish(lines, where)


def _splits(g: GroupMeta) -> bool:
    return any(s.type == "delta" and str(s.params.get("op", "")).startswith("split") for s in g.steps)


def _names_blake3(g: GroupMeta) -> bool:
    return (valuehash.is_blake3(g.hash) or any(valuehash.is_blake3(s.hash) for s in g.steps)
            or (g.norms is not None and g.norms.source is not None and valuehash.is_blake3(g.norms.source)))


def _finish(lines: list[str], where: Where) -> str:
    text = "\n".join(lines) + "\n"
    if len(text) > schema.MAX_TEXT_BYTES:  # characters <= bytes: a cheap first test
        size = len(text.encode("utf-8"))
        if size > schema.MAX_TEXT_BYTES:
            raise where.fail(None, f"metadata of {size} bytes exceeds the limit of {schema.MAX_TEXT_BYTES}")
    return text


def is_metadata(data: "str | bytes | bytearray | memoryview") -> bool:
    """True when ``data`` (or its first bytes) is a theta metadata text rather than a checkpoint."""
    head = data[: len(MAGIC) + 1]
    if not isinstance(head, str):
        head = bytes(head).decode("latin-1")
    return head == MAGIC + " "


# a group line's fast hash: its last key (keys are sorted), and its norms (an object of numbers and a value
# name): dropped when comparing texts (same_content)
_FAST_FIELD = re.compile(rb',"xxh3":"[0-9a-f]{32}"\}$')
_NORMS_FIELD = re.compile(rb',"norms":\{[^{}]*\}')


def same_content(a: "str | bytes", b: "str | bytes") -> bool:
    """True when two metadata texts differ at most in comment lines (e.g. one predates :data:`HINT`), in
    the groups' fast hashes (``xxh3``: one predates them) and in their norms (one predates them, or another
    machine rounded a sum the other way), i.e. they describe the same values the same way."""
    def strip(t):
        t = t.encode("utf-8") if isinstance(t, str) else bytes(t)
        return [_NORMS_FIELD.sub(b"", _FAST_FIELD.sub(b"}", line)) if line.startswith(b'{"dtype":') else line
                for line in t.split(b"\n") if not line.startswith(b"#")]
    return strip(a) == strip(b)


def loads(text: "str | bytes", file: str | None = None) -> CheckpointMeta:
    """Parse and check a metadata text; MetadataError naming ``file``, the line, the group and the field on
    anything unexpected or over a limit (:mod:`theta.storage.schema`)."""
    where = Where(file)
    if len(text) > schema.MAX_TEXT_BYTES:
        raise where.fail(None, f"metadata of {len(text)} bytes exceeds the limit of {schema.MAX_TEXT_BYTES}")
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise where.fail(None, f"metadata is not UTF-8 text: {e}") from None
    lines = text.split("\n")
    if not lines[0].startswith(MAGIC + " "):
        raise where.fail(None, f"not theta metadata: first line is {lines[0][:60]!r}, expected {FIRST_LINE!r}")
    try:
        version = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise where.fail(None, f"bad metadata version line {lines[0][:60]!r}") from None
    if version not in SUPPORTED_VERSIONS:
        raise where.fail(None, f"metadata version {version} is not supported (this theta reads "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade theta")
    fmt = None
    file_meta: dict = {}
    lsh: dict = {}
    structure = None
    order: list[str] | None = None
    opaque: BlobRef | None = None
    groups: dict[str, GroupMeta] = {}
    aliases: dict[str, Alias] = {}
    seen: set[str] = set()
    for no, line in enumerate(lines[1:], start=2):
        if not line.strip() or line.startswith("#"):
            continue
        at = where.at(line=no)
        obj = schema.parse_line(line, at)
        if not isinstance(obj, dict) or len(obj) == 0:
            raise at.fail(None, "a line must be a JSON object")
        kind = next((k for k in ("group", "alias", "checkpoint", "structure", "order", "opaque") if k in obj), None)
        if kind is None:
            raise at.fail(None, f"unknown line kind with keys {sorted(obj)[:3]}")
        if kind in ("checkpoint", "structure", "order", "opaque"):
            if len(obj) != 1:
                raise at.fail(kind, f"a {kind} line holds only {kind!r}")
            if kind in seen:
                raise at.fail(kind, f"a second {kind} line")
            seen.add(kind)
        if kind == "group":
            g = GroupMeta.from_json(schema.group(obj, at))
            if version < BLAKE3_VERSION and _names_blake3(g):
                raise at.at(group=g.name).fail("hash", f"a value named by BLAKE3 needs metadata version "
                                                       f"{BLAKE3_VERSION}")
            if version < SPLIT_VERSION and _splits(g):
                raise at.at(group=g.name).fail("steps", f"a split delta step needs metadata version "
                                                        f"{SPLIT_VERSION}")
            if g.name in groups:
                raise at.at(group=g.name).fail("group", "group appears twice")
            groups[g.name] = g
        elif kind == "alias":
            a = Alias.from_json(schema.alias(obj, at))
            if a.name in aliases:
                raise at.at(group=a.name).fail("alias", "alias appears twice")
            aliases[a.name] = a
        elif kind == "checkpoint":
            fmt, file_meta, lsh = schema.checkpoint(obj["checkpoint"], at)
        elif kind == "structure":
            structure = obj["structure"]
            schema.structure(structure, at)
        elif kind == "order":
            order = schema.order(obj["order"], at)
        else:
            if version < OPAQUE_VERSION:
                raise at.fail("opaque", f"an opaque line needs metadata version {OPAQUE_VERSION}")
            opaque = BlobRef(*schema.opaque(obj["opaque"], at))
        if len(groups) + len(aliases) > schema.MAX_GROUPS:
            raise at.fail(None, f"more than {schema.MAX_GROUPS} groups and aliases")
    if fmt is None or order is None:
        raise where.fail(None, "metadata lacks its 'checkpoint' or 'order' line (truncated?)")
    meta = CheckpointMeta(format=fmt, order=order, groups=groups, structure=structure, aliases=aliases,
                          metadata=file_meta, lsh=lsh, version=version, opaque=opaque)
    meta.validate(file)
    return meta
