"""`make test` runs in a sandbox of its own (the Makefile's SANDBOX_ENV): the temp
folder, the home folder and every cache the suite writes to are inside it, so a file an
earlier run left on this machine (a model folder in /tmp, a compiled kernel, a font
cache) cannot hide a broken code path. Outside `make test` there is nothing to check."""
import os
import tempfile
from pathlib import Path

import pytest

SANDBOX = os.environ.get("MINILLM_SANDBOX")
pytestmark = pytest.mark.skipif(not SANDBOX, reason="runs under `make test` only")
VARIABLES = ["TMPDIR", "HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
             "HF_HOME", "MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
             "TORCH_HOME", "IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR"]


def inside(path) -> bool:
    return Path(path).resolve().is_relative_to(Path(SANDBOX).resolve())


@pytest.mark.parametrize("name", VARIABLES)
def test_every_cache_variable_points_into_the_sandbox(name):
    assert name in os.environ and inside(os.environ[name]), \
        f"{name}={os.environ.get(name)!r} is outside the sandbox {SANDBOX}"


def test_the_libraries_write_into_the_sandbox():
    import huggingface_hub.constants as hub
    import matplotlib
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert inside(tempfile.gettempdir())
    assert inside(Path.home()) and inside(Path("~").expanduser())
    assert inside(matplotlib.get_cachedir()) and inside(matplotlib.get_configdir())
    assert inside(hub.HF_HOME) and inside(hub.HF_HUB_CACHE)
    assert inside(cache_dir())


def test_the_random_model_folders_land_in_the_sandbox():
    from minillm.bench import folders as bench
    folder = bench.random_model_folder("SmolLM2-135M", num_hidden_layers=1,
                                       intermediate_size=32, vocab_size=64)
    assert inside(folder)
