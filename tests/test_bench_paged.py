"""minillm.bench.paged (chapter 6's benchmark): slots against paged KV memory on one
budget, the same tokens from every engine, prefix-cache hits with a shared prompt start,
CSV files that explain themselves, and every argument checked before any work. A tiny
model and short outputs; no timed asserts."""
import csv
import os

import pytest
import torch

from helpers import forbid
from minillm.bench import cli
from minillm.bench import paged as bp
from minillm.model.config import ModelConfig
from minillm.utils import repo_root

torch.set_num_threads(1)

# 256 positions: 4 slots of 64, or 32 blocks of 8
SMALL = dict(num_requests=6, kv_positions=256, max_model_len=64, block_size=8,
             prompt_tokens=(4, 12), output_tokens=(8, 24), device="cpu", progress=False)
SMALL_CLI = ["--requests", "4", "--kv-positions", "128", "--max-model-len", "64",
             "--block-size", "8", "--prompt-tokens", "4", "8", "--output-tokens", "2", "6"]
NAMES = ["slots", "paged", "paged + prefix cache"]


@pytest.fixture(scope="module")
def folder_weights():
    """conftest's `folder` here holds weights drawn wide: greedy outputs wander."""
    return "wide"


@pytest.fixture(scope="module")
def result(folder):
    return bp.run_paged_benchmark(folder, **SMALL)


@pytest.fixture(scope="module")
def prefixed(folder):
    """Two paged requests at a time: the later ones find the prefix cached."""
    return bp.run_paged_benchmark(folder, **{**SMALL, "shared_prefix": 24,
                                             "output_tokens": (4, 12), "max_num_seqs": 2})


def drawn(folder, **kwargs):
    args = dict(num_requests=6, prompt_tokens=(4, 12), output_tokens=(8, 24),
                shared_prefix=0, seed=0)
    return bp.paged_workload(ModelConfig.from_hf(folder), **{**args, **kwargs})


def test_rows_add_up_on_one_budget(result, folder):
    assert [r["method"] for r in result.rows] == NAMES
    total = sum(r.output_len for r in drawn(folder))
    for row in result.rows:
        assert row["requests"] == 6 and row["useful_tokens"] == total
        assert row["kv_capacity"] == 256  # the same memory for every engine
        assert row["output_tok_s"] == pytest.approx(total / row["wall_s"])
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["e2e_p99_s"]
        assert 0 < row["e2e_p50_s"] <= row["e2e_p99_s"] <= row["wall_s"]
        assert 0 < row["used_share"] <= 1  # no shared prefix: nothing counts twice
    assert result.row("slots")["max_num_seqs"] == 4  # 256 // 64 slots
    assert result.row("paged")["max_num_seqs"] == 6  # num_requests
    assert result.rows[0]["speedup_vs_first"] == 1.0
    assert result.ratio("slots", "paged") == pytest.approx(
        result.row("paged")["output_tok_s"] / result.row("slots")["output_tok_s"])
    assert result.row("paged-prefix") is result.rows[2]  # by key or by name
    assert result.info["model"] == "tiny model" and result.info["prompts"] == "random"
    assert result.info["drawn_output_tokens"] == total


def test_every_engine_makes_the_same_tokens(result, prefixed):
    for run in (result, prefixed):
        assert run.info["same_tokens_reference"] == "slots"
        assert all(r["same_tokens"] is True for r in run.rows)


def test_paged_uses_more_of_what_it_reserves(result):
    slots, paged = result.row("slots"), result.row("paged")
    assert paged["used_share"] > slots["used_share"]
    assert slots["max_running"] <= 4 < paged["max_running"] <= 6
    assert slots["preemptions"] == slots["prefix_hit_blocks"] == 0


def test_a_shared_prefix_hits_the_prefix_cache(prefixed, folder):
    requests = drawn(folder, shared_prefix=24, output_tokens=(4, 12))
    starts = {tuple(r.prompt_ids[:24]) for r in requests}
    assert len(starts) == 1  # the same 24 tokens open every prompt
    assert all(28 <= len(r.prompt_ids) <= 36 for r in requests)
    assert prefixed.row("paged")["prefix_hit_blocks"] == 0
    assert prefixed.row("paged + prefix cache")["prefix_hit_blocks"] >= 4 * 3  # 24 / 8
    assert prefixed.row("paged")["max_num_seqs"] == 2
    assert prefixed.info["shared_prefix"] == 24
    assert "shared 24-token prefix" in prefixed.describe()


def test_a_tight_pool_preempts_and_still_gives_the_same_tokens(folder):
    run = bp.run_paged_benchmark(folder, **{**SMALL, "kv_positions": 64,
                                            "methods": ("slots", "paged")})
    assert run.row("slots")["max_running"] == 1
    assert run.row("paged")["preemptions"] > 0
    assert run.row("paged")["recomputed_tokens"] > 0
    assert run.row("paged")["same_tokens"] is True


def test_online_requests_start_only_after_they_arrive(folder, tmp_path):
    run = bp.run_paged_benchmark(folder, **{**SMALL, "rate": 50.0, "shared_prefix": 8,
                                            "methods": ("paged", "slots")})
    assert run.info["arrivals"] == "Poisson 50 req/s" and run.info["rate"] == 50.0
    assert run.info["same_tokens_reference"] == "paged"
    assert all(r["same_tokens"] is True for r in run.rows)
    for r in run.rows:  # from each request's arrival, not from time 0
        assert 0 < r["ttft_p50_s"] <= r["e2e_p50_s"] < r["wall_s"]
    (path,) = bp.write_paged_csv(run, tmp_path)
    assert path.name == "paged_tiny-model_cpu_prefix8_rate50.csv"


def test_table_and_csv_files(result, prefixed, tmp_path):
    table = bp.format_paged_table(result)
    assert all(name in table for name in NAMES) and "TTFT p50/p99" in table
    (path,) = bp.write_paged_csv(result, tmp_path / "csv")
    (with_prefix,) = bp.write_paged_csv(prefixed, tmp_path / "csv")
    assert path.name == "paged_tiny-model_cpu.csv"
    assert with_prefix.name == "paged_tiny-model_cpu_prefix24.csv"
    rows = list(csv.DictReader(path.open()))
    assert [r["method"] for r in rows] == NAMES
    for column in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s",
                   "max_running", "used_share", "preemptions", "prefix_hit_blocks",
                   "same_tokens", "hardware", "torch", "kv_positions", "block_size",
                   "max_model_len", "shared_prefix", "seed"):
        assert column in rows[0], column
    assert float(rows[1]["used_share"]) == pytest.approx(
        result.row("paged")["used_share"], abs=1e-6)
    assert all(r["torch"] == torch.__version__ and r["same_tokens"] == "True"
               for r in rows)
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == sorted(
        [path.name, with_prefix.name])  # no temporary files left behind
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in (path, with_prefix))


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a model is loaded: bad arguments must stop everything before."""
    forbid(monkeypatch, bp, "load_model", "a model was loaded despite a bad argument")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_requests=0), "num_requests=0"),
    (dict(num_requests=2.0), "num_requests=2.0"),
    (dict(kv_positions=True), "kv_positions=True"),
    (dict(max_model_len=0), "max_model_len=0"),
    (dict(shared_prefix=-1), "shared_prefix=-1"),
    (dict(seed=-1), "seed=-1"),
    (dict(rate=0), "rate=0"),
    (dict(rate=float("inf")), "rate=inf"),
    (dict(max_num_seqs=0), "max_num_seqs=0"),
    (dict(block_size=12), "block_size=12: give a positive power of two"),
    (dict(methods=("pages",)), "methods=.*paged \\+ prefix cache"),
    (dict(methods=()), "methods=()"),
    (dict(methods=("paged", "paged")), "different names"),
    (dict(prompt_tokens=(0, 4)), "prompt_tokens=.0, 4."),
    (dict(output_tokens=(9, 4)), "low <= high"),
    (dict(kv_positions=32), "kv_positions=32 holds no slot of max_model_len=64"),
    (dict(max_model_len=256, kv_positions=512), "context of 128"),
    (dict(shared_prefix=40), "shared_prefix=40.*do not fit max_model_len=64"),
])
def test_bad_arguments_raise_before_any_work(folder, no_load, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bp.run_paged_benchmark(folder, **{**SMALL, **kwargs})


def test_a_missing_model_folder(tmp_path, no_load):
    with pytest.raises(FileNotFoundError, match="config.json"):
        bp.run_paged_benchmark(tmp_path / "missing", **SMALL)


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as stop:
        bp.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "python -m minillm.bench paged" in out
    assert all(flag in out for flag in ("--kv-positions", "--shared-prefix", "--methods"))


@pytest.fixture
def no_run(monkeypatch):
    forbid(monkeypatch, bp, "run_paged_benchmark",
           "the benchmark started despite a bad argument")


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads=0: allowed 1 to"),
    (["--requests", "0"], "num_requests=0"),
    (["--kv-positions", "many"], "invalid int value: 'many'"),
    (["--block-size", "3"], "block_size=3"),
    (["--rate", "-2"], "rate=-2.0"),
    (["--methods", "vllm"], "invalid choice: 'vllm'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    ([*SMALL_CLI, "--shared-prefix", "60"], "do not fit max_model_len=64"),
    (["--model", "no-such-model"], "model='no-such-model'; allowed"),
])
def test_bad_cli_arguments_exit_with_status_2(folder, tmp_path, no_run, capsys, args,
                                              message):
    with pytest.raises(SystemExit) as stop:
        bp.main(["--model", str(folder), "--out", str(tmp_path / "out"), *args])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_command_writes_its_csv_file(folder, tmp_path, monkeypatch, capsys):
    reference = repo_root() / "data" / "benchmarks"
    before = {p.name: p.read_bytes() for p in reference.glob("*.csv")}
    threads = torch.get_num_threads()
    monkeypatch.chdir(tmp_path)
    assert bp.main(["--model", str(folder), "--threads", "1", *SMALL_CLI,
                    "--shared-prefix", "8", "--methods", "slots", "paged-prefix"]) == 0
    written = tmp_path / cli.DEFAULT_OUT / "paged_tiny-model_cpu_prefix8.csv"
    out = capsys.readouterr().out
    assert written.is_file() and "paged + prefix cache" in out and "wrote" in out
    rows = list(csv.DictReader(written.open()))
    assert [r["method"] for r in rows] == ["slots", "paged + prefix cache"]
    assert "torch threads: 1" in rows[0]["hardware"]  # --threads applied to the run
    assert torch.get_num_threads() == threads  # ... and restored afterwards
    assert {p.name: p.read_bytes() for p in reference.glob("*.csv")} == before


def test_no_csv_writes_nothing(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bp.main(["--model", str(folder), "--no-csv", *SMALL_CLI,
                    "--methods", "paged"]) == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["paged_bundled_cpu.csv",
                                  "paged_bundled_cpu_prefix256.csv",
                                  "paged_bundled_cpu_prefix256_rate2.csv"])
def test_recorded_reference_data_is_complete(name):
    """The chapter reads these files: every engine, one budget, the same tokens."""
    rows = list(csv.DictReader((repo_root() / "data" / "benchmarks" / name).open()))
    assert [r["method"] for r in rows] == NAMES
    drawn_tokens = int(rows[0]["drawn_output_tokens"])
    for r in rows:
        assert r["hardware"] and r["torch"] and r["num_requests"] == "48"
        assert r["kv_capacity"] == r["kv_positions"] == "3072"
        assert int(r["useful_tokens"]) == drawn_tokens and r["same_tokens"] == "True"
    slots, paged, cached = rows
    assert float(paged["used_share"]) > float(slots["used_share"])
    assert int(paged["max_running"]) > int(slots["max_running"])
    assert int(paged["prefix_hit_blocks"]) == 0  # prefix caching off
    if int(rows[0]["shared_prefix"]) >= 256:  # 16 blocks of 16 for each later request
        assert int(cached["prefix_hit_blocks"]) >= 16 * 16
    online = rows[0]["rate"] != ""
    assert rows[0]["arrivals"] == ("Poisson 2 req/s" if online else "offline")
