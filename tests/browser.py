"""A minimal headless-Chromium driver over the DevTools protocol on a pipe (--remote-debugging-pipe): no
websocket, no Selenium/Playwright, only the Debian `chromium` package and the standard library.

    with Chromium() as browser:
        page = browser.open("file:///.../step_000024.html")        # waits for the load event
        page.evaluate("document.querySelectorAll('.block').length")
        page.screenshot("viewer.png")
        page.errors      # uncaught exceptions, console.error/assert, error log entries
        page.requests    # every URL the page asked for (a self-contained page asks for none but its own file)

Also a command line, to refresh the README's screenshot (optionally after clicking the element a CSS selector
names): python tests/browser.py PAGE.html OUT.png [WIDTH [HEIGHT [CLICK_SELECTOR]]]
"""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_chromium() -> str | None:
    """$CHROMIUM, else the first of NAMES on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next((path for path in map(shutil.which, NAMES) if path), None)


class Chromium:
    def __init__(self, executable: str | None = None, width: int = 1200, height: int = 800,
                 timeout: float = 60.0):
        self.executable = executable or find_chromium()
        if not self.executable:
            raise FileNotFoundError("no Chromium found (apt-get install chromium, or set $CHROMIUM)")
        self.width, self.height, self.timeout = width, height, timeout
        self._id = 0
        self._buffer = b""
        self.events: list[dict] = []

    # ---- process and pipe ----
    def __enter__(self) -> "Chromium":
        self._profile = tempfile.mkdtemp(prefix="chromium-")
        self._log = open(os.path.join(self._profile, "stderr.txt"), "w+")
        to_browser_r, self._to_browser = os.pipe()       # we write, Chromium reads on fd 3
        self._from_browser, from_browser_w = os.pipe()   # Chromium writes on fd 4, we read
        # Chromium expects the pipe on fds 3 and 4. Its ends are first moved above 9 so that placing one
        # cannot overwrite the other; the child then dup2()s them into place (dup2 clears close-on-exec, and
        # fds that Python opens are close-on-exec already, so close_fds=False leaks nothing else).
        to_browser_r, from_browser_w = (self._high(fd) for fd in (to_browser_r, from_browser_w))

        args = ["--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--hide-scrollbars", "--mute-audio",
                "--disable-background-networking", "--disable-component-update",
                f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}",
                "about:blank"]

        def pipe_on_3_and_4(r=to_browser_r, w=from_browser_w):
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen([self.executable, *args], preexec_fn=pipe_on_3_and_4, close_fds=False,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(to_browser_r)
        os.close(from_browser_w)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._send("Browser.close", {}, wait=False)
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    @staticmethod
    def _high(fd: int) -> int:
        import fcntl

        high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
        os.close(fd)
        return high

    def stderr_tail(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-2000:]

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {self.timeout:.0f}s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise ConnectionError(f"Chromium closed the DevTools pipe (exit code {self.proc.poll()}): "
                                      f"{self.stderr_tail()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _send(self, method: str, params: dict, session: str | None = None, wait: bool = True) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise ConnectionError(f"Chromium exited (code {self.proc.poll()}): "
                                  f"{self.stderr_tail()}") from None
        if not wait:
            return {}
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _wait_event(self, method: str, session: str) -> dict:
        deadline = time.monotonic() + self.timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            seen = len(self.events)
            self.events.append(self._read_message(deadline))

    # ---- pages ----
    def open(self, url: str) -> "Page":
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self._send(f"{domain}.enable", {}, session)
        self._send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                           "deviceScaleFactor": 1, "mobile": False}, session)
        self._send("Page.navigate", {"url": url}, session)
        self._wait_event("Page.loadEventFired", session)
        return Page(self, session)


class Page:
    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session

    def _events(self, method: str) -> list[dict]:
        return [e["params"] for e in self.browser.events
                if e.get("method") == method and e.get("sessionId") == self.session]

    def evaluate(self, expression: str):
        result = self.browser._send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                         "awaitPromise": True}, self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    @property
    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error / console.assert calls and error-level log entries (e.g. a
        resource that failed to load), as text."""
        out = [json.dumps(e["exceptionDetails"])[:500] for e in self._events("Runtime.exceptionThrown")]
        out += [f"console.{e['type']}: "
                + " ".join(str(a.get("value", a.get("description"))) for a in e["args"])
                for e in self._events("Runtime.consoleAPICalled") if e["type"] in ("error", "assert")]
        out += [f"log {e['entry']['source']}: {e['entry']['text']}" for e in self._events("Log.entryAdded")
                if e["entry"]["level"] == "error"]
        return out

    @property
    def requests(self) -> list[str]:
        return [e["request"]["url"] for e in self._events("Network.requestWillBeSent")]

    def screenshot(self, path, full_page: bool = True) -> None:
        """A PNG of the page; full_page: the whole document, not just the window."""
        params = {"format": "png"}
        if full_page:
            size = self.browser._send("Page.getLayoutMetrics", {}, self.session)["cssContentSize"]
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"],
                                                             "height": size["height"], "scale": 1})
        data = self.browser._send("Page.captureScreenshot", params, self.session)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))


if __name__ == "__main__":
    page_path, out = sys.argv[1], sys.argv[2]
    size = [int(x) for x in sys.argv[3:5]] + [1200, 800][len(sys.argv[3:5]):]
    with Chromium(width=size[0], height=size[1]) as chromium:
        page = chromium.open("file://" + os.path.abspath(page_path))
        if len(sys.argv) > 5:
            page.evaluate(f"document.querySelector({json.dumps(sys.argv[5])}).dispatchEvent("
                          "new MouseEvent('click', {bubbles: true}))")
        page.screenshot(out)
        print(f"wrote {out}; errors: {page.errors or 'none'}")
