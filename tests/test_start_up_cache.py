"""Issue 73, item 4: a second start of the same fast engine reads its compiled steps from
PyTorch's cache on disk. Two processes, one after the other, build the same engine on an
empty cache folder: the first compiles every step (no hit), the second finds every one
of them in the cache. Counted (inductor's cache hits), not timed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from minillm.utils import bundled_model_path, repo_root

SCRIPT = f"""
import json, sys
from minillm import LLM, SamplingParams
from minillm.perf.cpu_defaults import FAST_PATH
llm = LLM({str(bundled_model_path())!r}, max_num_seqs=1, max_model_len=64, **FAST_PATH)
llm.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
             use_tqdm=False)
forward = llm.engine.runner.forward
print(json.dumps(dict(steps=len(forward.steps), hits=forward.cache_hits)))
"""


def start(cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True,
                          text=True, env=env, cwd=repo_root(), timeout=600)
    assert done.returncode == 0, done.stderr
    assert "minillm: compile_decode: compiling the step" in done.stderr  # said
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_finds_every_compiled_step_in_the_cache(tmp_path):
    cache = str(tmp_path / "inductor")
    first, second = start(cache), start(cache)
    assert first["steps"] == second["steps"] >= 1
    assert first["hits"] == 0  # an empty cache: everything compiled
    assert second["hits"] >= second["steps"]  # every step from the disk
    assert os.listdir(cache)  # what the first start left there
