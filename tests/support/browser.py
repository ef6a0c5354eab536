"""A real headless Chromium for tests that look at a page as a person would: open it, click, read the DOM,
take a screenshot.

Driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``: JSON messages ended by a NUL on
file descriptors 3 and 4 of the browser), so nothing listens on a port and no client library is needed.

    with Browser.start() as b:          # skips the test when Chromium is not installed
        page = b.open(Path("page.html"), width=1200, height=800)
        page.eval("document.title")
        page.click("tr.layer th")
        png = page.screenshot()
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def executable() -> str | None:
    """The browser: $THETA_TEST_CHROMIUM, else the first of CANDIDATES on PATH (Debian's /usr/bin/chromium is a
    shell wrapper; its binary is used directly when present)."""
    exe = os.environ.get("THETA_TEST_CHROMIUM") or next((p for p in map(shutil.which, CANDIDATES) if p), None)
    if exe and Path(exe).resolve() == Path("/usr/bin/chromium") and Path("/usr/lib/chromium/chromium").exists():
        return "/usr/lib/chromium/chromium"
    return exe


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, proc: subprocess.Popen, to_browser: int, from_browser: int, profile: str):
        self.proc, self._out, self._in, self._profile = proc, to_browser, from_browser, profile
        self._buf = b""
        self._next = 0
        self._events: list[dict] = []

    @classmethod
    def start(cls) -> "Browser":
        exe = executable()
        if exe is None:
            pytest.skip("headless Chromium is not installed (apt-get install chromium, or set THETA_TEST_CHROMIUM)")
        profile = tempfile.mkdtemp(prefix="theta-chromium-")
        cmd_r, cmd_w = os.pipe()    # we write commands, the browser reads them on fd 3
        ev_r, ev_w = os.pipe()      # the browser writes on fd 4, we read

        def child_fds() -> None:
            a, b = os.dup(cmd_r), os.dup(ev_w)  # (above 4, whatever numbers the pipes got)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--hide-scrollbars", "--mute-audio", f"--user-data-dir={profile}", "about:blank"]
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=child_fds, close_fds=False)  # (fds 3 and 4 stay open)
        os.close(cmd_r)
        os.close(ev_w)
        return cls(proc, cmd_w, ev_r, profile)

    # -- protocol --------------------------------------------------------------------------------------------
    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def wait_event(self, method: str, session: str | None = None, timeout: float = 30.0) -> dict:
        for i, e in enumerate(self._events):
            if e.get("method") == method and (session is None or e.get("sessionId") == session):
                return self._events.pop(i)
        end = time.monotonic() + timeout
        while True:
            e = self._read(max(0.1, end - time.monotonic()))
            if e.get("method") == method and (session is None or e.get("sessionId") == session):
                return e
            self._events.append(e)

    def _read(self, timeout: float) -> dict:
        import select

        end = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserError(f"no answer from the browser in {timeout:.0f} s")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise BrowserError("the browser closed its pipe")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    # -- pages -----------------------------------------------------------------------------------------------
    def open(self, path: Path, width: int = 1200, height: int = 800) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                          "mobile": False})
        page.send("Page.navigate", {"url": Path(path).resolve().as_uri()})
        self.wait_event("Page.loadEventFired", session)
        return page

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def eval(self, expression: str):
        """The value of a JavaScript expression (JSON-able), or BrowserError with the page's exception."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression[:80]}: {r['exceptionDetails'].get('exception', r['exceptionDetails'])}")
        return r["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the middle of the first element ``selector`` matches."""
        box = self.eval(f"(function(){{var e=document.querySelector({json.dumps(selector)});"
                        f"if(!e) return null; e.scrollIntoView({{block:'center'}}); var r=e.getBoundingClientRect();"
                        f"return [r.left + r.width/2, r.top + r.height/2];}})()")
        if box is None:
            raise BrowserError(f"no element matches {selector!r}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def screenshot(self, selector: str | None = None) -> bytes:
        """A PNG of the page, or of the box of the element ``selector`` matches."""
        params: dict = {"format": "png", "captureBeyondViewport": True}
        if selector is not None:
            r = self.eval(f"(function(){{var r=document.querySelector({json.dumps(selector)})"
                          f".getBoundingClientRect();"
                          f"return [r.left + scrollX, r.top + scrollY, r.width, r.height];}})()")
            params["clip"] = {"x": r[0], "y": r[1], "width": r[2], "height": r[3], "scale": 1}
        return base64.b64decode(self.send("Page.captureScreenshot", params)["data"])
