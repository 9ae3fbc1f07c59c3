#!/usr/bin/env bash
# The GPU checks of the project, on a CUDA machine: chapter 7's decode benchmark on real
# model shapes, the unit tests (those marked `cuda` run only there) and every chapter top
# to bottom under nbval (with MINILLM_RECORD=1: the chapters record their GPU reference
# runs). Writes what it saw to $OUT (default gpu-results/): versions.txt, bench.txt,
# decode_*.csv, article_*.csv (the article's 7B task), unit.txt, chapters.txt and the
# recorded files. STEPS picks the parts
# (default "bench unit chapters"); BENCH_MODELS the shapes (default SmolLM2-135M Llama-2-7B).
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
steps="${STEPS:-bench unit chapters}"
if [[ " $steps " == *" bench "* ]]; then
    for model in ${BENCH_MODELS:-SmolLM2-135M Llama-2-7B}; do
        timeout "${BENCH_TIMEOUT:-400}" python3 -m minillm.bench decode --model "$model" \
            --batch 1 64 --compile --out "$out" 2>&1 | tail -20 | tee -a "$out/bench.txt"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    # the source article's task on a random 7B shape: INT8, paged KV, <= 8 GB, <= 200 ms
    timeout "${BENCH_TIMEOUT:-400}" python3 -m minillm.bench article --model Llama-2-7B \
        --out "$out" 2>&1 | tail -8 | tee -a "$out/bench.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
[[ " $steps " == *" unit "* ]] && {
timeout "${UNIT_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -p no:randomly \
    -m "not browser and not colab" tests -rs 2>&1 | tail -40 | tee "$out/unit.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
[[ " $steps " == *" chapters "* ]] && {
MINILLM_RECORD=1 timeout "${CHAPTER_TIMEOUT:-1500}" python3 -m pytest -q -p no:cacheprovider -p no:randomly \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=300 --durations=15 \
    ${CHAPTERS:-chapters} 2>&1 | tail -80 | tee "$out/chapters.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cp data/benchmarks/*cuda* "$out/" 2>/dev/null
}
echo "gpu_check: $([ $status -eq 0 ] && echo all green || echo FAILURES) (see $out/)"
exit $status
