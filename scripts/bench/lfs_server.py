"""A real Git LFS HTTP server for the tests and the benchmarks (the tests import it as scripts.bench.lfs_server):
giftless on 127.0.0.1, local storage, anonymous read/write.

    with GiftlessServer(tmp_path / "lfs-store") as server:
        repo.git("config", "lfs.url", server.lfs_url("org", "repo"))
        ...
        server.served()   # [(oid, bytes sent)] of every object download so far, in order
        server.throttle(4 << 20)   # downloads at 4 MiB/s each from now on (None: unlimited)

It runs in its own subprocess (werkzeug's threaded server), on a free port, and is stopped at exit.

Two things giftless 0.6.2 does not do as the LFS servers users have (S3 behind GitHub, GitLab, Gitea...) are
done around it, in the server process: a stored object is sent in 1 MiB blocks (giftless hands werkzeug the
open file, which iterates a binary file line by line: a socket write per newline byte, ~30x slower than the
link and 5-10 % more bytes on it in headers), and a download asking for a ``Range`` (git-lfs resuming a
partial download from ``lfs/incomplete``) gets that range with 206 (giftless ignores the header and sends the
whole object). Every batch request and object download is logged (:meth:`GiftlessServer.requests`), and
downloads can be slowed down (:meth:`GiftlessServer.throttle`), for tests of interrupted transfers.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

_SERVE = """
import logging, sys
from werkzeug.serving import run_simple
from giftless.app import init_app
import lfs_server
logging.getLogger("werkzeug").setLevel(logging.WARNING)
lfs_server.send_in_blocks()
app = lfs_server.Downloads(init_app(), sys.argv[2], sys.argv[3])
run_simple("127.0.0.1", int(sys.argv[1]), app, threaded=True)
"""
BLOCK = 1 << 20
_OBJECT = re.compile(r"^/(?P<prefix>.+)\.git/info/lfs/objects/storage/(?P<oid>[0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Blocks:
    """An open object file, iterated in BLOCK-sized reads (what werkzeug sends as the response body)."""

    def __init__(self, f):
        self.f = f

    def __iter__(self):
        while True:
            block = self.f.read(BLOCK)
            if not block:
                return
            yield block

    def read(self, n=-1):
        return self.f.read(n)

    def close(self):
        self.f.close()


def send_in_blocks() -> None:
    """Make giftless's local storage hand out objects as :class:`_Blocks`."""
    from giftless.storage.local_storage import LocalStorage

    plain = LocalStorage.get

    def get(self, prefix, oid):
        return _Blocks(plain(self, prefix, oid))

    LocalStorage.get = get


class Downloads:
    """WSGI middleware around giftless: serves a ``Range`` request for a stored object (206, Content-Range),
    sends downloads no faster than the rate in ``rate_file`` (bytes per second, per download; absent or 0:
    unlimited), and logs to ``log`` one JSON line per batch request (operation, objects) and per object
    download (oid, first byte, bytes sent, downloads in flight when it started)."""

    def __init__(self, app, storage: str, log: str):
        import threading

        self.app, self.storage, self.log = app, Path(storage), log
        self.rate_file = Path(log).with_suffix(".rate")
        self.lock = threading.Lock()
        self.inflight = 0

    def _write(self, entry: dict) -> None:
        with self.lock, open(self.log, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def __call__(self, environ, start_response):
        path_info = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") == "POST" and path_info.endswith("/info/lfs/objects/batch"):
            import io

            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            environ["wsgi.input"] = io.BytesIO(body)
            try:
                req = json.loads(body)
                self._write({"kind": "batch", "operation": req.get("operation"), "objects": len(req.get("objects", []))})
            except ValueError:
                pass
            return self.app(environ, start_response)
        m = _OBJECT.match(path_info)
        if m is None or environ.get("REQUEST_METHOD") != "GET":
            return self.app(environ, start_response)
        oid = m.group("oid")
        wanted = _RANGE.match(environ.get("HTTP_RANGE", "").strip())
        path = self.storage / m.group("prefix") / oid
        if wanted is None or not path.is_file():
            return self._logged(oid, 0, self.app(environ, start_response))
        size = path.stat().st_size
        start = int(wanted.group(1))
        end = min(int(wanted.group(2)), size - 1) if wanted.group(2) else size - 1
        if start > end:
            start_response("416 Range Not Satisfiable", [("Content-Range", f"bytes */{size}")])
            return [b""]
        start_response("206 Partial Content", [("Content-Type", "application/octet-stream"),
                                               ("Content-Length", str(end - start + 1)),
                                               ("Content-Range", f"bytes {start}-{end}/{size}")])
        return self._logged(oid, start, self._part(path, start, end + 1))

    @staticmethod
    def _part(path: Path, start: int, stop: int):
        with open(path, "rb") as f:
            f.seek(start)
            while start < stop:
                block = f.read(min(BLOCK, stop - start))
                if not block:
                    return
                start += len(block)
                yield block

    def _rate(self) -> int:
        try:
            return int(self.rate_file.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def _logged(self, oid: str, first: int, body):
        with self.lock:
            self.inflight += 1
            inflight = self.inflight
        sent = 0
        try:
            for block in body:
                rate = self._rate()
                if not rate:
                    sent += len(block)
                    yield block
                    continue
                for i in range(0, len(block), 64 << 10):  # throttled: 64 KiB at a time, paced
                    piece = block[i:i + (64 << 10)]
                    time.sleep(len(piece) / rate)
                    sent += len(piece)
                    yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
            with self.lock:
                self.inflight -= 1
            self._write({"kind": "download", "oid": oid, "first": first, "sent": sent, "inflight": inflight})


def allow_everyone(_request):
    """giftless authenticator: anyone may read and write.

    (giftless 0.6.2's allow_anon:read_write denies per-object checks: its identity looks permissions up by
    oid under the wildcard repository and finds none.)
    """
    from giftless.auth.identity import DefaultIdentity

    class Everyone(DefaultIdentity):
        def is_authorized(self, organization, repo, permission, oid=None) -> bool:
            return True

    return Everyone(name="test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GiftlessServer:
    def __init__(self, storage: Path, startup_timeout: float = 30.0):
        self.storage = Path(storage)
        self.port = free_port()
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log = self.storage.parent / f"giftless-{self.port}.log"
        self.downloads = self.storage.parent / f"giftless-{self.port}-requests.log"

    def lfs_url(self, org: str = "theta", repo: str = "test") -> str:
        return f"http://127.0.0.1:{self.port}/{org}/{repo}.git/info/lfs"

    def objects(self) -> set[str]:
        """The oids the server stores (giftless LocalStorage keeps <path>/<org>/<repo>/<oid>)."""
        return {p.name for p in self.storage.rglob("*") if p.is_file() and len(p.name) == 64}

    def requests(self) -> list[dict]:
        """Every batch request and object download so far (see :class:`Downloads`), in the order they ended."""
        try:
            lines = self.downloads.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def served(self) -> list[tuple[str, int]]:
        """(oid, bytes sent) of every object download so far, in the order they ended."""
        return [(r["oid"], r["sent"]) for r in self.requests() if r["kind"] == "download"]

    def throttle(self, bytes_per_second: int | None) -> None:
        """Send each download no faster than this from now on (None: as fast as it goes)."""
        self.downloads.with_suffix(".rate").write_text(str(int(bytes_per_second or 0)))

    def start(self) -> "GiftlessServer":
        self.storage.mkdir(parents=True, exist_ok=True)
        config = {
            "AUTH_PROVIDERS": ["lfs_server:allow_everyone"],
            "LEGACY_ENDPOINTS": False,
            "PRE_AUTHORIZED_ACTION_PROVIDER": None,  # no signed action URLs: anonymous read/write everywhere
            "TRANSFER_ADAPTERS": {"basic": {
                "factory": "giftless.transfer.basic_streaming:factory",
                "options": {"storage_class": "giftless.storage.local_storage:LocalStorage",
                            "storage_options": {"path": str(self.storage)}}}},
        }
        env = {**os.environ, "GIFTLESS_CONFIG_STR": json.dumps(config),  # JSON is YAML
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        logf = open(self.log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(self.port), str(self.storage),
                                      str(self.downloads)], env=env, cwd=self.storage.parent,
                                     stdout=logf, stderr=subprocess.STDOUT)
        logf.close()
        deadline = time.monotonic() + self.startup_timeout
        probe = self.lfs_url() + "/objects/batch"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"giftless exited early:\n{self.log.read_text(errors='replace')}")
            req = urllib.request.Request(probe, method="POST", data=b'{"operation":"download","objects":[]}',
                                         headers={"Content-Type": "application/vnd.git-lfs+json",
                                                  "Accept": "application/vnd.git-lfs+json"})
            try:
                with urllib.request.urlopen(req, timeout=2):
                    return self
            except urllib.error.HTTPError:
                return self  # it answers: up
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"giftless did not start within {self.startup_timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "GiftlessServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
