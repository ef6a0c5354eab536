"""A TCP proxy on 127.0.0.1 that adds a round-trip time to a local server (the benchmarks' LFS server), for
kernels without ``sch_netem`` (``tc qdisc ... netem delay`` is the usual way, and this machine's kernel lacks it).

Every chunk read from either side is written to the other half a round trip later, in order, so a request and
its answer cross ``rtt`` more than they would; bytes are not held back beyond that (the link's rate is the
namespace's ``tbf`` qdisc, as before). The proxy runs an asyncio loop on a thread of the calling process and
costs that process some CPU per byte forwarded.

    with GiftlessServer(storage) as server, DelayedServer(server, rtt=0.05) as delayed:
        url = delayed.lfs_url("org", "repo")     # through the proxy
"""
from __future__ import annotations

import asyncio
import threading
import time

from lfs_server import free_port

CHUNK = 1 << 20


class DelayedServer:
    """``server`` (anything with ``port``, ``lfs_url`` and ``storage``) reached through a proxy adding ``rtt``
    seconds to every round trip; its other attributes are the server's."""

    def __init__(self, server, rtt: float):
        self.server, self.rtt = server, rtt
        self.port = free_port()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __getattr__(self, name: str):
        return getattr(self.server, name)

    def lfs_url(self, org: str = "theta", repo: str = "test") -> str:
        return self.server.lfs_url(org, repo).replace(f":{self.server.port}/", f":{self.port}/")

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while data := await reader.read(CHUNK):
                queue.put_nowait((time.monotonic() + self.rtt / 2, data))
        finally:
            queue.put_nowait((0.0, None))
            await sender
            writer.close()

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.server.port)
        await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w), return_exceptions=True)

    def __enter__(self) -> "DelayedServer":
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            listener = self._loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", self.port))
            started.set()
            self._loop.run_forever()
            listener.close()

        self._thread = threading.Thread(target=run, name="rtt-proxy", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the delaying proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
