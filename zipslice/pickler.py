"""A minimal pickle *writer* for torch's ``data.pkl``, working from a :mod:`zipslice.structure` tree.

It emits protocol-2 opcodes the way ``torch.save`` does, without importing torch: containers, plain
values, a few torch objects (dtype, Size, device) and tensors as ``_rebuild_tensor_v2`` (legacy storage
classes) or ``_rebuild_tensor_v3`` (``UntypedStorage`` + dtype, for dtypes without a legacy class), wrapped
in ``_rebuild_parameter`` for parameters. Storages are persistent ids
``("storage", <storage type>, key, "cpu", numel)``, so tensors naming the same key share one storage.
Only globals that ``torch.load(weights_only=True)`` accepts are ever written.
"""
from __future__ import annotations

import base64
import io
import struct
from dataclasses import dataclass
from typing import Any, Callable

from . import dtypes

# protocol-2 opcodes used here
PROTO, STOP = b"\x80", b"."
MARK, TUPLE, EMPTY_TUPLE, TUPLE1, TUPLE2, TUPLE3 = b"(", b"t", b")", b"\x85", b"\x86", b"\x87"
EMPTY_LIST, APPENDS, EMPTY_DICT, SETITEMS, BUILD = b"]", b"e", b"}", b"u", b"b"
NONE, NEWTRUE, NEWFALSE = b"N", b"\x88", b"\x89"
BININT1, BININT2, BININT, LONG1, LONG4, BINFLOAT = b"K", b"M", b"J", b"\x8a", b"\x8b", b"G"
BINUNICODE, GLOBAL, REDUCE, BINPERSID = b"X", b"c", b"R", b"Q"
BINPUT, LONG_BINPUT, BINGET, LONG_BINGET = b"q", b"r", b"h", b"j"

# objects inside a tuple/list/dict are written between MARK and the closing opcode in batches,
# like pickle does, so the unpickler's stack never holds an unbounded number of items at once
_BATCH = 1000


@dataclass(frozen=True)
class TensorRef:
    """How one tensor leaf is rebuilt: a view over a storage record named ``storage_key``."""

    storage_key: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_nbytes: int
    is_parameter: bool = False
    requires_grad: bool = False


class PickleWriter:
    """Serialises one object tree; memoises globals and repeated strings (as torch's pickler does)."""

    def __init__(self, tensor: Callable[[str], TensorRef]):
        self._tensor = tensor
        self._out = io.BytesIO()
        self._memo: dict[tuple, int] = {}

    # -- low level ---------------------------------------------------------------------------------
    def _w(self, b: bytes) -> None:
        self._out.write(b)

    def _put(self, key: tuple) -> None:
        idx = self._memo[key] = len(self._memo)
        self._w(BINPUT + bytes([idx]) if idx < 256 else LONG_BINPUT + struct.pack("<I", idx))

    def _get(self, key: tuple) -> bool:
        idx = self._memo.get(key)
        if idx is None:
            return False
        self._w(BINGET + bytes([idx]) if idx < 256 else LONG_BINGET + struct.pack("<I", idx))
        return True

    def global_(self, module: str, name: str) -> None:
        key = ("global", module, name)
        if not self._get(key):
            self._w(GLOBAL + f"{module}\n{name}\n".encode("ascii"))
            self._put(key)

    def str_(self, s: str) -> None:
        key = ("str", s)
        if not self._get(key):
            b = s.encode("utf-8", "surrogatepass")
            self._w(BINUNICODE + struct.pack("<I", len(b)) + b)
            self._put(key)

    def int_(self, v: int) -> None:
        if 0 <= v < 256:
            self._w(BININT1 + bytes([v]))
        elif 0 <= v < 65536:
            self._w(BININT2 + struct.pack("<H", v))
        elif -(2 ** 31) <= v < 2 ** 31:
            self._w(BININT + struct.pack("<i", v))
        else:
            n = (v.bit_length() >> 3) + 1  # two's complement, room for the sign bit
            b = v.to_bytes(n, "little", signed=True)
            self._w((LONG1 + bytes([n]) if n < 256 else LONG4 + struct.pack("<i", n)) + b)

    def float_(self, v: float) -> None:
        self._w(BINFLOAT + struct.pack(">d", v))

    def value(self, v: Any) -> None:
        if v is None:
            self._w(NONE)
        elif v is True:
            self._w(NEWTRUE)
        elif v is False:
            self._w(NEWFALSE)
        elif isinstance(v, int):
            self.int_(v)
        elif isinstance(v, float):
            self.float_(v)
        elif isinstance(v, str):
            self.str_(v)
        elif isinstance(v, (bytes, bytearray)):
            # protocol 2 has no bytes opcode: torch (and pickle) write _codecs.encode(latin1 text, "latin1")
            self.global_("_codecs", "encode")
            self.str_(bytes(v).decode("latin1"))
            self.str_("latin1")
            self._w(TUPLE2 + REDUCE)
        elif isinstance(v, tuple):
            self.tuple_(list(v), self.value)
        else:
            raise TypeError(f"cannot pickle a {type(v).__name__} into data.pkl")

    def tuple_(self, items: list, emit: Callable[[Any], None]) -> None:
        if not items:
            self._w(EMPTY_TUPLE)
            return
        if len(items) <= 3:
            for it in items:
                emit(it)
            self._w((TUPLE1, TUPLE2, TUPLE3)[len(items) - 1])
            return
        self._w(MARK)
        for it in items:
            emit(it)
        self._w(TUPLE)

    def _items(self, pairs: list, closing: bytes, emit_one: Callable[[Any], None]) -> None:
        for start in range(0, len(pairs), _BATCH):
            self._w(MARK)
            for p in pairs[start:start + _BATCH]:
                emit_one(p)
            self._w(closing)

    # -- torch objects -----------------------------------------------------------------------------
    def tensor(self, ref: TensorRef) -> None:
        dt = dtypes.get(ref.dtype)
        if ref.is_parameter:
            self.global_("torch._utils", "_rebuild_parameter")
        legacy = dt.storage is not None
        self.global_("torch._utils", "_rebuild_tensor_v2" if legacy else "_rebuild_tensor_v3")
        self._w(MARK)
        # persistent id: typed storages count elements, UntypedStorage counts bytes
        self._w(MARK)
        self.str_("storage")
        if legacy:
            self.global_("torch", dt.storage)
        else:
            self.global_("torch.storage", "UntypedStorage")
        self.str_(ref.storage_key)
        self.str_("cpu")
        self.int_(ref.storage_nbytes // dt.itemsize if legacy else ref.storage_nbytes)
        self._w(TUPLE + BINPERSID)
        self.int_(ref.storage_offset)
        self.tuple_(list(ref.shape), self.int_)
        self.tuple_(list(ref.stride), self.int_)
        # requires_grad of the inner tensor: a parameter carries it in _rebuild_parameter instead
        self._w(NEWFALSE if ref.is_parameter or not ref.requires_grad else NEWTRUE)
        self._ordered_dict_empty()  # backward hooks
        if not legacy:
            self.global_("torch", ref.dtype)
        self._w(TUPLE + REDUCE)
        if ref.is_parameter:
            self._w(NEWTRUE if ref.requires_grad else NEWFALSE)
            self._ordered_dict_empty()
            self._w(TUPLE3 + REDUCE)

    def _ordered_dict_empty(self) -> None:
        self.global_("collections", "OrderedDict")
        self._w(EMPTY_TUPLE + REDUCE)

    # -- structure nodes ---------------------------------------------------------------------------
    def node(self, node: dict) -> None:
        if "dict" in node or "odict" in node:
            odict = "odict" in node
            if odict:
                self._ordered_dict_empty()
            else:
                self._w(EMPTY_DICT)
            pairs = node["odict" if odict else "dict"]
            self._items(pairs, SETITEMS, lambda kv: (self.value(kv[0]), self.node(kv[1])))
            if odict and "metadata" in node:
                # BUILD with a dict state sets attributes: this is how OrderedDict._metadata is pickled
                self._w(EMPTY_DICT)
                self.str_("_metadata")
                self.node(node["metadata"])
                self._w(b"s" + BUILD)  # SETITEM, BUILD
        elif "list" in node:
            self._w(EMPTY_LIST)
            if node["list"]:
                self._items(node["list"], APPENDS, self.node)
        elif "tuple" in node:
            self.tuple_(node["tuple"], self.node)
        elif "tensor" in node:
            self.tensor(self._tensor(node["tensor"]))
        elif "value" in node and "torch" not in node:
            self.value(node["value"])
        elif "float" in node:
            self.float_(float.fromhex(node["float"]))
        elif "bytes" in node:
            self.value(base64.b64decode(node["bytes"]))
        elif "torch" in node:
            kind, v = node["torch"], node["value"]
            if kind == "dtype":
                dtypes.get(v)  # refuse names torch would not know
                self.global_("torch", v)
            elif kind == "size":
                self.global_("torch", "Size")
                self.tuple_(list(v), self.int_)
                self._w(TUPLE1 + REDUCE)
            elif kind == "device":
                self.global_("torch", "device")
                self.str_(str(v))
                self._w(TUPLE1 + REDUCE)
            else:
                raise TypeError(f"unknown torch leaf kind {kind!r}")
        else:
            raise TypeError(f"not a structure node: {node!r}")

    def dumps(self, root: dict) -> bytes:
        self._w(PROTO + b"\x02")
        self.node(root)
        self._w(STOP)
        return self._out.getvalue()


def dumps(root: dict, tensor: Callable[[str], TensorRef]) -> bytes:
    """``data.pkl`` bytes for the structure tree ``root``; ``tensor(name)`` describes each tensor leaf."""
    return PickleWriter(tensor).dumps(root)
