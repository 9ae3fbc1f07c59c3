"""Keep the CPU busy: N processes that spin until this one is stopped.

    python tools/cpu_hog.py [N]        (default: every core, os.cpu_count())

`make nbval-loaded` starts it in the background while nbval runs the chapters, so every
timing claim a chapter asserts is checked on a machine whose cores are all taken, as on a
loaded CI runner. SIGTERM or SIGINT (or Ctrl-C) stops the spinners; a spinner whose parent
is gone (killed with SIGKILL) stops by itself within a second.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time


def spin(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    x, deadline = 0, time.monotonic() + 1.0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF  # pure Python work, no sleeping
        if time.monotonic() > deadline:
            if os.getppid() != parent:
                return
            deadline = time.monotonic() + 1.0


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else (os.cpu_count() or 1)
    if n < 1:
        raise SystemExit(f"cpu_hog: N={n}: give a count >= 1")
    procs = [multiprocessing.Process(target=spin, args=(os.getpid(),), daemon=True)
             for _ in range(n)]
    for p in procs:
        p.start()

    def stop(signum, frame):
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=5)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"cpu_hog: {n} spinning processes (pid {os.getpid()})", file=sys.stderr, flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
