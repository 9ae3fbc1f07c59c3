"""minillm.bench.spec (chapter 10's benchmark): every way of decoding, in turns, on the
bundled model; in float32 speculation changes no answer; the CSV explains itself; every
argument is checked before any work. Short outputs; no timed asserts."""
import csv

import pytest
import torch

from minillm.bench import spec as bs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run():
    return bs.run_spec_benchmark("bundled", torch.float32, "cpu", max_tokens=12,
                                 rounds=1, ks=(2,), drafts=("int8",),
                                 concurrency=(1, 2))


def test_every_task_way_and_batch_has_a_row(run):
    rows, info = run.rows, run.info
    ways = ["plain", "ngram k=2", "draft int8 k=3"]
    assert [(r["task"], r["requests_at_once"], r["way"]) for r in rows] == [
        (t, n, w) for t in bs.TASKS for n in (1, 2) for w in ways]
    assert info["dtype"] == "float32" and info["max_tokens"] == 12


def test_in_float32_speculation_changes_no_answer(run):
    rows = run.rows
    assert all(r["answers_differing"] == 0 for r in rows)
    plain = [r for r in rows if r["way"] == "plain"]
    assert all(r["vs_plain"] == 1 and r["acceptance"] is None for r in plain)
    drafts = [r for r in rows if r["way"].startswith("draft")]
    assert all(r["acceptance"] > 0.5 for r in drafts)  # its own int8 copy agrees


def test_the_csv_names_the_hardware(run, tmp_path):
    rows = run.rows
    path, = run.write(tmp_path)
    assert path.name == "spec_bundled_cpu.csv"
    table = list(csv.DictReader(path.open()))
    assert len(table) == len(rows) and table[0]["hardware"] and table[0]["torch"]


@pytest.mark.parametrize("argv, message", [
    (["--ks", "0"], "--ks=0"), (["--concurrency", "65"], "--concurrency=65"),
    (["--max-tokens", "0"], "--max-tokens=0"), (["--model", "nope"], "nope"),
    (["--drafts", "int3"], "invalid choice")])
def test_bad_arguments_stop_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bs, "run_spec_benchmark", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        bs.main(argv + ["--no-csv"])
    assert e.value.code == 2 and message in capsys.readouterr().err
