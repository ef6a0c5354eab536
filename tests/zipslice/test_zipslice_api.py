"""zipslice's public API (zipslice/__init__.py): every name in __all__ is importable from the package."""
import zipslice


def test_every_public_name_resolves():
    for name in zipslice.__all__:
        assert getattr(zipslice, name) is not None, name
    assert {"load", "save", "sniff", "LazyCheckpoint", "TensorInfo", "TensorSource", "ZipsliceError"} \
        <= set(zipslice.__all__)


def test_every_public_error_is_a_zipslice_error():
    for name in zipslice.__all__:
        obj = getattr(zipslice, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, zipslice.ZipsliceError), name
