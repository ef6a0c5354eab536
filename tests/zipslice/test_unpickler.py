"""The restricted pickle machine against Python's own pickle: same values for every protocol, errors that
say where they happened, and nothing outside the allowlist.

The torch-specific cases (tensors, storages, hostile checkpoints) are in test_torch_reader.py and
test_torch_hostile.py; this file checks the opcode interpreter itself, including the inlined hot loop.
"""
from __future__ import annotations

import math
import pickle
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zipslice.errors import CorruptCheckpointError, UnsafeCheckpointError
from zipslice.unpickler import PickledOrderedDict, RestrictedUnpickler


def no_pid(pid):
    raise AssertionError(f"no persistent ids expected, got {pid!r}")


def load(data: bytes):
    return RestrictedUnpickler(data, "test.pkl", "data.pkl", no_pid).load()


scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**200, max_value=2**200)
           | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=6) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=6)
                   | st.frozensets(st.integers(), max_size=5) | st.sets(st.text(max_size=5), max_size=5)),
    max_leaves=40)


@settings(max_examples=150, deadline=None)
@given(values, st.integers(min_value=0, max_value=5))
def test_same_values_as_pickle_for_every_protocol(obj, protocol):
    data = pickle.dumps(obj, protocol=protocol)
    got = load(data)
    assert got == pickle.loads(data)
    assert type(got) is type(obj)


def test_shared_objects_stay_shared_and_memo_past_255():
    shared = ["x"]
    obj = [shared, shared] + [[i] for i in range(600)] + [shared]  # > 256 memo entries: LONG_BINPUT/GET
    for protocol in (2, 3, 4, 5):
        got = load(pickle.dumps(obj, protocol=protocol))
        assert got == obj
        assert got[0] is got[1] is got[-1]


def test_ordered_dict_with_metadata_attribute():
    od = OrderedDict(a=1, b=[2, 3])
    od._metadata = {"": {"version": 1}}
    got = load(pickle.dumps(od, protocol=2))
    assert isinstance(got, PickledOrderedDict)
    assert list(got.items()) == [("a", 1), ("b", [2, 3])]
    assert got.state == {"_metadata": {"": {"version": 1}}}


def test_special_floats():
    got = load(pickle.dumps([math.inf, -math.inf, -0.0, math.nan], protocol=2))
    assert got[:2] == [math.inf, -math.inf]
    assert math.copysign(1.0, got[2]) == -1.0 and math.isnan(got[3])


@pytest.mark.parametrize("data, where, what", [
    (b"\x80\x02h\x05.", 4, "memo key 5 was never stored"),           # BINGET of nothing (hot loop)
    (b"\x80\x02j\x00\x01\x00\x00.", 7, "memo key 256 was never stored"),  # LONG_BINGET
    (b"\x80\x02X\xff\x00\x00\x00ab.", 7, "claims 255 bytes"),          # BINUNICODE longer than the pickle
    (b"\x80\x02K\x01K\x02.", 7, "STOP with 2 items"),
    (b"\x80\x02K\x01t.", 5, "MARK expected"),                          # TUPLE without MARK
    (b"\x80\x02]\xff.", 3, "unknown pickle opcode 0xff"),              # through the rare path
])
def test_errors_name_the_entry_and_the_byte(data, where, what):
    with pytest.raises(CorruptCheckpointError) as e:
        load(data)
    msg = str(e.value)
    assert what in msg and f"pickle byte {where}" in msg and "data.pkl" in msg and "test.pkl" in msg


def test_truncated_and_stack_underflow_are_corrupt_not_crashes():
    for data in (b"\x80\x02X\x03\x00", b"\x80\x02q\x00.", b"\x80\x02\x85.", b"\x80\x02", b""):
        with pytest.raises(CorruptCheckpointError):
            load(data)


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_globals_outside_the_allowlist_are_refused_without_importing(protocol):
    import os

    data = pickle.dumps(os.getcwd, protocol=protocol)  # GLOBAL / STACK_GLOBAL 'posix getcwd'
    with pytest.raises(UnsafeCheckpointError, match="getcwd"):
        load(data)
