"""The command line (issue 38): `python -m minillm --help` lists the commands, `serve
--help` shows every flag with a help text and its default, a bad value is argparse's
usage error (status 2, no traceback), and the flags vLLM users reach for (--api-key,
--seed, --quantization, --chat-template, --[no-]enable-prefix-caching) reach the
server they start."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from test_serve import NAME, PLAY

from minillm.__main__ import main as minillm_main
from minillm.serve import cli
from minillm.serve.cli import BackgroundServer
from minillm.utils import bundled_model_path

ROOT = Path(__file__).resolve().parent.parent
NEW_FLAGS = ["--api-key", "--seed", "--quantization", "--chat-template",
             "--enable-prefix-caching", "--no-enable-prefix-caching"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_python_m_minillm_help_lists_the_commands():
    done = run("--help")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for command in ["serve", "bench"]:  # each with its one line of help
        line = next(x for x in lines if x.strip().startswith(command + " "))
        assert len(line.split()) > 3, line
    assert "serve --help" in done.stdout  # where to read on


def test_main_usage_and_exit_status(capsys):
    assert minillm_main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert minillm_main([]) == 2  # no command: the usage, on stderr
    assert "serve" in capsys.readouterr().err
    assert minillm_main(["nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert minillm_main(["bench", "--help"]) == 0
    assert "decode" in capsys.readouterr().out


def test_every_serve_flag_has_help_and_shows_its_default():
    p = cli.parser()
    assert issubclass(p.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    text = " ".join(p.format_help().split())  # unwrapped
    flags = [a for a in p._actions if a.option_strings
             and not isinstance(a, argparse._HelpAction)]
    assert len(flags) >= 15
    for a in flags:
        assert a.help and len(a.help) > 10, a.option_strings
        assert f"(default: {a.default})" in text, a.option_strings
    assert text.count("(default: ") == len(flags)  # one each, none twice
    for flag in NEW_FLAGS + ["--max-model-len", "--max-num-seqs", "--port", "--dtype"]:
        assert flag in text, flag


def test_serve_help_from_the_command_line():
    done = run("serve", "--help")
    assert done.returncode == 0, done.stderr
    for flag in NEW_FLAGS:
        assert flag in done.stdout
    assert "(default: 127.0.0.1)" in done.stdout


@pytest.mark.parametrize("args, says", [
    (["--quantization", "fp4"], "invalid choice: 'fp4'"),
    (["--seed", "abc"], "argument --seed"),
    (["--seed", "-1"], "argument --seed"),
    (["--chat-template", "no/such/file.jinja"], "argument --chat-template"),
    (["--log-level", "loud"], "invalid choice"),
    (["--port", "99999"], "argument --port"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_values_are_usage_errors(capsys, args, says):
    with pytest.raises(SystemExit) as e:
        cli.parser().parse_args([str(bundled_model_path()), *args])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_a_value_the_engine_refuses_is_a_usage_error_not_a_traceback():
    done = run("serve", str(bundled_model_path()), "--max-num-seqs", "0")
    assert done.returncode == 2, done.stderr
    assert "max_num_seqs=0" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture
def started(monkeypatch):
    """main(argv) with uvicorn.run caught: returns the app it would have served."""
    apps = []
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kw: apps.append((app, kw)))

    def start(*flags: str):
        assert cli.main([str(bundled_model_path()), "--served-model-name", NAME,
                         "--max-model-len", "256", *flags]) == 0
        return apps[-1]
    return start


def test_the_new_flags_reach_the_engine_and_the_app(started, tmp_path):
    template = tmp_path / "play.jinja"
    template.write_text(PLAY, encoding="utf-8")
    app, kw = started("--seed", "7", "--quantization", "w8a16", "--chat-template",
                      str(template), "--no-enable-prefix-caching", "--api-key", "k",
                      "--port", "8123")
    assert kw["port"] == 8123
    engine = app.state.server.engine.engine
    assert engine.runner.default_generator.initial_seed() == 7
    assert engine.tokenizer.chat_template == PLAY
    assert "Int8Linear" in {type(m).__name__ for m in engine.model.modules()}
    assert engine.kv.prefix_caching is False
    with BackgroundServer(app) as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == NAME
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          headers={"Authorization": "Bearer k"},
                          json={"model": NAME, "max_tokens": 2, "messages": [
                              {"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text


def test_chat_template_as_text_and_prefix_caching_on(started):
    app, _ = started("--chat-template", PLAY, "--enable-prefix-caching")
    engine = app.state.server.engine.engine
    assert engine.tokenizer.chat_template == PLAY
    assert engine.kv.prefix_caching is True
    assert engine.runner.default_generator is None  # no --seed: torch's own


def test_serve_on_a_cpu_computes_at_most_a_chunk_of_256_tokens_a_step(monkeypatch):
    """A step of the engine's default budget (2048 tokens) takes seconds on a CPU, and
    nobody else gets a token meanwhile: `serve` chunks long prompts at 256 tokens there
    (--max-num-batched-tokens, vLLM's flag), and never below --max-num-seqs."""
    import torch
    from minillm.serve import cli
    monkeypatch.setattr(cli, "pick_device", lambda: torch.device("cpu"))
    parse = cli.parser().parse_args
    assert cli.engine_args(parse(["m"]))["max_num_batched_tokens"] == 256
    assert cli.engine_args(parse(["m", "--max-num-seqs", "300"]))[
        "max_num_batched_tokens"] == 300
    assert cli.engine_args(parse(["m", "--max-num-batched-tokens", "1024"]))[
        "max_num_batched_tokens"] == 1024
    off = cli.engine_args(parse(["m", "--no-enable-chunked-prefill"]))
    assert off["enable_chunked_prefill"] is False and "max_num_batched_tokens" not in off
    monkeypatch.setattr(cli, "pick_device", lambda: torch.device("cuda"))
    assert "max_num_batched_tokens" not in cli.engine_args(parse(["m"]))
