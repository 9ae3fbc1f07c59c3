"""`make gpu-check`'s dry run (GPU_CHECK_DRY=1), here on a CPU: every command of the GPU
check runs its argument checks, pytest only collects, and the result files are laid out
as on a GPU, so that a typo cannot waste a GPU session's minutes."""
import os
import re
import subprocess
import sys

import pytest

from minillm.bench import cli
from minillm.utils import repo_root

SCRIPT = repo_root() / "tools" / "gpu_check.sh"


def dry_run(out, **env):
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out),
           "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-results")
    return out, dry_run(out, ARCHIVE=str(out.parent / "results.tar.gz"))


def test_the_dry_run_checks_every_command_and_lays_out_the_files(full):
    out, run = full
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "gpu_check: dry run: all green" in run.stdout
    assert {p.name for p in out.iterdir()} >= {
        "versions.txt", "bench.txt", "unit.txt", "chapters.txt"}
    assert "dry run, no GPU" in (out / "versions.txt").read_text()
    bench = (out / "bench.txt").read_text()
    for command in ("decode --model Llama-2-7B --fast int8 int4",
                    "decode --model SmolLM2-135M", "article --model Llama-2-7B",
                    "decode --model Llama-2-7B --compile", "spec --model bundled",
                    "structured --model bundled"):
        assert f"dry run: python -m minillm.bench {command}" in bench, bench
    assert f"--compile --out {out}/compile:" in bench  # its own folder: no overwrite
    assert not list(out.glob("*.csv"))  # nothing was measured
    unit = (out / "unit.txt").read_text()
    assert "test_cuda.py" in unit and "test_engine.py" not in unit  # -m cuda only
    chapters = (out / "chapters.txt").read_text()
    assert "00_overview.ipynb" in chapters and "08_troubleshooting.ipynb" in chapters
    # chapter 7 alone and first (its timings are recorded), the others in 3 processes
    logs = sorted(out.glob("chapters_*.txt"))
    assert [p.name for p in logs] == [f"chapters_{k}.txt" for k in range(4)]
    alone = logs[0].read_text()
    assert "07_performance.ipynb" in alone and "08_troubleshooting" not in alone
    each = [{m for m in re.findall(r"chapters/(\d\d)_", p.read_text())} for p in logs]
    numbers = {p.name[:2] for p in (repo_root() / "chapters").glob("*.ipynb")}
    assert set().union(*each) == numbers
    assert sum(len(e) for e in each) == len(numbers)  # each chapter runs once


def test_archive_packs_every_result_into_one_file(full):
    import tarfile
    out, run = full
    with tarfile.open(out.parent / "results.tar.gz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    assert names >= {"versions.txt", "bench.txt", "unit.txt", "chapters.txt",
                     "chapters_0.txt", "compile"}
    assert "gpu_check: packed" in run.stdout


@pytest.mark.parametrize("env, message", [
    (dict(PARALLEL="0", STEPS="chapters"), "PARALLEL='0'"),
    (dict(STEPS="bench units"), "unknown step 'units'"),
    (dict(STEPS="chapters", CHAPTERS="chapters/no_such.ipynb"), "no_such.ipynb"),
])
def test_a_typo_fails_the_dry_run(tmp_path, env, message):
    archive = tmp_path.parent / f"{tmp_path.name}.tar.gz"
    run = dry_run(tmp_path, ARCHIVE=str(archive), **env)
    assert run.returncode != 0
    assert message in run.stdout + run.stderr
    assert archive.is_file()  # what it saw (the versions) is packed all the same


def test_a_benchmark_stops_after_its_checks_in_a_dry_run(tmp_path, monkeypatch, capsys):
    ran = []
    main = cli.command(lambda: _parser(), lambda args: "checked",
                       lambda args, checked: ran.append(checked))
    monkeypatch.setenv("MINILLM_BENCH_DRY_RUN", "1")
    assert main(["--out", str(tmp_path)]) == 0
    assert ran == [] and "arguments checked, nothing run" in capsys.readouterr().out


def _parser():
    import argparse
    parser = argparse.ArgumentParser(prog="python -m minillm.bench fake")
    cli.add_run_arguments(parser)
    return parser


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs no GPU")
def test_without_a_gpu_the_real_check_refuses_to_start(tmp_path):
    run = dry_run(tmp_path, GPU_CHECK_DRY="0")
    assert run.returncode == 2
    assert "no CUDA GPU" in run.stderr and "GPU_CHECK_DRY=1" in run.stderr
    assert not (tmp_path / "bench.txt").exists()  # nothing started
