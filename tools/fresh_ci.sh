#!/usr/bin/env bash
# CI from nothing, as on a machine that never ran the project: clone what is committed
# into an empty folder and run .ci/run there with an empty home, temp folder and caches
# (pip's too), so nothing this machine kept from earlier runs can help or hide anything.
#
#   tools/fresh_ci.sh            # in a new folder under /tmp (printed), removed if green
#   KEEP=1 tools/fresh_ci.sh     # keep the folder for a look afterwards
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/minillm-fresh-ci.XXXXXX)"
mkdir -p "$work"/{home,tmp,cache}
git clone -q "$repo" "$work/clone"
echo "fresh clone of $(git -C "$work/clone" log -1 --format='%h %s' | cut -c1-70)"
echo "in $work (empty HOME, TMPDIR, XDG_CACHE_HOME and pip cache)"
cd "$work/clone"
start=$(date +%s)
status=0
env HOME="$work/home" TMPDIR="$work/tmp" XDG_CACHE_HOME="$work/cache" \
    PIP_CACHE_DIR="$work/cache/pip" .ci/run || status=$?
secs=$(( $(date +%s) - start ))
echo "fresh_ci: .ci/run exited $status after $((secs / 60)) min $((secs % 60)) s"
if [ "$status" -eq 0 ] && [ -z "${KEEP:-}" ]; then rm -rf "$work"; fi
exit "$status"
