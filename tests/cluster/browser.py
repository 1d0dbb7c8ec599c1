"""Headless Chromium (the Debian package) driven over the DevTools protocol: no driver binary, no
browser download, only a websocket (the `websockets` package Airflow's api-server already uses).

Enough of CDP for a test that acts as a person does: open a page, type into the focused field,
click, wait for the page to show something, read the rendered DOM (computed styles included),
and take a screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--hide-scrollbars",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Browser:
    def __init__(self, timeout_s: float = 60, window: tuple[int, int] = (1400, 1300)) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        assert binary, "chromium not installed: `apt-get install -y chromium` (make test does it)"
        self.profile = Path(tempfile.mkdtemp(prefix="eagle3-chromium-"))
        self.proc = subprocess.Popen(
            [
                binary,
                *CHROMIUM_FLAGS,
                f"--window-size={window[0]},{window[1]}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert self.proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, open_timeout=timeout_s)
        self._id = 0
        self.timeout_s = timeout_s
        self.send("Page.enable")
        self.send("Runtime.enable")

    def send(self, method: str, **params):
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=self.timeout_s))
            if msg.get("id") == self._id:
                assert "error" not in msg, f"{method}: {msg['error']}"
                return msg.get("result", {})

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def js(self, expression: str, attempts: int = 20):
        """The value of a JS expression in the page (awaited if a promise); retried while the
        page is between two documents (a navigation destroys the context mid-call)."""
        for attempt in range(attempts):
            try:
                out = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
                break
            except AssertionError as exc:
                if attempt == attempts - 1 or not any(m in str(exc) for m in ("navigated", "context", "closed")):
                    raise
                time.sleep(0.25)
        assert "exceptionDetails" not in out, out["exceptionDetails"]
        return out["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 120) -> None:
        """Poll until the expression is truthy in the page (tested there: a DOM node does not
        survive the trip to Python by value)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.js(f"Boolean({expression})"):
                    return
            except AssertionError:  # an exception in the page, e.g. a frame not loaded yet
                pass
            time.sleep(0.3)
        raise AssertionError(
            f"page never showed {what}; url {self.js('location.href')}; text: "
            f"{self.js('document.body && document.body.innerText')!r:.1500}"
        )

    def type_into(self, selector: str, text: str) -> None:
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", text=text)

    def click(self, selector: str) -> None:
        self.js(f"document.querySelector({json.dumps(selector)}).click()")

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            os.killpg(self.proc.pid, signal.SIGKILL)  # renderers and the zygote too
            self.proc.wait(10)
            shutil.rmtree(self.profile, ignore_errors=True)
