#!/usr/bin/env bash
# The fast tier's wall time under a chosen load: runs COMMAND (default `pytest -q`) with
# BUSY busy loops beside it (default 0), samples the load average every 20 s, and prints
# the time, the exit status and the load average's min / mean / max over the run.
# docs/testing.md quotes its figures.
#
#   bash tools/suite_time.sh                 # pytest -q, nothing beside it
#   BUSY=1 bash tools/suite_time.sh          # one busy loop beside it (load average ~4)
#   BUSY=1 bash tools/suite_time.sh bash .ci/run
set -uo pipefail
cd "$(dirname "$0")/.."
busy=${BUSY:-0}
samples=$(mktemp)
(while true; do cut -d' ' -f1 /proc/loadavg >> "$samples"; sleep 20; done) &
sampler=$!
loops=()
for _ in $(seq "$busy"); do (while true; do :; done) & loops+=($!); done
start=$(date +%s)
if [ $# -eq 0 ]; then set -- pytest -q; fi
"$@"
status=$?
wall=$(( $(date +%s) - start ))
kill "$sampler" "${loops[@]}" 2>/dev/null
python3 - "$samples" "$wall" "$status" "$busy" <<'EOF'
import sys
loads = [float(x) for x in open(sys.argv[1]).read().split()] or [float('nan')]
wall, status, busy = int(sys.argv[2]), sys.argv[3], sys.argv[4]
print(f'suite_time: exit {status}, {wall} s ({wall / 60:.1f} min) with {busy} busy loop(s) '
      f'beside; 1-minute load average min {min(loads):.2f} mean {sum(loads) / len(loads):.2f} '
      f'max {max(loads):.2f} ({len(loads)} samples)')
EOF
rm -f "$samples"
exit "$status"
