"""The metadata text git stores for a checkpoint: what to rebuild it from, one parameter group per line.

Format (version 1), UTF-8, one JSON value per line, keys sorted, no spaces::

    theta-metadata 1
    # git-theta: ... (HINT: one line for a person who meets this text without theta; readers skip it)
    {"checkpoint":{"format":"torch","lsh":{...},"metadata":{...}}}
    {"structure":{...}}                      zipslice structure tree (or null for flat formats)
    {"order":["a","b",...]}                  tensor names in file order (groups and aliases)
    {"alias":"b","grad":false,"of":"a","param":true}         one line per tied alias, sorted by name
    {"dtype":"float32","grad":false,"group":"a","hash":"<sha256>","lsh":[...],"param":true,"shape":[2,3],
     "steps":[{"hash":"<sha256>","oid":"<sha256>","params":{},"size":123,"type":"dense"}]}
                                             one line per group, sorted by name

The text depends only on content: the same checkpoint always gives the same bytes, so `git status` stays
clean after a checkout, and a change to one group changes one line.

Lines starting with ``#`` are comments: readers skip them (they cost one byte comparison each), so text
written before the hint existed reads the same, and :func:`same_content` treats two texts that differ only
in comments as equal (the filter keeps the committed bytes then, so upgrading theta dirties nothing).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from theta.errors import MetadataError
from theta.storage.store import BlobRef

MAGIC = "theta-metadata"
VERSION = 1
FIRST_LINE = f"{MAGIC} {VERSION}"
MAX_METADATA_BYTES = 256 << 20  # git blobs larger than this are never read as metadata
# The second line: what this file is and how to get the model, for a collaborator without theta (a clone
# without it leaves this text where the checkpoint should be). Fixed text: the same for every file, stable.
HINT = ("# git-theta: this file stands for a model checkpoint whose tensors are stored in Git LFS; to get "
        "the model: pip install zipslice-theta && git theta install && git theta pull")


@dataclass(frozen=True)
class Step:
    """One link of a group's update chain.

    ``type`` names the update type (entry point in ``theta.updates``), ``blob`` its stored parts,
    ``params`` small JSON-able values, ``hash`` the sha256 of the group's bytes after this step.
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


@dataclass
class GroupMeta:
    """One parameter group (tensor): its identity and how to rebuild its value.

    ``hash`` is the sha256 of the contiguous little-endian bytes of the value; ``lsh`` the E2LSH signature
    (None for int/bool groups, which are compared exactly); ``steps[0]`` is self-contained and each later step
    applies to the value the steps before it produce.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str
    steps: list[Step]
    lsh: list[int] | None = None
    is_parameter: bool = False
    requires_grad: bool = False

    def to_json(self) -> dict:
        return {"group": self.name, "dtype": self.dtype, "shape": list(self.shape), "hash": self.hash,
                "lsh": self.lsh, "param": self.is_parameter, "grad": self.requires_grad,
                "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, d: dict) -> "GroupMeta":
        return cls(name=d["group"], dtype=d["dtype"], shape=tuple(int(s) for s in d["shape"]), hash=d["hash"],
                   steps=[Step.from_json(s) for s in d["steps"]], lsh=d.get("lsh"),
                   is_parameter=bool(d.get("param", False)), requires_grad=bool(d.get("grad", False)))

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

    def blob_refs(self) -> list[BlobRef]:
        """Every blob needed to rebuild the file, each once, in group order."""
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

    def validate(self) -> None:
        names = set(self.groups) | set(self.aliases)
        if len(self.order) != len(set(self.order)) or set(self.order) != names:
            raise MetadataError("metadata 'order' does not list each group and alias exactly once")
        for a in self.aliases.values():
            if a.of not in self.groups:
                raise MetadataError(f"alias {a.name!r} refers to unknown group {a.of!r}")
        for g in self.groups.values():
            if not g.steps:
                raise MetadataError(f"group {g.name!r} has no steps")


def _line(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def dumps(meta: CheckpointMeta) -> str:
    """The deterministic text of ``meta`` (ends with a newline)."""
    lines = [FIRST_LINE, HINT,
             _line({"checkpoint": {"format": meta.format, "metadata": dict(meta.metadata or {}), "lsh": meta.lsh}}),
             _line({"structure": meta.structure}),
             _line({"order": list(meta.order)})]
    lines += [_line(meta.aliases[n].to_json()) for n in sorted(meta.aliases)]
    lines += [_line(meta.groups[n].to_json()) for n in sorted(meta.groups)]
    return "\n".join(lines) + "\n"


def is_metadata(data: "str | bytes | bytearray | memoryview") -> bool:
    """True when ``data`` (or its first bytes) is a theta metadata text rather than a checkpoint."""
    head = data[: len(MAGIC) + 1]
    if not isinstance(head, str):
        head = bytes(head).decode("latin-1")
    return head == MAGIC + " "


def same_content(a: "str | bytes", b: "str | bytes") -> bool:
    """True when two metadata texts differ at most in comment lines (e.g. one predates :data:`HINT`)."""
    def strip(t):
        t = t.encode("utf-8") if isinstance(t, str) else bytes(t)
        return [line for line in t.split(b"\n") if not line.startswith(b"#")]
    return strip(a) == strip(b)


def loads(text: "str | bytes") -> CheckpointMeta:
    """Parse a metadata text; a clear MetadataError (with the line number) on anything unexpected."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MetadataError(f"metadata is not UTF-8 text: {e}") from None
    lines = text.split("\n")
    if not lines or not lines[0].startswith(MAGIC + " "):
        raise MetadataError(f"not theta metadata: first line is {lines[0][:60]!r}, expected {FIRST_LINE!r}")
    try:
        version = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise MetadataError(f"bad metadata version line {lines[0][:60]!r}") from None
    if version != VERSION:
        raise MetadataError(f"metadata version {version} is not supported (this theta reads {VERSION}); upgrade theta")
    fmt = None
    file_meta: dict = {}
    lsh: dict = {}
    structure = None
    order: list[str] | None = None
    groups: dict[str, GroupMeta] = {}
    aliases: dict[str, Alias] = {}
    for no, line in enumerate(lines[1:], start=2):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            if "group" in obj:
                g = GroupMeta.from_json(obj)
                if g.name in groups:
                    raise ValueError(f"group {g.name!r} appears twice")
                groups[g.name] = g
            elif "alias" in obj:
                a = Alias.from_json(obj)
                aliases[a.name] = a
            elif "checkpoint" in obj:
                c = obj["checkpoint"]
                fmt, file_meta, lsh = c["format"], dict(c.get("metadata") or {}), dict(c.get("lsh") or {})
            elif "structure" in obj:
                structure = obj["structure"]
            elif "order" in obj:
                order = list(obj["order"])
            else:
                raise ValueError(f"unknown line kind {sorted(obj)[:3]}")
        except (ValueError, KeyError, TypeError) as e:
            raise MetadataError(f"metadata line {no}: {e}: {line[:80]!r}") from None
    if fmt is None or order is None:
        raise MetadataError("metadata lacks its 'checkpoint' or 'order' line (truncated?)")
    meta = CheckpointMeta(format=fmt, order=order, groups=groups, structure=structure, aliases=aliases,
                          metadata=file_meta, lsh=lsh, version=version)
    meta.validate()
    return meta
