"""theta.git.pktline.PktReader reads through a buffer of its own and hands content out as views of it: through a
real pipe whose writer sends odd-sized pieces, every packet arrives bit for bit, what follows a flush stays
for the next read, and a stream cut inside a packet or its length is refused."""
from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest

from theta.base.errors import ProtocolError
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


def test_the_end_of_a_request_never_waits_for_bytes_git_sends_only_after_the_answer():
    """git sends a request, then waits for the answer with the pipe open. The reader must not ask the pipe for
    more once it holds the request: here its first read ends 100 bytes before its buffer's end, inside a packet,
    and the rest of the request (that packet's end, one more packet, the flush) arrives in one write. A
    ``BufferedReader.readinto1`` took those bytes into its own buffer, then read the pipe again and waited for good
    (the hang `tests/hostile/test_faults.py` met in CI); the reader reads the raw pipe, one system call a time."""
    import fcntl
    import struct
    import termios
    import time

    size = 2 * (MAX_PAYLOAD + 4)
    head = io.BytesIO()
    PktWriter(head).text_list(["command=clean", "pathname=model.pt"])
    h = len(head.getvalue())
    body = io.BytesIO()
    w = PktWriter(body)
    second = size - 50 - h - (MAX_PAYLOAD + 4) - 4  # the second packet ends 50 bytes before the buffer's end
    for n, fill in ((MAX_PAYLOAD, 1), (second, 2), (1000, 3)):
        w.packet(bytes([fill]) * n)
    w.flush()
    raw = head.getvalue() + body.getvalue()
    cut = size - 100
    rfd, wfd = os.pipe()
    fcntl.fcntl(wfd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    answered = threading.Event()

    def git():
        with os.fdopen(wfd, "wb", buffering=0) as out:
            out.write(raw[:cut])
            while struct.unpack("i", fcntl.ioctl(rfd, termios.FIONREAD, b"\0" * 4))[0]:
                time.sleep(0.001)  # until the filter has read it all
            out.write(raw[cut:])  # one write: the rest of the request
            answered.wait(30)     # the pipe stays open until the filter answers

    got = []

    def filter_process():
        with os.fdopen(rfd, "rb") as stdin:
            r = PktReader(stdin, size)
            r.read_pairs()
            got.append(b"".join(bytes(v) for v in r.iter_content_views()))
            answered.set()
    threads = [threading.Thread(target=t, daemon=True) for t in (git, filter_process)]
    for t in threads:
        t.start()
    threads[1].join(20)
    answered.set()
    assert not threads[1].is_alive(), "the reader waited for bytes git sends only after the answer"
    assert got == [b"\1" * MAX_PAYLOAD + b"\2" * second + b"\3" * 1000]
