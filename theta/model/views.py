"""A checkpoint checked out in another format than the committed one is a *view* of the committed checkpoint.

Like ``core.autocrlf``: the repository keeps what was committed (format, structure, names, order, file
metadata, tied weights); the work tree holds the same tensors in the format asked for at checkout (attribute
``theta-format``, ``git config theta.checkoutFormat``). Two pure functions over metadata do the conversion,
so every path that writes or reads a work-tree file (the filter, ``git theta checkout`` materialising a
placeholder, ``git theta export``) converts the same way:

- :func:`view_of` (checkout): how ``meta`` is written as a format -- which writer, which structure and file
  metadata -- after checking that every group fits that format;
- :func:`as_committed` (add): the metadata of a cleaned view re-expressed in the committed format. The
  committed structure, names, order, file metadata and ties are kept; only group values come from the view,
  plus tensors the view added or removed. Whatever the committed format cannot hold raises
  :class:`~theta.base.errors.ViewError` naming the group, before anything is staged.

:func:`clean_as_committed` is the clean side in one call: clean the work-tree file (reusing the committed
groups by name), then :func:`as_committed` against the committed metadata -- or, for an explicit change of
the committed format (``git theta add --format F``), against an empty checkpoint of format ``F``.

The committed metadata must come out exactly as a clean of the committed-format file would give it, so that
`git status` stays clean whichever format the file is checked out in. Hence the order rules below mirror what
each format's reader lists after its writer wrote the file (torch: the structure's order; safetensors: the
library's dtype-then-name order; HDF5: creation order within each group).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import zipslice
from zipslice import TensorSource, dtypes, formats
from zipslice import structure as st
from zipslice.errors import ZipsliceError
from zipslice.hdf5_format import HDF5Checkpoint, name_problem
from zipslice.safetensors_format import METADATA_KEY, library_order

from theta.base.errors import ViewError
from theta.model.clean import clean_checkpoint
from theta.storage.metadata import Alias, CheckpointMeta, GroupMeta

# formats zipslice reads but does not write: a pre-1.6 torch file is checked out as a torch zip file
WRITES_AS = {"torch-legacy": "torch"}


def written_as(fmt: str) -> str:
    """The format a checkpoint recorded as ``fmt`` is written in."""
    return WRITES_AS.get(fmt, fmt)


# -- checkout: the view of a committed checkpoint ----------------------------------------------------------

@dataclass(frozen=True)
class View:
    """What a writer needs to write a checkpoint as ``format``: the container tree (torch only; None is a flat
    dict of the tensors in order) and the file's string metadata."""

    format: str
    structure: dict | None
    metadata: dict[str, str]


def view_of(meta: CheckpointMeta, fmt: str | None = None, file: str = "") -> View:
    """How to write ``meta`` as ``fmt`` (default: its committed format).

    Raises ViewError (naming ``file`` and the group) when ``fmt`` cannot hold a group: a dtype it lacks, a
    name it cannot spell. The committed format itself is never refused here (its writer decides).
    """
    target = written_as(fmt or meta.format)
    if fmt is not None and fmt not in formats.one_file_writable() and fmt not in WRITES_AS:
        raise ViewError(f"{_at(file)}cannot check out as {fmt!r}; formats: {', '.join(formats.one_file_writable())}")
    if target != written_as(meta.format):
        problem = format_problem(target, [(n, meta.group_for(n).dtype) for n in meta.order])
        if problem is not None:
            name, why = problem
            raise ViewError(f"{_at(file)}cannot check out as {target}: group {name!r}: {why}; "
                            f"check it out in its committed format ({meta.format})")
    structure = meta.structure if target == "torch" and written_as(meta.format) == "torch" else None
    return View(format=target, structure=structure, metadata=dict(meta.metadata or {}))


def format_problem(fmt: str, tensors: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
    """(name, problem) for the first tensor (name, dtype) that format ``fmt`` cannot hold, else None."""
    tensors = list(tensors)
    if fmt == "safetensors":
        for name, dtype in tensors:
            if dtypes.get(dtype).safetensors is None:
                return name, f"safetensors has no dtype {dtype}"
            if name == METADATA_KEY:
                return name, f"safetensors reserves the name {METADATA_KEY} for the file's metadata"
    elif fmt == "hdf5":
        return name_problem(name for name, _ in tensors)
    return None


# -- add: a view recorded in the committed format ---------------------------------------------------------

def as_committed(view: CheckpointMeta, committed: CheckpointMeta, file: str = "") -> CheckpointMeta:
    """The metadata of the checkpoint ``view`` describes, recorded in ``committed``'s format and layout.

    Tensors are matched by name. A tensor of both keeps its committed group when its value is the same
    (dtype, shape and content hash), else takes the view's value with the committed Parameter flags. Tied
    names of the committed file stay tied while the view holds equal values for them (or omits all but one
    of them); a member with another value is untied (the view shows independent tensors). A tensor only in
    the view is added where the committed format can put it; a tensor missing from the view is removed.
    File metadata, structure (non-tensor values included) and order are the committed ones, edited only for
    added/removed tensors. Raises ViewError naming ``file`` and the group for what the committed format
    cannot hold.
    """
    fmt = written_as(committed.format)
    if fmt != "torch":
        _refuse_values(view, fmt, file)
    in_view = set(view.order)
    committed_names = set(committed.order)
    groups: dict[str, GroupMeta] = {}
    aliases: dict[str, Alias] = {}

    kept: list[str] = []
    for names in _tie_sets(committed):
        present = [n for n in names if n in in_view]
        if not present:
            continue  # every name of this group was removed in the view
        # A view may omit a tied duplicate (safetensors' save_model keeps one name of each tie): the missing
        # names keep the value of the first one present.
        implied = view.group_for(present[0])
        values = {n: view.group_for(n) if n in in_view else implied for n in names}
        owner = names[0]  # the first name in file order owns the storage, as a reader of the file sees it
        groups[owner] = _group(owner, values[owner], committed.group_for(owner), *_flags(committed, owner))
        for n in names[1:]:
            if _same_value(values[n], values[owner]):
                aliases[n] = Alias(n, owner, *_flags(committed, n))
            else:
                groups[n] = _group(n, values[n], committed.group_for(n), *_flags(committed, n))
        kept += names

    added = [n for n in view.order if n not in committed_names]
    for n in added:
        flags = _flags(view, n) if fmt == "torch" else (False, False)
        groups[n] = _group(n, view.group_for(n), None, *flags)

    kept_set = set(kept)
    kept = [n for n in committed.order if n in kept_set]

    def dtype_of(n: str) -> str:
        return (groups[n] if n in groups else groups[aliases[n].of]).dtype

    problem = format_problem(fmt, [(n, dtype_of(n)) for n in kept + added])
    if problem is not None:
        name, why = problem
        raise ViewError(f"{_at(file)}group {name!r} cannot be recorded in {committed.format}, the format the file "
                        f"is recorded in: {why}; nothing was staged (to change the recorded format: "
                        f"git theta add --format FORMAT {file or 'PATH'})")

    structure = committed.structure
    if fmt == "torch":
        removed = [n for n in committed.order if n not in groups and n not in aliases]
        base = committed.structure if committed.structure is not None else st.flat(committed.order)
        try:
            structure = _edit_torch_structure(base, removed, added, file)
            order = st.tensor_names(structure)
        except (TypeError, KeyError, ValueError, IndexError, AttributeError, RecursionError) as e:
            # the structure comes from metadata text in git, which nothing but our own writer vouches for
            raise ViewError(f"{_at(file)}the committed torch structure is malformed "
                            f"({type(e).__name__}: {e}); nothing was staged") from None
    elif fmt == "safetensors":
        was_library = committed.order == _library_order(committed.order, lambda n: committed.group_for(n).dtype)
        order = _library_order(kept + added, dtype_of) if was_library else kept + added
    elif fmt == "hdf5" and _hdf5_order(committed.order) == committed.order:
        order = _hdf5_order(kept + added)
    else:  # a file whose reader order we cannot predict (a plugin format, a Keras-named HDF5 file)
        order = kept + added

    meta = CheckpointMeta(format=committed.format, order=order, groups=groups, structure=structure,
                          aliases=aliases, metadata=dict(committed.metadata or {}), lsh=dict(view.lsh))
    meta.validate()
    return meta


def empty_checkpoint(fmt: str, metadata: dict[str, str] | None = None) -> CheckpointMeta:
    """A checkpoint of format ``fmt`` with no tensor: what :func:`as_committed` fills for a format change."""
    if fmt not in formats.one_file_writable():
        raise ViewError(f"unknown format {fmt!r}; formats: {', '.join(formats.one_file_writable())}")
    return CheckpointMeta(format=fmt, order=[], groups={}, structure={"dict": []} if fmt == "torch" else None,
                          metadata=dict(metadata or {}))


def committed_form(view: CheckpointMeta, committed: CheckpointMeta | None, fmt: str | None = None,
                   file: str = "") -> CheckpointMeta:
    """What to record for a work-tree file cleaned as ``view``: the rule of the whole module in one place.

    - no committed version and no ``fmt``: the file as it is (a new file keeps its own format);
    - ``fmt`` given and not the committed format: an explicit change of the committed format;
    - otherwise the committed format (a file in another format is a view of it).
    """
    if fmt is not None and fmt not in formats.one_file_writable():
        raise ViewError(f"{_at(file)}cannot record as {fmt!r}; formats: {', '.join(formats.one_file_writable())}")
    if committed is not None and (fmt is None or committed.format == fmt):
        template = committed
    elif fmt is not None:
        template = empty_checkpoint(fmt, view.metadata)
    else:
        return view
    if view.format == template.format:
        return view
    return as_committed(view, template, file)


def clean_as_committed(path: str | os.PathLike, store, committed: CheckpointMeta | None, options=None,
                       fmt: str | None = None, *, stats=None, name: str | None = None, stop=None,
                       git_bytes=None) -> CheckpointMeta:
    """Clean the work-tree file at ``path`` and record it in the committed format (see :func:`committed_form`).

    ``committed`` is the metadata in the index (else HEAD) and doubles as the previous version that unchanged
    groups are reused from; ``fmt`` an explicitly requested committed format; ``name`` names the file in
    errors (default: ``path``); ``stop`` and ``git_bytes`` as for :func:`theta.model.clean.clean_checkpoint`.
    """
    path = os.fspath(path)
    opener = _view_opener(path, committed, fmt)
    view = clean_checkpoint(path, store, committed, options, stats=stats, opener=opener, stop=stop,
                            git_bytes=git_bytes)
    return committed_form(view, committed, fmt, name or path)


def _view_opener(path: str, committed: CheckpointMeta | None, fmt: str | None) -> Callable | None:
    """An HDF5 view is read by its plain paths: they are the names the view was written with (the Keras
    renaming of a committed HDF5 file must not rename a view's tensors)."""
    target = fmt or (committed.format if committed is not None else None)
    if target is None or written_as(target) == "hdf5":
        return None

    try:
        if zipslice.sniff(path) != "hdf5":
            return None
    except (ZipsliceError, OSError):
        return None  # clean_checkpoint reports it

    return lambda p: HDF5Checkpoint(p, keras_names=False)


# -- helpers -----------------------------------------------------------------------------------------------

def _at(file: str) -> str:
    """The file-name prefix of a message ("" when the caller has no name)."""
    return f"{file}: " if file else ""


def _tie_sets(meta: CheckpointMeta) -> list[list[str]]:
    """The names of each group (the group and its aliases), in file order, groups in order of first name."""
    sets: dict[str, list[str]] = {}
    for n in meta.order:
        sets.setdefault(meta.group_for(n).name, []).append(n)
    return list(sets.values())


def _flags(meta: CheckpointMeta, name: str) -> tuple[bool, bool]:
    """(is_parameter, requires_grad) of tensor ``name`` in ``meta``."""
    entry = meta.aliases.get(name) or meta.groups[name]
    return entry.is_parameter, entry.requires_grad


def _same_value(a: GroupMeta, b: GroupMeta) -> bool:
    return a.hash == b.hash and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)


def _group(name: str, value: GroupMeta, committed: GroupMeta | None, is_parameter: bool,
           requires_grad: bool) -> GroupMeta:
    """Group ``name`` holding ``value``; the committed group's steps when the value did not change."""
    src = committed if committed is not None and _same_value(committed, value) else value
    # every field of the value's record (its steps, signature, norms...), under this name and these flags
    return replace(src, name=name, shape=tuple(src.shape), steps=list(src.steps), is_parameter=is_parameter,
                   requires_grad=requires_grad)


def _refuse_values(view: CheckpointMeta, fmt: str, file: str) -> None:
    """A flat format holds tensors only: a non-tensor value of a torch view cannot be recorded."""
    if view.structure is None:
        return
    for name, leaf in st.walk_leaves(view.structure):
        if "tensor" not in leaf:
            raise ViewError(f"{_at(file)}{name!r} is a non-tensor value ({_describe(leaf)}) and {fmt}, the committed "
                            f"format, holds only tensors; remove it from the file, nothing was staged")


def _describe(leaf: dict) -> str:
    if "torch" in leaf:
        return f"torch.{leaf['torch']}"
    if "value" in leaf:
        return type(leaf["value"]).__name__
    return next(iter(leaf), "?")


def _library_order(names: list[str], dtype_of: Callable[[str], str]) -> list[str]:
    """The order the safetensors library (and zipslice's writer) stores ``names`` in."""
    try:
        srcs = library_order(TensorSource(name=n, dtype=dtype_of(n), shape=(), read=None) for n in names)
    except ZipsliceError:  # a dtype safetensors lacks: format_problem reports it; keep the given order
        return list(names)
    return [s.name for s in srcs]


def _hdf5_order(names: list[str]) -> list[str]:
    """The order an HDF5 reader lists ``names`` in once written in this order: creation order within each
    group, a group's datasets where the group was first created."""
    tree: dict = {}
    for n in names:
        *parents, leaf = n.split("/")
        node = tree
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):  # a tensor and a group of the same name: name_problem's to report
                return list(names)
            node = child
        node[leaf] = n
    out: list[str] = []

    def walk(node: dict) -> None:
        for v in node.values():
            walk(v) if isinstance(v, dict) else out.append(v)
    walk(tree)
    return out


def _edit_torch_structure(structure: dict, removed: list[str], added: list[str], file: str) -> dict:
    """The committed torch structure without the ``removed`` tensors and with the ``added`` ones.

    A tensor is removed from the dict holding it; a new one is added to the deepest dict whose flattened
    name prefixes its name, under the rest of the name as key (``model/new.bias`` goes into the dict
    ``model`` as ``new.bias``). Lists and tuples keep their length: adding or removing an item is refused.
    """
    tree = copy.deepcopy(structure)
    nodes = _nodes(tree)
    if sorted(st.tensor_names(tree)) != sorted(n for n, (node, _) in nodes.items() if "tensor" in node):
        raise ValueError("tensor leaves do not carry their flattened names")
    for n in removed:
        if n not in nodes:
            raise ViewError(f"{_at(file)}the committed metadata lists tensor {n!r} but its structure does not")
        leaf, parent = nodes[n]
        if parent is None or ("dict" not in parent and "odict" not in parent):
            kind = "the top level" if parent is None else f"a {_kind(parent)}"
            raise ViewError(f"{_at(file)}tensor {n!r} was removed in the work tree but sits in {kind} of the "
                            f"committed torch file, which cannot lose an item; nothing was staged")
        entries = parent.get("dict", parent.get("odict"))
        entries[:] = [e for e in entries if e[1] is not leaf]
    for n in added:
        if n in nodes:
            raise ViewError(f"{_at(file)}new tensor {n!r} has the name of a {_kind(nodes[n][0])} in the committed "
                            f"torch file; nothing was staged")
        parts = n.split("/")
        for i in range(len(parts) - 1, -1, -1):
            prefix = "/".join(parts[:i])
            if prefix in nodes:
                break
        holder = nodes[prefix][0]
        if "dict" not in holder and "odict" not in holder:
            where = f"{prefix!r}" if prefix else "the top level"
            raise ViewError(f"{_at(file)}new tensor {n!r} would go into {where}, a {_kind(holder)} in the committed "
                            f"torch file, which cannot take a new named item; nothing was staged")
        leaf = {"tensor": n}
        holder.get("dict", holder.get("odict")).append(["/".join(parts[i:]), leaf])
        nodes[n] = (leaf, holder)
    return tree


def _kind(node: dict) -> str:
    for k in ("dict", "odict", "list", "tuple", "tensor"):
        if k in node:
            return {"odict": "OrderedDict", "tensor": "tensor"}.get(k, k)
    return "value"


def _nodes(tree: dict) -> dict[str, tuple[dict, dict | None]]:
    """Every node of a structure by flattened name: (node, the container holding it; None for the root)."""
    out: dict[str, tuple[dict, dict | None]] = {"": (tree, None)}

    def walk(node: dict, prefix: str) -> None:
        if not isinstance(node, dict):
            raise TypeError(f"node {prefix!r} is a {type(node).__name__}, not an object")
        if "dict" in node or "odict" in node:
            for entry in node.get("dict", node.get("odict")):
                name = st.join(prefix, entry[0])
                out.setdefault(name, (entry[1], node))
                walk(entry[1], name)
        elif "list" in node or "tuple" in node:
            for i, child in enumerate(node.get("list", node.get("tuple"))):
                name = st.join(prefix, i)
                out.setdefault(name, (child, node))
                walk(child, name)
    walk(tree, "")
    return out
