"""minillm.bench (chapter 3's benchmark command): results that explain themselves, every
argument checked before any work, CSV files that are never half-written, and the recorded
reference data in data/benchmarks/ left alone unless asked for."""
import errno
import os

import pytest
import torch

from helpers import TINY, forbid
from minillm.bench import cli, measure, results
from minillm.bench import kv as bench
from minillm.memory import kv_cache_bytes
from minillm.utils import repo_root

SMALL_RUN = ["--new-tokens", "3", "--prompt-tokens", "8", "--repeats", "1"]


@pytest.fixture(scope="module")
def result(folder):
    return bench.run_kv_benchmark(folder, new_tokens=5, prompt_tokens=20, repeats=2,
                                  device="cpu", progress=False)


def test_benchmark_rows_steps_and_memory(result, folder):
    assert [r["method"] for r in result.rows] == [
        "naive loop", "KV cache (minillm)", "transformers generate()"]
    assert all(r["same_tokens"] for r in result.rows)
    steps = result.series("steps", "seconds")  # each token's time, per method
    assert all(len(s) == 4 for s in steps.values())  # tokens 2..5
    assert all(t > 0 for s in steps.values() for t in s)
    model = bench.load_model(folder, dtype=torch.float32, device="cpu")
    weights = measure.weight_nbytes(model)
    assert result.rows[0]["memory_MiB"] * 2**20 == pytest.approx(weights)  # naive: no cache
    assert result.rows[1]["memory_MiB"] * 2**20 == pytest.approx(
        weights + kv_cache_bytes(TINY, 26, 1, torch.float32))  # + the spare slot
    assert result.rows[0]["speedup_vs_first"] == 1.0
    assert result.ratio("naive loop", "KV cache (minillm)") == pytest.approx(
        result.rows[1]["speedup_vs_first"])
    assert result.info["prompt_tokens"] == 20 and result.info["new_tokens"] == 5
    line = result.describe()
    assert "20-token prompt + 5 new tokens" in line and "median of 2" in line


def test_table_and_csv_files(result, tmp_path):
    assert "KV cache (minillm)" in bench.format_table(result)
    summary, steps = bench.write_csv(result, tmp_path / "csv")
    assert summary.name == "kv_tiny-model_cpu.csv"  # the space is not kept in a file name
    text = summary.read_text()
    assert text.count("\n") == 4 and "hardware" in text and "memory_MiB" in text
    assert steps.read_text().count("\n") == 1 + 3 * 4
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == sorted(
        [summary.name, steps.name])  # no temporary files left behind


def test_a_failed_write_keeps_the_old_files(result, tmp_path, monkeypatch):
    summary, steps = bench.write_csv(result, tmp_path)
    before = summary.read_text(), steps.read_text()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(results.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        bench.write_csv(result, tmp_path)
    assert (summary.read_text(), steps.read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([summary.name, steps.name])


def test_run_kv_benchmark_checks_its_arguments(folder):
    for kwargs, match in [(dict(new_tokens=1), "new_tokens=1"),
                          (dict(new_tokens=True), "new_tokens=True"),
                          (dict(prompt_tokens=0), "prompt_tokens=0"),
                          (dict(repeats=0), "repeats=0"),
                          (dict(repeats=1.5), "repeats=1.5"),
                          (dict(methods=("fast",)), "methods"),
                          (dict(methods="naive"), "methods"),
                          (dict(prompt_tokens=100, new_tokens=30), "context of 128")]:
        with pytest.raises(ValueError, match=match):
            bench.run_kv_benchmark(folder, **kwargs)
    with pytest.raises(FileNotFoundError, match="config.json"):
        bench.run_kv_benchmark(folder / "missing")


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if a benchmark starts: bad arguments must stop the command before."""
    forbid(monkeypatch, bench, "run_kv_benchmark",
           "the benchmark started despite a bad argument")


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads=0: allowed 1 to"),
    (["--threads", "50000"], "--threads=50000: allowed 1 to"),
    (["--repeats", "0"], "repeats=0"),
    (["--new-tokens", "1"], "new_tokens=1"),
    (["--prompt-tokens", "0"], "prompt_tokens=0"),
    (["--prompt-tokens", "120", "--new-tokens", "20"], "context of 128"),
    (["--new-tokens", "many"], "invalid int value: 'many'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments_stop_before_any_work(folder, tmp_path, no_run, capsys, args, message):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--model", str(folder), "--out", str(tmp_path / "out"), *args])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_model_and_unusable_out_folder(folder, tmp_path, no_run, capsys):
    a_file = tmp_path / "a-file.csv"
    a_file.write_text("x")
    for args, message in [(["--model", "no-such-model"], "model='no-such-model'; allowed"),
                          (["--out", str(a_file)], "exists and is not a folder"),
                          (["--out", str(a_file / "sub")], "cannot write there")]:
        with pytest.raises(SystemExit) as stop:
            bench.main(["--model", str(folder), *args])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(folder, tmp_path, no_run, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--model", str(folder), "--device", "cuda",
                    "--out", str(tmp_path)])
    assert "cuda" in capsys.readouterr().err


def test_the_command_writes_outside_the_reference_data(folder, tmp_path, monkeypatch,
                                                       capsys):
    reference = repo_root() / "data" / "benchmarks"
    before = {p.name: p.read_bytes() for p in reference.glob("*.csv")}
    threads = torch.get_num_threads()
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--model", str(folder), "--threads", "1", *SMALL_RUN]) == 0
    written = tmp_path / cli.DEFAULT_OUT / "kv_tiny-model_cpu.csv"
    assert written.is_file() and f"wrote {cli.DEFAULT_OUT}" in capsys.readouterr().out
    assert "torch threads: 1" in written.read_text()  # --threads applied to the run
    assert torch.get_num_threads() == threads  # ... and restored afterwards
    assert {p.name: p.read_bytes() for p in reference.glob("*.csv")} == before
    assert not (reference.resolve() / "kv_tiny-model_cpu.csv").exists()


def test_a_write_error_after_the_run_is_reported(folder, tmp_path, monkeypatch, capsys):
    def full_disk(result, out):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(bench, "write_csv", full_disk)
    assert bench.main(["--model", str(folder), "--out", str(tmp_path),
                       *SMALL_RUN]) == 1
    captured = capsys.readouterr()
    assert "KV cache (minillm)" in captured.out  # the table was printed before
    assert "could not write the CSV files" in captured.err


def test_no_csv_writes_nothing(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--model", str(folder), "--no-csv", *SMALL_RUN]) == 0
    assert os.listdir(tmp_path) == []


def test_recorded_reference_data_is_complete():
    """The chapter reads these files; each names its hardware and has every method."""
    import csv
    reference = repo_root() / "data" / "benchmarks"
    for name in ("bundled", "smollm2-135m"):
        rows = list(csv.DictReader((reference / f"kv_{name}_cpu.csv").open()))
        assert [r["method"] for r in rows] == [
            "naive loop", "KV cache (minillm)", "transformers generate()"]
        assert all(r["hardware"] and float(r["memory_MiB"]) > 0 for r in rows)
        steps = list(csv.DictReader((reference / f"kv_{name}_cpu_steps.csv").open()))
        assert len(steps) == 3 * (int(rows[0]["new_tokens"]) - 1)
