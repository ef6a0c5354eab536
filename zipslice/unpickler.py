"""A restricted pickle machine for torch checkpoints.

It interprets pickle opcodes (protocols 0-5) itself; it never calls ``pickle.load`` on file bytes, never
imports a module named by the file and never calls anything but the handlers in :data:`TORCH_ALLOWLIST`,
which build small descriptive objects (:class:`StorageRef`, :class:`TensorRef`, ...) instead of tensors.
Any other global is refused with :class:`UnsafeCheckpointError` naming ``module.name``.

Memory is bounded by the pickle's own size: every length is checked against the bytes that remain
before anything is allocated, and no allowlisted handler can amplify its input.
"""
from __future__ import annotations

import codecs
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from . import dtypes
from .errors import (CorruptCheckpointError, NeedMoreData, PickleFault, PickleUnsupported,  # noqa: F401
                     UnsafeCheckpointError, UnsupportedCheckpointError)


# -- the objects the allowlisted handlers build ------------------------------------------------------

@dataclass(frozen=True)
class StorageType:
    """``torch.FloatStorage`` & co (typed, with a dtype) or ``torch.UntypedStorage`` (bytes)."""

    name: str
    dtype: str  # canonical dtype name; "uint8" for UntypedStorage


@dataclass(frozen=True)
class TorchDType:
    name: str


class TorchSize(tuple):
    """``torch.Size`` as seen in a pickle (a tuple of ints)."""


@dataclass(frozen=True)
class TorchDevice:
    spec: str


@dataclass(eq=False)
class StorageRef:
    """A storage named by a persistent id: record key, element dtype and element count."""

    key: str
    dtype: str
    numel: int
    location: str
    view_metadata: Any = None

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.get(self.dtype).itemsize


@dataclass(eq=False)
class TensorRef:
    """A tensor the pickle rebuilds: a strided view of ``storage``, nothing read yet."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False


class PickledOrderedDict(OrderedDict):
    """An OrderedDict from the pickle; ``state`` keeps attributes set by BUILD (``_metadata``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.state: dict[str, Any] = {}


# -- handlers (the only callables a pickle can reach) --------------------------------------------------

def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int for x in v):
        raise PickleFault(f"{what} must be a tuple of ints, got {v!r:.80}")
    return tuple(v)


def _rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, dtype: str | None,
             metadata: Any = None) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise PickleFault(f"tensor storage must be a persistent storage reference, got {type(storage).__name__}")
    if type(storage_offset) is not int:
        raise PickleFault(f"storage offset must be an int, got {storage_offset!r:.80}")
    shape, stride_t = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(stride_t):
        raise PickleFault(f"size {shape} and stride {stride_t} have different lengths")
    if not isinstance(requires_grad, bool):
        raise PickleFault(f"requires_grad must be a bool, got {requires_grad!r:.80}")
    if metadata not in (None, {}) and not isinstance(metadata, dict):
        raise PickleFault(f"tensor metadata must be a dict, got {type(metadata).__name__}")
    return TensorRef(storage, storage_offset, shape, stride_t, dtype or storage.dtype, requires_grad)


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _rebuild(storage, storage_offset, size, stride, False, None)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return _rebuild(storage, storage_offset, size, stride, requires_grad, None, metadata)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(dtype, TorchDType):
        raise PickleFault(f"_rebuild_tensor_v3 needs a torch dtype, got {dtype!r:.80}")
    return _rebuild(storage, storage_offset, size, stride, requires_grad, dtype.name, metadata)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    if not isinstance(data, TensorRef) or not isinstance(requires_grad, bool):
        raise PickleFault("_rebuild_parameter needs a tensor and a bool")
    data.is_parameter, data.requires_grad = True, requires_grad
    return data


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    if state:
        raise PickleUnsupported("a Parameter carrying Python attributes (state) is not supported")
    return _rebuild_parameter(data, requires_grad, backward_hooks)


_PLAIN_TENSOR_TYPES = {"torch.Tensor", "torch.nn.parameter.Parameter"}


@dataclass(frozen=True)
class _TypeMarker:
    qualname: str


def _rebuild_from_type_v2(func, new_type, args, state):
    if not isinstance(new_type, _TypeMarker) or new_type.qualname not in _PLAIN_TENSOR_TYPES:
        raise PickleUnsupported(f"tensor subclass {new_type!r:.80} is not supported")
    if not callable(func) or func not in _REBUILDERS or not isinstance(args, tuple):
        raise PickleFault("_rebuild_from_type_v2 must wrap a tensor rebuild function")
    if state:
        raise PickleUnsupported("a tensor carrying Python attributes (state) is not supported")
    t = func(*args)
    if new_type.qualname == "torch.nn.parameter.Parameter":
        t.is_parameter = True
    return t


def _ordered_dict(*args):
    if args and not (len(args) == 1 and isinstance(args[0], (list, tuple))):
        raise PickleFault("OrderedDict takes no arguments or one list of pairs")
    try:
        return PickledOrderedDict(*args)
    except (TypeError, ValueError) as e:
        raise PickleFault(f"OrderedDict: {e}") from None


def _size(items=()):
    return TorchSize(_ints(tuple(items) if isinstance(items, list) else items, "torch.Size"))


def _device(kind, index=None):
    if not isinstance(kind, str) or not (index is None or type(index) is int):
        raise PickleFault(f"torch.device({kind!r:.40}, {index!r:.40}) is malformed")
    return TorchDevice(kind if index is None or ":" in kind else f"{kind}:{index}")


def _set(items=()):
    try:
        return set(_iterable(items))
    except TypeError as e:
        raise PickleFault(f"set: {e}") from None


def _frozenset(items=()):
    try:
        return frozenset(_iterable(items))
    except TypeError as e:
        raise PickleFault(f"frozenset: {e}") from None


def _iterable(items):
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise PickleFault(f"expected a list or tuple, got {type(items).__name__}")
    return items


def _from_bytes(kind: type) -> Callable:
    """``bytes(data)`` / ``bytearray(data)`` with bytes only: never ``kind(int)``, which would allocate at will
    (protocols 0-2 pickle ``b""`` as ``bytes()``)."""
    def build(data=b""):
        if not isinstance(data, (bytes, bytearray)):
            raise PickleFault(f"{kind.__name__}() is only accepted with bytes")
        return kind(data)
    return build


_bytearray = _from_bytes(bytearray)
_bytes = _from_bytes(bytes)


def _codecs_encode(text, encoding="utf-8"):
    # protocol 2 pickles Python 3 bytes as _codecs.encode(str, "latin1"); output is as long as the input
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise PickleFault("_codecs.encode is only accepted as (str, 'latin1')")
    return codecs.encode(text, "latin1")


def _unsupported(what: str) -> Callable:
    def refuse(*_args):
        raise PickleUnsupported(f"{what} are not supported by zipslice")
    return refuse


_REBUILDERS = {_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3}

TORCH_ALLOWLIST: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TypeMarker("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _TypeMarker("torch.nn.parameter.Parameter"),
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("builtins", "set"): _set, ("__builtin__", "set"): _set,
    ("builtins", "frozenset"): _frozenset, ("__builtin__", "frozenset"): _frozenset,
    ("builtins", "bytearray"): _bytearray, ("__builtin__", "bytearray"): _bytearray,
    ("builtins", "bytes"): _bytes, ("__builtin__", "bytes"): _bytes,
    ("_codecs", "encode"): _codecs_encode,
    ("torch", "UntypedStorage"): StorageType("UntypedStorage", "uint8"),
    ("torch.storage", "UntypedStorage"): StorageType("UntypedStorage", "uint8"),
    ("torch", "ByteStorage"): StorageType("ByteStorage", "uint8"),
}
for _d in dtypes.BY_NAME.values():
    TORCH_ALLOWLIST[("torch", _d.name)] = TorchDType(_d.name)
    if _d.storage:
        TORCH_ALLOWLIST[("torch", _d.storage)] = StorageType(_d.storage, _d.name)
# torch's own constructs that are safe but that zipslice does not read: refused when called, clearly.
for _fn, _what in [("_rebuild_sparse_tensor", "sparse tensors"), ("_rebuild_sparse_csr_tensor", "sparse tensors"),
                   ("_rebuild_qtensor", "quantized tensors"), ("_rebuild_meta_tensor_no_storage", "meta tensors"),
                   ("_rebuild_wrapper_subclass", "tensor subclasses"), ("_rebuild_nested_tensor", "nested tensors"),
                   ("_rebuild_device_tensor_from_numpy", "device tensors from numpy"),
                   ("_rebuild_xla_tensor", "XLA tensors"), ("_rebuild_mtia_tensor", "MTIA tensors")]:
    TORCH_ALLOWLIST[("torch._utils", _fn)] = _unsupported(_what)


# -- the machine ---------------------------------------------------------------------------------------

_MAX_PROTO = 5
_U32 = struct.Struct("<I").unpack_from


class RestrictedUnpickler:
    """Interpret one pickle from ``data[start:]``; ``end`` is the position after its STOP.

    ``persistent_load(pid)`` resolves BINPERSID/PERSID; ``allowlist`` maps (module, name) to handlers.
    ``entry`` names the pickle in error messages (e.g. ``archive/data.pkl``). ``data`` may be the first
    part of a longer stream of ``source_size`` bytes: then a pickle running past ``data`` raises
    :class:`NeedMoreData` so the caller can retry with more; otherwise it is a CorruptCheckpointError.
    """

    def __init__(self, data: bytes, path: str, entry: str, persistent_load: Callable[[Any], Any],
                 allowlist: dict[tuple[str, str], Any] = TORCH_ALLOWLIST, start: int = 0,
                 source_size: int | None = None):
        self.data = bytes(data) if not isinstance(data, bytes) else data
        # bytes the whole source holds; when larger than ``data``, running out raises NeedMoreData
        self.source_size = len(self.data) if source_size is None else source_size
        self.path, self.entry = path, entry
        self.persistent_load = persistent_load
        self.allowlist = allowlist
        self.pos = start
        self.end = start

    # errors
    def _corrupt(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.path, f"{msg} (pickle byte {self.pos})", self.entry)

    def _take(self, n: int) -> bytes:
        if n < 0:
            raise self._corrupt(f"negative length {n}")
        end = self.pos + n
        if end > len(self.data):
            raise NeedMoreData(f"needs {n} bytes at {self.pos}, {len(self.data) - self.pos} remain")
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def _line(self) -> bytes:
        i = self.data.find(b"\n", self.pos)
        if i < 0:
            raise NeedMoreData("unterminated line")
        out = self.data[self.pos:i]
        self.pos = i + 1
        return out

    def _length(self, fmt: str, size: int) -> int:
        (n,) = struct.unpack(fmt, self._take(size))
        if n > self.source_size - self.pos:
            raise self._corrupt(f"an item claims {n} bytes but only {self.source_size - self.pos} remain")
        return n

    def _find(self, module: str, name: str) -> Any:
        try:
            return self.allowlist[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                self.path, f"the pickle asks for {module}.{name}, which is not on zipslice's allowlist; "
                           "nothing was imported or executed", self.entry) from None

    def _call(self, fn: Any, args: Any) -> Any:
        if not callable(fn) or isinstance(fn, type):
            raise self._corrupt(f"REDUCE on a non-callable {fn!r:.80}")
        if not isinstance(args, tuple):
            raise self._corrupt("REDUCE arguments are not a tuple")
        try:
            return fn(*args)
        except PickleFault as e:
            raise self._corrupt(str(e)) from None
        except PickleUnsupported as e:
            raise UnsupportedCheckpointError(self.path, str(e), self.entry) from None
        except TypeError as e:  # wrong arity: our handlers have fixed signatures
            raise self._corrupt(f"bad call: {e}") from None

    def _pop_mark(self) -> list:
        if not self.marks:
            raise self._corrupt("MARK expected on the stack")
        k = min(self.marks.pop(), len(self.stack))
        items = self.stack[k:]
        del self.stack[k:]
        return items

    def load(self) -> Any:
        try:
            return self._run()
        except NeedMoreData as e:
            if self.source_size > len(self.data):
                raise
            raise self._corrupt(f"the pickle is truncated ({e})") from None
        except (IndexError, KeyError) as e:
            raise self._corrupt(f"malformed pickle ({type(e).__name__}: {e})") from None
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as e:
            raise self._corrupt(f"malformed pickle: {e}") from None
        except TypeError as e:  # unhashable dict key and similar
            raise self._corrupt(f"malformed pickle: {e}") from None
        except RecursionError:
            raise self._corrupt("malformed pickle: nesting too deep") from None

    def _run(self) -> Any:
        """The opcodes torch's pickles are made of, inlined with the position in a local: this loop is
        what opening a checkpoint costs per tensor (~30 opcodes each). Every other opcode goes through
        :meth:`_rare`, which works on ``self.pos``."""
        self.stack: list = []
        self.marks: list[int] = []  # stack heights at each MARK (pickle's metastack, flattened)
        stack, marks = self.stack, self.marks
        memo: dict[int, Any] = {}
        data = self.data
        size = len(data)
        room = self.source_size  # an item's length may not exceed what the whole source still holds
        u32 = _U32
        pos = self.pos
        try:
            while True:
                if pos >= size:
                    raise NeedMoreData("pickle ends before STOP")
                op = data[pos]
                pos += 1
                # most frequent first: BINPUT, BINGET, BININT1 take one argument byte
                if op == 0x71 or op == 0x68 or op == 0x4B:
                    if pos >= size:
                        raise NeedMoreData("pickle ends inside an opcode")
                    arg = data[pos]
                    pos += 1
                    if op == 0x71:  # BINPUT
                        memo[arg] = stack[-1]
                    elif op == 0x68:  # BINGET
                        if arg not in memo:
                            self.pos = pos
                            raise self._corrupt(f"memo key {arg} was never stored")
                        stack.append(memo[arg])
                    else:  # BININT1
                        stack.append(arg)
                elif op == 0x58 or op == 0x8C:  # BINUNICODE, SHORT_BINUNICODE
                    if op == 0x58:
                        if pos + 4 > size:
                            raise NeedMoreData("pickle ends inside an opcode")
                        n = u32(data, pos)[0]
                        pos += 4
                    else:
                        if pos >= size:
                            raise NeedMoreData("pickle ends inside an opcode")
                        n = data[pos]
                        pos += 1
                    if n > room - pos:
                        self.pos = pos
                        raise self._corrupt(f"an item claims {n} bytes but only {room - pos} remain")
                    if pos + n > size:
                        raise NeedMoreData(f"needs {n} bytes at {pos}, {size - pos} remain")
                    stack.append(data[pos:pos + n].decode("utf-8", "surrogatepass"))
                    pos += n
                elif op == 0x28:  # MARK
                    marks.append(len(stack))
                elif op == 0x74:  # TUPLE
                    if not marks:
                        self.pos = pos
                        raise self._corrupt("MARK expected on the stack")
                    k = min(marks.pop(), len(stack))
                    items = tuple(stack[k:])
                    del stack[k:]
                    stack.append(items)
                elif op == 0x85:  # TUPLE1
                    stack[-1] = (stack[-1],)
                elif op == 0x86:  # TUPLE2
                    stack[-2:] = [(stack[-2], stack[-1])]
                elif op == 0x87:  # TUPLE3
                    stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    self.pos = pos
                    stack[-1] = self._call(stack[-1], args)
                elif op == 0x51:  # BINPERSID
                    self.pos = pos
                    stack[-1] = self._persistent(stack[-1])
                elif op == 0x89:  # NEWFALSE
                    stack.append(False)
                elif op == 0x88:  # NEWTRUE
                    stack.append(True)
                elif op == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                elif op == 0x72 or op == 0x6A:  # LONG_BINPUT, LONG_BINGET (memo keys past 255)
                    if pos + 4 > size:
                        raise NeedMoreData("pickle ends inside an opcode")
                    arg = u32(data, pos)[0]
                    pos += 4
                    if op == 0x72:
                        memo[arg] = stack[-1]
                    else:
                        if arg not in memo:
                            self.pos = pos
                            raise self._corrupt(f"memo key {arg} was never stored")
                        stack.append(memo[arg])
                elif op == 0x94:  # MEMOIZE
                    memo[len(memo)] = stack[-1]
                elif op == 0x2E:  # STOP
                    self.pos = self.end = pos
                    if len(stack) != 1 or marks:
                        raise self._corrupt(f"STOP with {len(stack)} items on the stack")
                    return stack.pop()
                else:
                    self.pos = pos
                    self._rare(op, stack, marks, memo)
                    pos = self.pos
        finally:
            # an error in the inlined opcodes is reported at the local position; _rare keeps self.pos
            self.pos = max(self.pos, pos)

    def _rare(self, op: int, stack: list, marks: list, memo: dict) -> None:  # noqa: C901 - one branch per opcode
        """Every opcode but the hot ones of :meth:`_run`; reads its arguments at ``self.pos``."""
        if op == 0x63:  # GLOBAL
            module = self._line().decode("utf-8")
            name = self._line().decode("utf-8")
            stack.append(self._find(module, name))
        elif op == 0x75:  # SETITEMS
            items = self._pop_mark()
            if len(items) % 2:
                raise self._corrupt("SETITEMS with an odd number of items")
            d = self._dict(stack[-1])
            for i in range(0, len(items), 2):
                d[items[i]] = items[i + 1]
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x73:  # SETITEM
            v = stack.pop()
            k = stack.pop()
            self._dict(stack[-1])[k] = v
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x80:  # PROTO
            proto = self._take(1)[0]
            if proto > _MAX_PROTO:
                raise self._corrupt(f"unsupported pickle protocol {proto}")
        elif op == 0x95:  # FRAME: a hint; we hold the whole pickle already
            self._take(8)
        elif op == 0x30:  # POP: pops the last MARK if nothing was pushed after it
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                stack.pop()
        elif op == 0x31:  # POP_MARK
            self._pop_mark()
        elif op == 0x32:  # DUP
            stack.append(stack[-1])
        elif op == 0x4D:  # BININT2
            stack.append(struct.unpack("<H", self._take(2))[0])
        elif op == 0x4A:  # BININT
            stack.append(struct.unpack("<i", self._take(4))[0])
        elif op == 0x8A:  # LONG1
            n = self._take(1)[0]
            stack.append(int.from_bytes(self._take(n), "little", signed=True))
        elif op == 0x8B:  # LONG4
            n = self._length("<i", 4)
            stack.append(int.from_bytes(self._take(n), "little", signed=True))
        elif op == 0x49:  # INT (text); "00"/"01" are protocol 0 booleans
            s = self._line()
            stack.append(False if s == b"00" else True if s == b"01" else int(s))
        elif op == 0x4C:  # LONG (text)
            s = self._line()
            stack.append(int(s[:-1] if s.endswith(b"L") else s))
        elif op == 0x46:  # FLOAT (text)
            stack.append(float(self._line()))
        elif op == 0x47:  # BINFLOAT
            stack.append(struct.unpack(">d", self._take(8))[0])
        elif op == 0x8D:  # BINUNICODE8
            stack.append(self._take(self._length("<Q", 8)).decode("utf-8", "surrogatepass"))
        elif op == 0x56:  # UNICODE (raw-unicode-escape line)
            stack.append(self._line().decode("raw-unicode-escape"))
        elif op == 0x42:  # BINBYTES
            stack.append(self._take(self._length("<I", 4)))
        elif op == 0x43:  # SHORT_BINBYTES
            stack.append(self._take(self._length("<B", 1)))
        elif op == 0x8E:  # BINBYTES8
            stack.append(self._take(self._length("<Q", 8)))
        elif op == 0x96:  # BYTEARRAY8
            stack.append(bytearray(self._take(self._length("<Q", 8))))
        elif op == 0x54:  # BINSTRING (py2 str, read as latin-1 text like pickle's default)
            stack.append(self._take(self._length("<i", 4)).decode("latin1"))
        elif op == 0x55:  # SHORT_BINSTRING
            stack.append(self._take(self._length("<B", 1)).decode("latin1"))
        elif op == 0x53:  # STRING (quoted repr)
            s = self._line()
            if len(s) < 2 or s[:1] != s[-1:] or s[:1] not in (b"'", b'"'):
                raise self._corrupt("STRING opcode argument is not quoted")
            stack.append(codecs.escape_decode(s[1:-1])[0].decode("latin1"))
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x8F:  # EMPTY_SET
            stack.append(set())
        elif op == 0x6C:  # LIST
            stack.append(self._pop_mark())
        elif op == 0x64:  # DICT
            items = self._pop_mark()
            stack.append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})
        elif op == 0x91:  # FROZENSET
            stack.append(frozenset(self._pop_mark()))
        elif op == 0x61:  # APPEND
            v = stack.pop()
            self._list(stack[-1]).append(v)
        elif op == 0x65:  # APPENDS
            items = self._pop_mark()
            self._list(stack[-1]).extend(items)
        elif op == 0x90:  # ADDITEMS
            items = self._pop_mark()
            s = stack[-1]
            if not isinstance(s, set):
                raise self._corrupt("ADDITEMS on a non-set")
            s.update(items)
        elif op == 0x70:  # PUT
            memo[int(self._line())] = stack[-1]
        elif op == 0x67:  # GET
            stack.append(self._memo(memo, int(self._line())))
        elif op == 0x93:  # STACK_GLOBAL
            name = stack.pop()
            module = stack.pop()
            if not isinstance(module, str) or not isinstance(name, str):
                raise self._corrupt("STACK_GLOBAL needs two strings")
            stack.append(self._find(module, name))
        elif op == 0x81:  # NEWOBJ: cls(*args) through the same handlers
            args = stack.pop()
            stack[-1] = self._call(stack[-1], args)
        elif op == 0x92:  # NEWOBJ_EX
            kwargs = stack.pop()
            args = stack.pop()
            if kwargs:
                raise self._corrupt("NEWOBJ_EX with keyword arguments is not accepted")
            stack[-1] = self._call(stack[-1], args)
        elif op == 0x69:  # INST
            module = self._line().decode("utf-8")
            name = self._line().decode("utf-8")
            fn = self._find(module, name)
            stack.append(self._call(fn, tuple(self._pop_mark())))
        elif op == 0x6F:  # OBJ
            items = self._pop_mark()
            if not items:
                raise self._corrupt("OBJ without a class")
            stack.append(self._call(items[0], tuple(items[1:])))
        elif op == 0x62:  # BUILD
            state = stack.pop()
            self._build(stack[-1], state)
        elif op == 0x50:  # PERSID
            stack.append(self._persistent(self._line().decode("ascii")))
        elif op in (0x82, 0x83, 0x84):
            raise UnsafeCheckpointError(self.path, "the pickle uses the copyreg extension registry (EXT*), "
                                                   "which zipslice refuses", self.entry)
        elif op in (0x97, 0x98):
            raise self._corrupt("out-of-band buffers (protocol 5 NEXT_BUFFER) are not accepted")
        else:
            self.pos -= 1
            raise self._corrupt(f"unknown pickle opcode 0x{op:02x}")

    def _memo(self, memo: dict, i: int) -> Any:
        try:
            return memo[i]
        except KeyError:
            raise self._corrupt(f"memo key {i} was never stored") from None

    def _list(self, obj: Any) -> list:
        if not isinstance(obj, list):
            raise self._corrupt(f"APPEND to a {type(obj).__name__}")
        return obj

    def _dict(self, obj: Any) -> dict:
        if not isinstance(obj, dict):
            raise self._corrupt(f"SETITEM on a {type(obj).__name__}")
        return obj

    def _build(self, obj: Any, state: Any) -> None:
        if isinstance(obj, PickledOrderedDict) and isinstance(state, dict):
            obj.state.update(state)
        elif isinstance(obj, set) and state is None:
            pass
        else:
            raise UnsupportedCheckpointError(
                self.path, f"BUILD (setting state) on a {type(obj).__name__} is not supported", self.entry)

    def _persistent(self, pid: Any) -> Any:
        try:
            return self.persistent_load(pid)
        except PickleFault as e:
            raise self._corrupt(str(e)) from None
