"""Write requirements.lock: every distribution of the project's environment, pinned.

    python tools/lock.py                 # resolve constraints.txt + pyproject's extras afresh
    python tools/lock.py --torch-index https://download.pytorch.org/whl/cpu
    python tools/lock.py --sync          # remove what this environment has beyond the lock
    python tools/lock.py --check         # pip check, but for requirements-nodeps.txt

`constraints.txt` holds the few pins chosen by hand (torch, transformers, nbdev, ...);
this script resolves everything else in a new, empty virtual environment, the way
`make install` used to, and freezes the result, transitive dependencies included. `make
install` then installs exactly the lock (`pip install -r requirements.lock`) and minillm
itself without dependencies; tests/test_lock.py fails when the installed environment
differs from it. The package's own metadata (pyproject.toml) keeps ranges, so Colab
keeps its own torch.

Local version labels are dropped (`torch==2.13.0+cpu` is written `torch==2.13.0`), so
the lock admits PyTorch's CPU and CUDA builds of the same version alike.
"""
from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
NODEPS = ROOT / "requirements-nodeps.txt"  # installed --no-deps after the lock
EXTRAS = "book,serve,test,lab"


def run(*cmd: str) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return result.stdout


def pinned(freeze: str) -> list[str]:
    """`name==version` lines of a `pip freeze --all`, minillm left out, local labels
    dropped, sorted by name."""
    lines = []
    for line in freeze.splitlines():
        if re.match(r"minillm\b", line.strip(), re.I):  # the project itself
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^+\s]+)(\+\S+)?", line.strip())
        if not match:
            if line.strip():
                sys.exit(f"unexpected line in pip freeze: {line!r} (an editable or "
                         "URL install? the lock holds released versions only)")
            continue
        lines.append(f"{match.group(1)}=={match.group(2)}")
    return sorted(lines, key=str.lower)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a file of `name==version` lines."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            pins[canonical(name)] = version
    return pins


def read_lock(path: Path = LOCK) -> tuple[dict[str, str], str | None]:
    """({canonical name: version}, the Python "major.minor" it was resolved for)."""
    python = re.search(r"^# python: (\S+)", path.read_text(encoding="utf-8"), re.M)
    return read_pins(path), python.group(1) if python else None


def environment_pins() -> dict[str, str]:
    """What `make install` installs: the lock, and the --no-deps wheels."""
    return {**read_lock()[0], **read_pins(NODEPS)}


def installed() -> dict[str, str]:
    """{canonical name: public version} of this interpreter's environment, minillm
    left out."""
    from importlib.metadata import distributions
    # setuptools (imported by torch.compile's C++ builder) puts its own _vendor folder
    # on sys.path; the packages it vendors there are not installed ones
    paths = [p for p in sys.path if Path(p).name != "_vendor"]
    found = {}
    for dist in distributions(path=paths):
        name = canonical(dist.metadata["Name"] or "")
        if name and name != "minillm":
            found[name] = dist.version.split("+")[0]
    return found


def build_extras() -> set[str]:
    """What the installed torch requires beyond the lock: a CUDA build's own packages
    (nvidia-*, triton), which the CPU build the lock was made with does not have."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        requires = distribution("torch").requires or []
    except PackageNotFoundError:
        return set()
    return {canonical(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in requires}


def differences(pins: dict[str, str], have: dict[str, str]) -> list[str]:
    """One line per distribution where the environment and the lock disagree."""
    extras = build_extras() - set(pins)
    out = [f"{n}: lock {v}, installed {have[n]}" for n, v in sorted(pins.items())
           if n in have and have[n] != v]
    out += [f"{n}: in the lock ({v}), not installed" for n, v in sorted(pins.items())
            if n not in have]
    out += [f"{n}: installed ({v}), not in the lock" for n, v in sorted(have.items())
            if n not in pins and n not in extras]
    return out


def sync() -> None:
    """Uninstall what this environment has beyond the lock (`make install` runs it
    after `pip install -r requirements.lock`, so an old .venv ends up exactly locked)."""
    pins = environment_pins()
    extra = sorted(set(installed()) - set(pins) - build_extras())
    if extra:
        print(f"removing what the lock does not hold: {' '.join(extra)}", flush=True)
        run(sys.executable, "-m", "pip", "uninstall", "-q", "-y", *extra)


def check() -> None:
    """`pip check`, except for what the --no-deps wheels lack on purpose (their own
    dependencies, which minillm never imports)."""
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True,
                         text=True).stdout
    nodeps = set(read_pins(NODEPS))
    broken = [line for line in out.splitlines() if " requires " in line
              or " has requirement " in line]
    broken = [line for line in broken if canonical(line.split()[0]) not in nodeps]
    print("\n".join(broken) or "pip check: no broken requirements (beyond "
          f"{', '.join(sorted(nodeps))}, installed without their dependencies)")
    if broken:
        sys.exit(1)


def header() -> str:
    py = ".".join(platform.python_version_tuple()[:2])
    return (f"# The whole environment of `make install`, pinned (tools/lock.py; `make lock`).\n"
            f"# Resolved from constraints.txt and minillm[{EXTRAS}] on CPython {py},\n"
            f"# {sys.platform} {platform.machine()}. Do not edit by hand.\n"
            f"# python: {py}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-index", default="",
                        help="install torch from this index first (e.g. PyTorch's CPU "
                             "index)")
    parser.add_argument("--out", type=Path, default=LOCK)
    parser.add_argument("--sync", action="store_true",
                        help="uninstall from this environment what the lock does not hold")
    parser.add_argument("--check", action="store_true",
                        help="pip check, allowing what requirements-nodeps.txt lacks")
    args = parser.parse_args(argv)
    if args.sync:
        return sync()
    if args.check:
        return check()
    with tempfile.TemporaryDirectory(prefix="minillm-lock-") as tmp:
        print(f"resolving in a new virtual environment ({tmp}) ...", flush=True)
        venv.create(tmp, with_pip=True)
        py = str(Path(tmp) / "bin" / "python")
        pip_pin = re.search(r"^pip==\S+", (ROOT / "constraints.txt").read_text(), re.M)
        run(py, "-m", "pip", "install", "-q", pip_pin.group(0) if pip_pin else "pip")
        if args.torch_index:
            run(py, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                "torch", "--index-url", args.torch_index)
        src = Path(tmp) / "src"  # a copy: building minillm writes build/ next to it
        src.mkdir()
        for name in ("pyproject.toml", "README.md", "minillm"):
            copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
            copy(ROOT / name, src / name)
        run(py, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
            f"{src}[{EXTRAS}]")
        run(py, "-m", "pip", "check")
        lines = pinned(run(py, "-m", "pip", "freeze", "--all"))
    args.out.write_text(header() + "\n".join(lines) + "\n")
    print(f"wrote {args.out} ({len(lines)} distributions)")


if __name__ == "__main__":
    main()
