"""The container tree of a checkpoint, as plain JSON/msgpack-able data.

A torch checkpoint is a pickled tree (dicts, OrderedDicts with ``_metadata``, lists, tuples) whose
leaves are tensors and plain values. zipslice keeps that tree so a writer (or theta's smudge) can
rebuild the same object, with tensors replaced by references to flattened names. Node forms:

    {"dict":  [[key, node], ...]}                 key: str | int | float | bool | None
    {"odict": [[key, node], ...], "metadata": node}   collections.OrderedDict; "metadata" only when
                                                  the object had a ``_metadata`` attribute
    {"list":  [node, ...]}
    {"tuple": [node, ...]}
    {"tensor": "flat/name"}                        a tensor (nn.Parameter is recorded in TensorInfo)
    {"value": None | bool | int | str}             plain scalar
    {"float": "0x1.8p+1"}                          float, exact, via float.hex (inf/nan included)
    {"bytes": "base64..."}
    {"torch": "dtype" | "size" | "device", "value": ...}   small torch objects seen in checkpoints

Flattened names join keys with "/" (``model/encoder.layer.0.weight``); list and tuple items use
their index. Flat formats (safetensors, HDF5) have ``structure = None``: a flat dict of tensors.
"""
from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Any, Callable, Iterator

from . import optional

Node = dict


def join(prefix: str, key: Any) -> str:
    key = str(key)
    return key if not prefix else f"{prefix}/{key}"


def walk_leaves(node: Node, prefix: str = "") -> Iterator[tuple[str, Node]]:
    """Every leaf node with its flattened name, in order."""
    if "dict" in node or "odict" in node:
        for key, child in node.get("dict", node.get("odict")):
            yield from walk_leaves(child, join(prefix, key))
    elif "list" in node or "tuple" in node:
        for i, child in enumerate(node.get("list", node.get("tuple"))):
            yield from walk_leaves(child, join(prefix, i))
    else:
        yield prefix, node


def tensor_names(node: Node) -> list[str]:
    return [leaf["tensor"] for _, leaf in walk_leaves(node) if "tensor" in leaf]


def leaf_value(node: Node) -> Any:
    """The Python value of a non-tensor leaf."""
    if "value" in node and "torch" not in node:
        return node["value"]
    if "float" in node:
        return float.fromhex(node["float"])
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    if "torch" in node:
        kind, v = node["torch"], node["value"]
        torch = optional.require("torch", f"the checkpoint holds a torch.{kind} value",
                                 "lsd.extras holds it as its structure node")
        if kind == "dtype":
            return getattr(torch, v)
        if kind == "size":
            return torch.Size(v)
        if kind == "device":
            return torch.device(v)
    raise ValueError(f"not a value leaf: {node!r}")


def value_node(v: Any) -> Node:
    """The leaf node for a plain Python value (the inverse of :func:`leaf_value`)."""
    if v is None or isinstance(v, (bool, int, str)):
        return {"value": v}
    if isinstance(v, float):
        return {"float": v.hex()}
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(v)).decode()}
    raise TypeError(f"no structure node for {type(v).__name__}")


def build(node: Node, tensor: Callable[[str], Any]) -> Any:
    """Rebuild the Python object, calling ``tensor(name)`` for each tensor leaf."""
    if "dict" in node:
        return {k: build(v, tensor) for k, v in node["dict"]}
    if "odict" in node:
        out = OrderedDict((k, build(v, tensor)) for k, v in node["odict"])
        if "metadata" in node:
            out._metadata = build(node["metadata"], tensor)  # type: ignore[attr-defined]
        return out
    if "list" in node:
        return [build(v, tensor) for v in node["list"]]
    if "tuple" in node:
        return tuple(build(v, tensor) for v in node["tuple"])
    if "tensor" in node:
        return tensor(node["tensor"])
    return leaf_value(node)


def flat(names: list[str]) -> Node:
    """The structure of a flat dict of tensors (what safetensors and HDF5 hold)."""
    return {"dict": [[n, {"tensor": n}] for n in names]}
