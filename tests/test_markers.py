"""The `cuda` marker: tests marked with it are skipped without a GPU; a test that
merely has "cuda" in its parametrize id runs."""
import textwrap
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU selection")
def test_only_marked_tests_are_skipped_without_a_gpu(pytester):
    ours = Path(__file__).with_name("conftest.py")  # its hook, not its fixtures
    pytester.makeconftest(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("minillm_conftest", {str(ours)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        pytest_collection_modifyitems = module.pytest_collection_modifyitems
    """))
    pytester.makeini("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    pytester.makepyfile(test_devices=textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("device", ["cpu", "cuda"])
        def test_refused(device):
            assert device in ("cpu", "cuda")

        @pytest.mark.cuda
        def test_on_the_gpu():
            raise AssertionError("must be skipped without a GPU")
    """))
    result = pytester.runpytest("-p", "no:randomly", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*needs a CUDA GPU*"])
