#!/usr/bin/env bash
# The GPU checks of the project, on a CUDA machine: the unit tests (those marked `cuda`
# run only there) and every chapter top to bottom under nbval. Writes what it saw to
# $OUT (default gpu-results/): versions.txt, unit.txt, chapters.txt.
# On an offline machine, bring the notebook tooling as wheels first (../shared/gpu/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
python3 - <<'PY' | tee "$out/versions.txt" || exit 2
import platform, sys
import torch, transformers
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU: tools/gpu_check.sh runs on a CUDA machine only")
print(f"{torch.cuda.get_device_name(0)} | torch {torch.__version__} (CUDA "
      f"{torch.version.cuda}) | transformers {transformers.__version__} | "
      f"Python {platform.python_version()}")
PY
export PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 MPLBACKEND=agg TQDM_DISABLE=1
status=0
timeout "${UNIT_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -p no:randomly \
    -m "not browser and not colab" tests -rs 2>&1 | tail -40 | tee "$out/unit.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout "${CHAPTER_TIMEOUT:-1500}" python3 -m pytest -q -p no:cacheprovider -p no:randomly \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=300 --durations=15 \
    ${CHAPTERS:-chapters} 2>&1 | tail -80 | tee "$out/chapters.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo all green || echo FAILURES) (see $out/)"
exit $status
