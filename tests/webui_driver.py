"""Drive the chat page at ``/`` in headless Chromium (Debian's ``chromium`` + ``chromium-driver``).

Helpers for ``test_webui_browser.py``: find the browser (or say why it is missing, so the test can
skip with that reason), start it, and do what a user does on the page (type, attach, send, stop),
waiting on the page's own ``data-state`` of the last reply rather than on sleeps.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import time
import urllib.request
from pathlib import Path

REPLY_DONE = ("done", "stopped", "error")


def missing_browser() -> str | None:
    """Why the browser test cannot run here (None when it can)."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[test]')"
    for exe, pkg in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(exe) is None:
            return f"{exe} is not on PATH (apt-get install -y {pkg})"
    return None


def start_chromium():
    """A headless Chromium through the system chromedriver (never Selenium Manager's downloads)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,760", "--force-device-scale-factor=1", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--force-color-profile=srgb"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=opts)
    driver.set_script_timeout(30)
    return driver


class Page:
    """The chat page in one browser tab."""

    def __init__(self, driver, base: str, timeout: float = 30.0):
        self.d, self.base, self.timeout = driver, base, timeout

    def wait(self, what, message: str, timeout: float | None = None):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.d, timeout or self.timeout, poll_frequency=0.05).until(lambda _: what(), message)

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def open(self, *, expect_key: bool = False) -> None:
        self.d.get(self.base + "/")
        self.wait(lambda: self.js("return !!window.ds4page"), "the page's scripts did not load")
        if not expect_key:
            self.wait(lambda: self.text("model") not in ("connecting…", ""), "the model name never showed")

    def text(self, element_id: str) -> str:
        return self.js("const e = document.getElementById(arguments[0]); return e ? e.textContent : ''", element_id)

    def set(self, element_id: str, value) -> None:
        """Set an input (value or checkbox) as the user would, change event included."""
        self.js("const e = document.getElementById(arguments[0]);"
                "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];"
                "e.dispatchEvent(new Event('change'));", element_id, value)

    def attach(self, path: Path) -> None:
        from selenium.webdriver.common.by import By

        before = self.js("return document.querySelectorAll('#attachments .thumb').length")
        self.d.find_element(By.ID, "file").send_keys(str(path.resolve()))
        self.wait(lambda: self.js("return document.querySelectorAll('#attachments .thumb').length") > before,
                  "the attached image has no thumbnail")

    def send(self, prompt: str) -> int:
        """Type and send; returns the number of replies before this one (its index)."""
        from selenium.webdriver.common.by import By

        n = self.replies()
        box = self.d.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(prompt)
        self.d.find_element(By.ID, "send").click()
        self.wait(lambda: self.replies() > n, "no reply bubble appeared")
        return n

    def replies(self) -> int:
        return self.js("return document.querySelectorAll('#messages .msg.assistant').length")

    def reply(self, index: int = -1) -> dict:
        """State, answer text, stats and error of a reply (the last by default)."""
        return self.js("""
            const all = document.querySelectorAll('#messages .msg.assistant');
            const m = all[arguments[0] < 0 ? all.length + arguments[0] : arguments[0]];
            if (!m) return null;
            return {state: m.dataset.state, content: m.querySelector('.content').textContent,
                    stats: m.querySelector('.stats').textContent,
                    error: m.querySelector('.error').hidden ? '' : m.querySelector('.error').textContent};
        """, index)

    def ask(self, prompt: str) -> dict:
        """Send and wait for the reply to end."""
        i = self.send(prompt)
        self.wait(lambda: self.reply(i)["state"] in REPLY_DONE, f"no answer to {prompt!r}")
        return self.reply(i)

    def click(self, element_id: str) -> None:
        from selenium.webdriver.common.by import By

        self.d.find_element(By.ID, element_id).click()

    def shot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.d.save_screenshot(str(path))


def cancellations(base: str, key: str | None = None, reason: str = "client_disconnect") -> float:
    """``ds4serve_cancellations_total`` for ``reason`` from the server's /metrics."""
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    pattern = rf'^ds4serve_cancellations_total\{{[^}}]*reason="{reason}"[^}}]*\}} ([0-9.e+]+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def wait_for(fn, timeout: float, what: str):
    """Poll ``fn`` until it returns something truthy (server-side effects that lag the page)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
