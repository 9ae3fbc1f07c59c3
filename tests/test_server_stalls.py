"""Legal requests that once stalled every other (issue 53): a grammar compiled on the
engine thread, a schema nested hundreds of levels deep, a compiled-grammar cache that
kept 64 schemas of ~94 MB each. Each is measured against a plain request sent at the
same time, and /health, which must stay 200."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from minillm.structured.engine import structured_output_manager  # noqa: E402
from test_serve import NAME, tiny_llm, wait_idle  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm(max_num_seqs=4)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm.engine
    assert not llm.engine.requests


def in_thread(fn):
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", fn()))
    worker.start()
    return worker, out


def test_a_schema_nested_900_deep_is_refused_at_once(served):
    """Before: a 22 KB schema of 900 nested arrays compiled for 40 s on the engine
    thread. The nesting is bounded (32) before anything compiles."""
    url, engine = served
    schema: dict = {"type": "integer"}
    for _ in range(900):
        schema = {"type": "array", "items": schema}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": "A", "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}})
    assert r.status_code == 400 and "nests" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - start < 5
    assert wait_idle(url) and not engine.requests


def test_a_grammar_compiles_off_the_engine_thread(served, monkeypatch):
    """While one request's grammar compiles (here: made to take 3 s), a plain request
    sent after it is answered and /health stays 200: the engine thread never waits."""
    url, engine = served
    backend = structured_output_manager(engine).backend
    real = backend.compile

    def slow(so):
        time.sleep(3)
        return real(so)
    monkeypatch.setattr(backend, "compile", slow)
    worker, out = in_thread(lambda: httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": "A", "max_tokens": 8, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "slow", "schema": {**SCHEMA, "title": "slow"}}}}, timeout=60))
    time.sleep(0.3)  # the compile has started
    start = time.perf_counter()
    plain = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": "ROMEO:\n", "max_tokens": 4}, timeout=60)
    took = time.perf_counter() - start
    assert httpx.get(url + "/health").status_code == 200
    assert plain.status_code == 200 and took < 2.0, took
    worker.join()
    assert worker and out["r"].status_code == 200, out["r"].text


def test_a_compile_past_its_deadline_is_a_400(served, monkeypatch):
    import minillm.structured.serve as sserve
    url, engine = served
    backend = structured_output_manager(engine).backend
    real = backend.compile
    monkeypatch.setattr(sserve, "COMPILE_TIMEOUT", 0.5)
    monkeypatch.setattr(backend, "compile", lambda so: time.sleep(1.5) or real(so))
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": "A", "max_tokens": 8,
        "guided_regex": "[0-9]{3}-late"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs" and "0.5 s" in error["message"]
    time.sleep(1.2)  # the compile finishes, unseen
    assert wait_idle(url) and not engine.requests


def test_the_grammar_cache_is_bounded_in_bytes(monkeypatch):
    """Before: 64 entries, whatever their size (a schema of ~94 MB each: 6 GB). Now the
    least recently used go once the cache holds more than MAX_GRAMMAR_CACHE_BYTES."""
    from minillm.structured import engine as sengine
    from minillm.structured.params import StructuredOutputsParams

    class Compiled:
        memory_size_bytes = 40 * 2**20

    class Backend:
        calls = 0

        def compile(self, so):
            Backend.calls += 1
            return Compiled()
    manager = sengine.StructuredOutputManager(engine=None, backend="minillm")
    manager._backend = Backend()
    monkeypatch.setattr(sengine, "MAX_GRAMMAR_CACHE_BYTES", 100 * 2**20)
    keys = [StructuredOutputsParams(regex=f"a{i}") for i in range(10)]
    for so in keys:
        manager.compile(so)
    assert manager.cached_bytes <= 100 * 2**20 and len(manager.compiled) == 2
    manager.compile(keys[-1])  # the newest: still there, nothing compiled
    assert Backend.calls == 10
    manager.compile(keys[0])  # the oldest went: compiled again
    assert Backend.calls == 11


def test_a_connection_that_sends_no_whole_request_is_closed(monkeypatch):
    """Half-open sockets: uvicorn's own timer starts after a first response, so a client
    that connected and sent nothing (or half a header) held its socket for ever. Now
    each request's headers have HEADER_TIMEOUT seconds; a slow but whole request and a
    kept-alive connection still work."""
    import socket

    from minillm.serve import cli
    monkeypatch.setattr(cli, "HEADER_TIMEOUT", 0.5)
    llm = tiny_llm(max_num_seqs=2)
    with BackgroundServer(build_app(llm, NAME)) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        half = socket.create_connection(("127.0.0.1", server.port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: unfinished
        whole = socket.create_connection(("127.0.0.1", server.port))
        whole.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(1.5)
        for sock in (silent, half):
            sock.settimeout(5)
            assert sock.recv(100) == b""  # closed by the server, with no answer
        whole.settimeout(5)
        assert whole.recv(100).startswith(b"HTTP/1.1 200")
        with httpx.Client(base_url=server.url) as client:  # keep-alive: two requests
            assert client.get("/health").status_code == 200
            time.sleep(0.2)
            assert client.get("/health").status_code == 200
