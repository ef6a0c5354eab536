"""commands.receive.receive: git's bytes are compared with the work-tree file through a reused window; the file
is used in place only when every byte and the length match, else exactly git's bytes are spooled."""
import os

import pytest

from theta.commands.filter import receive as receiving
from theta.commands.filter.receive import receive


@pytest.fixture(autouse=True)
def small_window(monkeypatch):
    # windows smaller than git's packets and not a multiple of them: every refill path runs
    monkeypatch.setattr(receiving, "_COMPARE_BLOCK", 100_000)


@pytest.mark.parametrize("size", [0, 1, 65516, 300_001])
@pytest.mark.parametrize("packet", [1, 65516, 250_000])
def test_matching_bytes_use_the_file_and_others_are_spooled_exactly(tmp_path, size, packet):
    data = os.urandom(size)
    f = tmp_path / "model.pt"
    f.write_bytes(data)

    def packets(b):
        return iter([b[i:i + packet] for i in range(0, len(b), packet)])

    got = receive(packets(data), tmp_path, f)
    assert not got.owned and got.path == f and got.size == size and got.head == data[:4096]
    variants = [data + b"x"]
    if size:
        flipped = bytearray(data)
        flipped[size // 2] ^= 1
        variants += [bytes(flipped), data[:-1]]
    for other in variants:
        got = receive(packets(other), tmp_path, f)
        assert got.owned and got.path.read_bytes() == other and got.size == len(other)
        got.cleanup()
        assert not got.path.exists()
