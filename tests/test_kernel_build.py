"""C++ kernels are built behind a lock that no killed build leaves held (issue 70,
part 6). Before: a process killed during the first build of a kernel left PyTorch's
`lock` file in its build folder, and every later process that needed the kernel waited
for it forever, silently (collecting the tests hung for 23 minutes). Now the build
holds an flock, which the OS releases when its process dies, and removes a stale
baton under it; the folder is named by the CPU's features too; and importing the
modules or collecting the tests builds nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from minillm.kernels.build import build_folder, build_lock, cpu_key

ROOT = Path(__file__).resolve().parent.parent


def child(code: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def test_a_killed_holder_leaves_no_lock(tmp_path):
    folder = tmp_path / "k"
    holder = child(f"""
        from pathlib import Path
        import time
        from minillm.kernels.build import build_lock
        with build_lock({str(folder)!r}):
            Path({str(folder)!r}, "lock").touch()  # torch's baton, mid-build
            print("held", flush=True)
            time.sleep(120)
        """, {})
    assert holder.stdout.readline().strip() == "held"
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (folder / "lock").exists()  # what a killed build leaves behind
    start = time.perf_counter()
    with build_lock(str(folder)):
        assert not (folder / "lock").exists()  # stale: removed under the flock
    assert time.perf_counter() - start < 5


def test_the_folder_names_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    key = cpu_key()
    assert len(key) == 8 and int(key, 16) >= 0
    assert build_folder("x") == str(tmp_path / "minillm" / f"x_{key}")


BUILD = """
    from minillm.kernels.build import build_cpu_kernel
    m = build_cpu_kernel("minillm_test_twice", "a test kernel", ["twice"],
                         "int64_t twice(int64_t x) { return 2 * x; }")
    print("result", m.twice(21), flush=True)
    """


def test_a_build_killed_midway_does_not_wedge_the_next(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = child(BUILD, env)
    folder = Path(child("from minillm.kernels.build import build_folder; "
                        "print(build_folder('minillm_test_twice'))", env)
                  .communicate(timeout=120)[0].strip())
    deadline = time.time() + 120
    while not (folder / "lock").exists():  # PyTorch's baton: the build has begun
        assert first.poll() is None and time.time() < deadline, first.stdout.read()
        time.sleep(0.05)
    time.sleep(1)  # midway: the compiler runs
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert (folder / "lock").exists()
    second = child(BUILD, env)
    out = second.communicate(timeout=600)[0]
    assert second.returncode == 0 and "result 42" in out, out


def test_collecting_the_tests_builds_nothing(tmp_path):
    """Importing the kernels' modules and collecting the tests that use them."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                    "-p", "no:randomly", "tests/test_w8a8_cpu.py",
                    "tests/test_tiled_a8.py", "tests/test_paged_decode.py"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-c", "import minillm.quant.w8a8_cpu, "
                    "minillm.quant.tiled_a8, minillm.kernels.paged_decode"],
                   cwd=ROOT, env=env, check=True, timeout=300)
    assert list(tmp_path.iterdir()) == []
