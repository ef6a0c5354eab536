"""git's pkt-line framing (gitprotocol-common(5)), as used by the long-running filter protocol.

A packet is a 4-hex-digit length (counting those 4 bytes) followed by the payload; "0000" is a flush.
"""
from __future__ import annotations

import os
from typing import BinaryIO, Iterator

from theta.base.errors import ProtocolError

MAX_PAYLOAD = 65516  # 65520 bytes per packet minus the 4-byte header
FLUSH = None


def grow_pipe(fd: int, nbytes: int = 1 << 20) -> None:
    """Ask for a pipe buffer of ``nbytes`` (Linux; default 64 KiB). Best effort: not a pipe, or over
    /proc/sys/fs/pipe-max-size, keeps the default."""
    try:
        import fcntl
    except ImportError:
        return
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), nbytes)
    except (OSError, ValueError):
        pass


class PktReader:
    """Packets from ``stream``, read through a buffer of this reader's own (``buffer_bytes``, at least two
    packets): one read per buffer instead of two per packet, and content handed out as views of the buffer
    (:meth:`iter_content_views`) with no copy. Bytes read past a flush stay in the buffer for the next call.

    It must be the stream's only reader from its start: a buffered stream is read through its raw file, one
    system call per read. (A ``BufferedReader``'s ``readinto1`` is not that: once it holds a few bytes of its
    own, it hands them over and then reads the pipe again, and at the end of a request, when git sends nothing
    more until it is answered, that read waits for good.)"""

    def __init__(self, stream: BinaryIO, buffer_bytes: int = 1 << 20):
        self.stream = stream
        raw = getattr(stream, "raw", None)
        self._read = raw.readinto if raw is not None else getattr(stream, "readinto1", stream.readinto)
        self._buf = bytearray(max(buffer_bytes, 2 * (MAX_PAYLOAD + 4)))
        self._view = memoryview(self._buf)
        self._pos = self._end = 0  # the unread bytes are _buf[_pos:_end]

    def _have(self, n: int) -> bool:
        """Whether ``n`` unread bytes are buffered, reading more until they are; False at EOF before that."""
        while self._end - self._pos < n:
            if len(self._buf) - self._pos < n:  # move the unread tail to the front (n fits: a packet at most)
                left = self._end - self._pos
                self._buf[:left] = self._buf[self._pos:self._end]
                self._pos, self._end = 0, left
            got = self._read(self._view[self._end:])
            if not got:
                return False
            self._end += got
        return True

    def _next(self) -> memoryview | None:
        """The next payload as a view of the buffer (valid until the next read), or None for a flush packet.
        EOF between packets raises EOFError."""
        if not self._have(4):
            if self._end > self._pos:
                raise ProtocolError("filter protocol: truncated packet length")
            raise EOFError
        head = self._buf[self._pos:self._pos + 4]
        try:
            size = int(head, 16)
        except ValueError:
            raise ProtocolError(f"filter protocol: bad packet length {bytes(head)!r}") from None
        if size == 0:
            self._pos += 4
            return FLUSH
        if size < 4 or size > MAX_PAYLOAD + 4:
            raise ProtocolError(f"filter protocol: bad packet length {size}")
        if not self._have(size):
            raise ProtocolError(f"filter protocol: stream ended inside a packet (wanted {size - 4} bytes)")
        start = self._pos + 4
        self._pos += size
        return self._view[start:self._pos]

    def read_packet(self) -> bytes | None:
        """One payload, or None for a flush packet. EOF between packets raises EOFError."""
        pkt = self._next()
        return FLUSH if pkt is FLUSH else bytes(pkt)

    def read_text_list(self) -> list[str]:
        """Text lines up to the next flush (trailing newlines removed)."""
        lines = []
        while (pkt := self.read_packet()) is not FLUSH:
            lines.append(pkt.decode("utf-8").rstrip("\n"))
        return lines

    def read_pairs(self) -> dict[str, str]:
        """key=value lines up to the next flush."""
        out: dict[str, str] = {}
        for line in self.read_text_list():
            key, sep, value = line.partition("=")
            if not sep:
                raise ProtocolError(f"filter protocol: expected key=value, got {line!r}")
            out[key] = value
        return out

    def iter_content(self) -> Iterator[bytes]:
        """Binary packets up to the next flush."""
        while (pkt := self.read_packet()) is not FLUSH:
            yield pkt

    def iter_content_views(self) -> Iterator[memoryview]:
        """Binary packets up to the next flush, as views of the reader's buffer: each is valid only until the
        next is asked for (git's 400 MiB of a checkpoint reach their hasher without being copied again)."""
        while (pkt := self._next()) is not FLUSH:
            yield pkt


class PktWriter:
    def __init__(self, stream: BinaryIO):
        self.stream = stream

    def packet(self, payload: bytes) -> None:
        if not payload:
            raise ValueError("empty packets are not allowed; use flush()")
        view = memoryview(payload)
        for i in range(0, len(view), MAX_PAYLOAD):
            chunk = view[i:i + MAX_PAYLOAD]
            self.stream.write(b"%04x" % (len(chunk) + 4))
            self.stream.write(chunk)

    def text(self, line: str) -> None:
        self.packet(line.encode("utf-8") + b"\n")

    def flush(self) -> None:
        self.stream.write(b"0000")
        self.stream.flush()

    def text_list(self, lines: list[str]) -> None:
        for line in lines:
            self.text(line)
        self.flush()

    def content_from(self, f: BinaryIO, bufsize: int = MAX_PAYLOAD * 16) -> None:
        """Send a file's bytes as content packets followed by a flush."""
        out = self.content()
        while chunk := f.read(bufsize):
            out.write(chunk)
        out.close()

    def content(self) -> "ContentWriter":
        """A file-like writer whose bytes go out as content packets; its close() sends the flush."""
        return ContentWriter(self.stream)


_IOV_BATCH = 512  # packets per writev (header + payload each: 1024 iovecs, Linux's IOV_MAX)


class ContentWriter:
    """Turns arbitrary writes into full-size content packets.

    Small writes (zip headers) are gathered into one packet; a large write is cut into packets through
    memoryview slices (no copies) that go out with os.writev, up to 512 packets (32 MiB) per system call.
    """

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.pending = bytearray()
        self.sent = 0  # payload bytes handed to the stream
        try:
            self.fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self.fd = None  # e.g. BytesIO in tests: plain writes

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if len(self.pending) + n < MAX_PAYLOAD:
            self.pending += view
            return n
        packets = []
        if self.pending:
            take = MAX_PAYLOAD - len(self.pending)
            self.pending += view[:take]
            packets.append(bytes(self.pending))
            self.pending.clear()
            view = view[take:]
        full = view.nbytes - view.nbytes % MAX_PAYLOAD
        packets.extend(view[i:i + MAX_PAYLOAD] for i in range(0, full, MAX_PAYLOAD))
        self.pending += view[full:]
        self._send(packets)
        return n

    def _send(self, packets: list) -> None:
        head = b"%04x" % (MAX_PAYLOAD + 4)
        if self.fd is None:
            for p in packets:
                self.stream.write(b"%04x" % (len(p) + 4))
                self.stream.write(p)
                self.sent += len(p)
            return
        self.stream.flush()  # what the buffered stream holds goes first
        for i in range(0, len(packets), _IOV_BATCH):
            iov = []
            for p in packets[i:i + _IOV_BATCH]:
                iov.append(head if len(p) == MAX_PAYLOAD else b"%04x" % (len(p) + 4))
                iov.append(p)
            _writev_all(self.fd, iov)
            self.sent += sum(len(p) for p in packets[i:i + _IOV_BATCH])

    def close(self) -> None:
        """Send what is gathered and the flush packet that ends the content."""
        if self.pending:
            self._send([bytes(self.pending)])
            self.pending.clear()
        self.stream.write(b"0000")
        self.stream.flush()


def _writev_all(fd: int, iov: list) -> None:
    views = [memoryview(b).cast("B") for b in iov]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
