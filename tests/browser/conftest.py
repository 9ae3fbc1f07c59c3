"""Fixtures for the browser test: the built website served on 127.0.0.1 and Debian's
headless Chromium driven by Playwright (never a browser that Playwright downloads)."""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("MINILLM_SITE", ROOT / "_build" / "html"))
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]


def chromium_path() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail(f"no Chromium at {path}: install Debian's package (apt-get install "
                    "chromium; .ci/run does) or set CHROMIUM to its path", pytrace=False)
    return path


@pytest.fixture(scope="session")
def site() -> Path:
    if not (SITE / "index.html").exists():
        pytest.fail(f"no website at {SITE}: build it first with `make site`", pytrace=False)
    return SITE


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def base_url(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="session")
def context(browser, base_url):
    width = int(os.environ.get("MINILLM_BROWSER_WIDTH", "1280"))  # px; a phone: 400
    ctx = browser.new_context(viewport={"width": width, "height": 900})
    def route(route):  # the site is read offline too: it must need nothing else
        if route.request.url.startswith(base_url):
            return route.continue_()
        return route.abort()  # nothing leaves the machine (MathJax is the site's own)

    ctx.route("**/*", route)
    yield ctx
    ctx.close()
