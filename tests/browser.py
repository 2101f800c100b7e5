"""A real headless Chromium (Debian's `chromium` package) driven over the DevTools protocol on a pipe (fds 3/4,
`--remote-debugging-pipe`: no port, no websocket library). Opens one page and reports what a test asserts on:
console errors, uncaught exceptions, every network request, a JS probe of the DOM, and a PNG screenshot.
The browser runs in its own process group, which is killed by its id at the end."""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe"]
WINDOW = (1280, 900)


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageReport:
    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    probe: object = None
    screenshot_png: bytes = b""


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int):
        self.w, self.r, self.buf, self.next_id = write_fd, read_fd, b"", 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 60):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        want = self.next_id
        while True:
            m = self.read(timeout_s)
            if m.get("id") == want:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self.r, 1 << 16)
            if not chunk:
                raise EOFError("chromium closed the pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def wait_event(self, method: str, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self.read(max(0.1, deadline - time.monotonic())))


def open_page(url: str, probe_js: str, timeout_s: float = 120, window: tuple[int, int] = WINDOW
              ) -> PageReport:
    """Load `url` in a fresh headless Chromium (new profile dir, a `window` of width x height px), evaluate
    `probe_js` (its JSON-able value is
    `probe`), take a full-page screenshot, close the browser and kill its process group."""
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("chromium")
    profile = tempfile.mkdtemp(prefix="reval-chromium-")
    log = open(os.path.join(profile, "stderr.log"), "wb")  # noqa: SIM115 — closed in the finally below
    cmd_r, cmd_w = os.pipe()
    res_r, res_w = os.pipe()

    # the protocol's fixed fds: 3 = commands in, 4 = answers out. A small exec trampoline moves our pipe ends
    # there (dup first: they may be 3 or 4 themselves) and execs chromium, which keeps the pid we started:
    # the leader of its own process group.
    hop = ("import os, sys; a, b = os.dup(int(sys.argv[1])), os.dup(int(sys.argv[2])); os.dup2(a, 3); "
           "os.dup2(b, 4); os.set_inheritable(3, True); os.set_inheritable(4, True); "  # dup2(3, 3) keeps CLOEXEC
           "os.execv(sys.argv[3], sys.argv[3:])")
    proc = subprocess.Popen([sys.executable, "-c", hop, str(cmd_r), str(res_w), exe, *FLAGS,
                             f"--window-size={window[0]},{window[1]}", f"--user-data-dir={profile}",
                             "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                            pass_fds=(cmd_r, res_w), start_new_session=True)
    os.close(cmd_r)
    os.close(res_w)
    pipe, rep = _Pipe(cmd_w, res_r), PageReport()
    try:
        try:
            pipe.send("Browser.getVersion", timeout_s=timeout_s)
        except (OSError, EOFError, TimeoutError) as e:
            log.flush()
            with open(os.path.join(profile, "stderr.log"), "rb") as f:
                tail = f.read()[-1500:].decode(errors="replace")
            raise RuntimeError(f"chromium did not start ({e!r}); its stderr ends:\n{tail}") from None
        target = pipe.send("Target.createTarget", {"url": "about:blank"}, timeout_s=timeout_s)["targetId"]
        sid = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            pipe.send(f"{domain}.enable", session=sid)
        pipe.send("Page.navigate", {"url": url}, session=sid)
        pipe.wait_event("Page.loadEventFired", timeout_s)
        value = pipe.send("Runtime.evaluate", {"expression": probe_js, "returnByValue": True}, session=sid)
        rep.probe = value.get("result", {}).get("value")
        shot = pipe.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=sid)
        rep.screenshot_png = base64.b64decode(shot["data"])
        for ev in pipe.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                rep.console_errors.append(json.dumps(p.get("args"))[:300])
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                rep.console_errors.append(p["entry"].get("text", "")[:300])
            elif m == "Runtime.exceptionThrown":
                rep.exceptions.append(json.dumps(p.get("exceptionDetails"))[:300])
            elif m == "Network.requestWillBeSent":
                rep.requests.append(p.get("request", {}).get("url", ""))
        try:
            pipe.send("Browser.close", timeout_s=10)
        except (EOFError, TimeoutError, RuntimeError):
            pass
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its process group (renderers, zygote), by the id we started
        except ProcessLookupError:
            pass
        proc.wait()
        os.close(cmd_w)
        os.close(res_r)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)
    return rep
