"""Debian's Chromium, headless, driven over the DevTools protocol (no driver, no browser download).

`with Chromium(profile) as browser:` starts it with an empty profile and the flags a closed network
needs (no background connections, no component updates), attaches to its first tab, and records
every console error, uncaught exception and browser log error for the tests to check.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import pathlib
import shutil
import subprocess
import time
import urllib.request
from typing import Any

import websocket

FLAGS = [
    "--headless",
    "--no-sandbox",  # root in a container: the sandbox needs user namespaces it may not have
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
]


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(Exception):
    pass


class Chromium:
    def __init__(self, profile: pathlib.Path, width: int = 1280, height: int = 1000, flags: tuple[str, ...] = ()):
        self.profile, self.size, self.flags = profile, (width, height), list(flags)
        self.process: subprocess.Popen | None = None
        self.socket: websocket.WebSocket | None = None
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []  # console errors, exceptions, browser log errors, in order

    def __enter__(self) -> Chromium:
        binary = chromium_binary()
        if binary is None:
            raise BrowserError("no chromium (scripts/bootstrap --test installs Debian's)")
        self.profile.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                binary,
                *FLAGS,
                *self.flags,
                "--user-data-dir=%s" % self.profile,
                "--window-size=%d,%d" % self.size,
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise BrowserError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen("http://127.0.0.1:%d/json/list" % port, timeout=10) as response:
            tabs = [tab for tab in json.load(response) if tab["type"] == "page"]
        self.socket = websocket.create_connection(tabs[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        for domain in ("Page", "Runtime", "Log", "DOM"):
            self.send(domain + ".enable")
        return self

    def __exit__(self, *exc) -> None:
        if self.socket is not None:
            with contextlib.suppress(BrowserError, OSError, websocket.WebSocketException):
                self.send("Browser.close")
            self.socket.close()
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    # -- the protocol -------------------------------------------------------------------------

    def _record(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(
                "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append("exception: " + details.get("exception", {}).get("description", details.get("text")))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append("log: %s (%s)" % (params["entry"]["text"], params["entry"].get("url", "")))
        self.events.append(message)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise BrowserError("%s: %s" % (method, message["error"]))
                return message.get("result", {})
            self._record(message)

    def evaluate(self, expression: str) -> Any:
        """A JavaScript expression's value in the page (promises awaited); page errors raise."""
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError("%s: %s" % (expression, result["exceptionDetails"]))
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60, what: str | None = None) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError("timed out waiting for %s" % (what or expression))
            time.sleep(0.1)

    # -- what the tests do --------------------------------------------------------------------

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", what="the page to load")

    def set_files(self, selector: str, *paths: pathlib.Path) -> None:
        """Pick files in a file input, as a person would with the file dialog (fires its change event)."""
        root = self.send("DOM.getDocument")["root"]["nodeId"]
        node = self.send("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        self.send("DOM.setFileInputFiles", files=[str(p) for p in paths], nodeId=node)

    def click(self, selector: str) -> None:
        self.evaluate("document.querySelector(%s).click()" % json.dumps(selector))

    def text(self, selector: str) -> str:
        return self.evaluate("document.querySelector(%s).textContent" % json.dumps(selector))

    def screenshot(self, path: pathlib.Path) -> pathlib.Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
