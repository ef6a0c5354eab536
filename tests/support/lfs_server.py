"""A real Git LFS HTTP server for tests: giftless on 127.0.0.1, local storage, anonymous read/write.

    with GiftlessServer(tmp_path / "lfs-store") as server:
        repo.git("config", "lfs.url", server.lfs_url("org", "repo"))

It runs in its own subprocess (werkzeug's threaded server), on a free port, and is stopped at exit.
"""
from __future__ import annotations

import json
import os
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
logging.getLogger("werkzeug").setLevel(logging.WARNING)
run_simple("127.0.0.1", int(sys.argv[1]), init_app(), threaded=True)
"""


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

    def lfs_url(self, org: str = "theta", repo: str = "test") -> str:
        return f"http://127.0.0.1:{self.port}/{org}/{repo}.git/info/lfs"

    def objects(self) -> set[str]:
        """The oids the server stores (giftless LocalStorage keeps <path>/<org>/<repo>/<oid>)."""
        return {p.name for p in self.storage.rglob("*") if p.is_file() and len(p.name) == 64}

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
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(self.port)], env=env, cwd=self.storage.parent,
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
