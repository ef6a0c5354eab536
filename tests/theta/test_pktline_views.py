"""theta.git.pktline.PktReader reads through a buffer of its own and hands content out as views of it: through a
real pipe whose writer sends odd-sized pieces, every packet arrives bit for bit, what follows a flush stays
for the next read, and a stream cut inside a packet or its length is refused."""
from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest

from theta.errors import ProtocolError
from theta.git.pktline import MAX_PAYLOAD, PktReader, PktWriter


def _packets(content: bytes, after: list[str]) -> bytes:
    buf = io.BytesIO()
    w = PktWriter(buf)
    w.text_list(["command=clean", "pathname=model.pt"])
    out = w.content()
    out.write(content)
    out.close()
    w.text_list(after)
    return buf.getvalue()


def _through_pipe(raw: bytes, piece: int):
    """A reading end of a real pipe whose writer thread sends ``raw`` ``piece`` bytes at a time."""
    rfd, wfd = os.pipe()

    def write():
        with os.fdopen(wfd, "wb", buffering=0) as w:
            for i in range(0, len(raw), piece):
                w.write(raw[i:i + piece])
    t = threading.Thread(target=write, daemon=True)
    t.start()
    return os.fdopen(rfd, "rb"), t


@pytest.mark.parametrize("piece", [1, 4093, MAX_PAYLOAD + 4, 1 << 20])
@pytest.mark.parametrize("buffer_bytes", [2 * (MAX_PAYLOAD + 4), 1 << 20])
def test_content_views_through_a_pipe_are_git_bytes_and_what_follows_stays(piece, buffer_bytes):
    content = np.random.default_rng(piece).integers(0, 256, 3 * (1 << 20) + 12345, dtype=np.uint8).tobytes()
    if piece == 1:
        content = content[:200_000]  # a byte per read: keep it short
    stdin, writer = _through_pipe(_packets(content, ["status=next"]), piece)
    with stdin:
        r = PktReader(stdin, buffer_bytes)
        assert r.read_pairs() == {"command": "clean", "pathname": "model.pt"}
        got = bytearray()
        sizes = []
        for view in r.iter_content_views():
            assert isinstance(view, memoryview)
            sizes.append(len(view))
            got += view  # used before the next one is asked for, as receive() does
        assert bytes(got) == content
        assert max(sizes) == MAX_PAYLOAD
        assert r.read_text_list() == ["status=next"]  # read past the flush: kept for this call
        with pytest.raises(EOFError):
            r.read_packet()
    writer.join()


def test_a_view_is_the_buffer_until_the_next_packet():
    content = bytes(range(256)) * 1000
    r = PktReader(io.BytesIO(_packets(content, [])))
    r.read_pairs()
    first = next(iter(r.iter_content_views()))
    assert first.obj is r._buf  # no copy: the view is of the reader's own buffer
    assert bytes(first) == content[:MAX_PAYLOAD]


@pytest.mark.parametrize("raw, error", [
    (b"00", ProtocolError),            # cut inside a length
    (b"0010abc", ProtocolError),       # cut inside a payload
    (b"00zz", ProtocolError),          # not hex
    (b"0003", ProtocolError),          # shorter than its own length field
    (b"%04x" % (MAX_PAYLOAD + 5), ProtocolError),  # longer than git sends
    (b"", EOFError),                   # nothing more between packets
])
def test_a_broken_stream_is_refused(raw, error):
    with pytest.raises(error):
        list(PktReader(io.BytesIO(raw)).iter_content_views())
