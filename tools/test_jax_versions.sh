#!/usr/bin/env bash
# The test suite on several jax releases, each in a fresh venv; each pair's summary is
# printed and replaces its row in benchmarks/results/jax_versions.json.
#
#   bash tools/test_jax_versions.sh                      # the default matrix (~25 min, 2 cores)
#   bash tools/test_jax_versions.sh 3.12:0.11.2 ...      # PYTHON_VERSION:JAX_VERSION pairs
#
# A python X.Y is found as pythonX.Y on PATH or under pyenv's versions. jax 0.10.2 is the
# newest release for Python 3.11; newer ones need Python >= 3.12.
set -uo pipefail
cd "$(dirname "$0")/.."
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(3.11:0.10.2 3.12:0.11.2 3.12:0.12.0.1 3.13:0.12.0.1)
out=benchmarks/results/jax_versions.json
work=$(mktemp -d "${TMPDIR:-/tmp}/dist_ens_jax_XXXX")
trap 'rm -rf "$work"' EXIT

find_python() {  # A pythonX.Y that runs (pyenv's shims are on PATH but may not).
  local cand
  for cand in "$(command -v "python$1")" \
              $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python 2>/dev/null); do
    [ -n "$cand" ] && "$cand" -c '' 2>/dev/null && { echo "$cand"; return; }
  done
}

rows=()
for pair in "${pairs[@]}"; do
  py=${pair%%:*} jax=${pair##*:}
  python=$(find_python "$py") || true
  if [ -z "$python" ]; then
    echo "python $py: not found, skipped"; rows+=("{\"python\": \"$py\", \"jax\": \"$jax\", \"result\": \"no python $py\"}"); continue
  fi
  venv="$work/py$py-jax$jax"
  "$python" -m venv "$venv" || { rows+=("{\"python\": \"$py\", \"jax\": \"$jax\", \"result\": \"no venv\"}"); continue; }
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  pip install -q --upgrade pip >/dev/null
  start=$(date +%s)
  if pip install -q -e '.[test]' "jax==$jax" "jaxlib==$jax" >"$venv.install" 2>&1; then
    pytest -q -rf -p no:cacheprovider >"$venv.pytest" 2>&1
    grep "^FAILED" "$venv.pytest"
    summary=$(tail -1 "$venv.pytest")
    installed=$(python -c 'import jax, sys; print(jax.__version__, sys.version.split()[0])')
  else
    summary="install failed: $(tail -1 "$venv.install")" installed="-"
  fi
  deactivate
  seconds=$(( $(date +%s) - start ))
  echo "python $py, jax $jax ($installed): $summary (${seconds} s)"
  rows+=("{\"python\": \"$py\", \"jax\": \"$jax\", \"installed\": \"$installed\", \"result\": \"${summary//\"/\'}\", \"seconds\": $seconds, \"date\": \"$(date -Iseconds)\", \"commit\": \"$(git rev-parse --short HEAD)\"}")
done
# Each pair's row replaces the one of the same (python, jax) in $out; the others stay.
printf '%s\n' "${rows[@]}" | python3 -c '
import json, sys
out, rows = sys.argv[1], [json.loads(line) for line in sys.stdin if line.strip()]
try:
  kept = json.load(open(out))["rows"]
except (OSError, ValueError, KeyError):
  kept = []
new = {(r["python"], r["jax"]) for r in rows}
merged = [r for r in kept if (r["python"], r["jax"]) not in new] + rows
merged.sort(key=lambda r: (tuple(map(int, r["python"].split("."))), r["jax"]))
json.dump({"command": "bash tools/test_jax_versions.sh [PYTHON:JAX ...]", "rows": merged},
          open(out, "w"), indent=1)
' "$out"
echo "wrote $out"
