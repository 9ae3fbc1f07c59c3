#!/usr/bin/env bash
# The GPU checks of the project (`make gpu-check`), on a CUDA machine, sized for 10
# minutes: chapter 7's decode benchmark on real model shapes (with torch.compile), the
# article's 7B INT8 task, the unit tests marked `cuda` (they run only there) and every
# chapter top to bottom under nbval (with MINILLM_RECORD=1: the chapters record their
# GPU reference runs). Writes what it saw to $OUT (default gpu-results/; the terminal
# gets the tails, the files the whole output): versions.txt,
# bench.txt, decode_*.csv, article_*.csv, unit.txt, chapters.txt and the recorded files.
# STEPS picks the parts (default "bench unit chapters"); BENCH_MODELS the shapes (default
# SmolLM2-135M Llama-2-7B); CHAPTERS the notebooks (default chapters); PYTHON the
# interpreter (default python3). The timeouts (BENCH_TIMEOUT x 3 + UNIT_TIMEOUT +
# CHAPTER_TIMEOUT) add up to 590 s.
# GPU_CHECK_DRY=1: a dry run on any machine (make test runs it): every benchmark command
# checks its arguments and stops, pytest only collects, and the files are laid out as
# on a GPU. On an offline machine, bring the notebook tooling as wheels first
# (../shared/gpu/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
py="${PYTHON:-python3}"
dry="${GPU_CHECK_DRY:-0}"
mkdir -p "$out" || exit 2
export PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 MPLBACKEND=agg TQDM_DISABLE=1
collect=()
if [ "$dry" = 1 ]; then
    export MINILLM_BENCH_DRY_RUN=1
    collect=(--collect-only)
fi
GPU_CHECK_DRY="$dry" "$py" - <<'PY' | tee "$out/versions.txt"
import os, platform, sys
import torch, transformers
dry = os.environ["GPU_CHECK_DRY"] == "1"
if not dry and not torch.cuda.is_available():
    sys.exit("no CUDA GPU: tools/gpu_check.sh runs on a CUDA machine only "
             "(GPU_CHECK_DRY=1 for a dry run)")
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "dry run, no GPU"
driver = ""
if torch.cuda.is_available():
    import subprocess
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        driver = "unknown"
print(f"{name} | driver {driver or '-'} | torch {torch.__version__} (CUDA "
      f"{torch.version.cuda}) | transformers {transformers.__version__} | "
      f"Python {platform.python_version()}")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2
status=0
steps="${STEPS:-bench unit chapters}"
for step in $steps; do
    case "$step" in bench|unit|chapters) ;;
        *) echo "STEPS: unknown step '$step'; allowed: bench unit chapters" >&2; exit 2;;
    esac
done
if [[ " $steps " == *" bench "* ]]; then
    : > "$out/bench.txt"
    for model in ${BENCH_MODELS:-SmolLM2-135M Llama-2-7B}; do
        timeout "${BENCH_TIMEOUT:-80}" "$py" -m minillm.bench decode --model "$model" \
            --batch 1 64 --compile --out "$out" 2>&1 | tee -a "$out/bench.txt" | tail -20
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    # the source article's task on a random 7B shape: INT8, paged KV, <= 8 GB, <= 200 ms
    timeout "${BENCH_TIMEOUT:-80}" "$py" -m minillm.bench article --model Llama-2-7B \
        --out "$out" 2>&1 | tee -a "$out/bench.txt" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $steps " == *" unit "* ]]; then
    timeout "${UNIT_TIMEOUT:-60}" "$py" -m pytest -q -p no:cacheprovider -p no:randomly \
        -m cuda "${collect[@]}" tests -rs 2>&1 | tee "$out/unit.txt" | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $steps " == *" chapters "* ]]; then
    # shellcheck disable=SC2086  # CHAPTERS: one or more paths
    MINILLM_RECORD=1 timeout "${CHAPTER_TIMEOUT:-290}" "$py" -m pytest -q \
        -p no:cacheprovider -p no:randomly --nbval-lax --nbval-current-env \
        --nbval-cell-timeout=240 --durations=15 "${collect[@]}" ${CHAPTERS:-chapters} \
        2>&1 | tee "$out/chapters.txt" | tail -80
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    [ "$dry" = 1 ] || cp data/benchmarks/*cuda* "$out/" 2>/dev/null
fi
what="$([ "$dry" = 1 ] && echo "dry run: ")"
echo "gpu_check: $what$([ $status -eq 0 ] && echo all green || echo FAILURES) (see $out/)"
exit $status
