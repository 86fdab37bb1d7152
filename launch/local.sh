#!/usr/bin/env bash
# Runs dist_ens as N processes on this machine, each with K fake CPU devices, joined
# by jax.distributed: a multi-host run in miniature, to test layouts and failure
# handling without a cluster.
#
#   launch/local.sh --processes 2 --devices-per-process 4 -- \
#       --config=configs/default.py --workdir=/tmp/run --config.mesh.member=4 --config.mesh.data=2
#
# Options (before --; everything after -- goes to `python -m dist_ens.main`):
#   --processes N              processes to start (default 2)
#   --devices-per-process K    fake CPU devices per process (default 4)
#   --timeout S                wall-clock bound per process, in seconds (default 1800);
#                              a process past it gets SIGTERM (dist_ens saves a checkpoint
#                              and stops), then SIGKILL --kill-after seconds later
#   --kill-after S             seconds from SIGTERM to SIGKILL (default 10): JAX catches
#                              SIGTERM, so the KILL is what ends a process that hangs
#   --grace S                  once one process has failed, how long the others get to
#                              stop on their own (JAX stops them once process 0's
#                              coordination service sees the failure) before they are
#                              killed (default 60)
#   --log-dir DIR              also write each process's output to DIR/process_I.log
#
# Every output line is prefixed with its process index ("[1] ..."). The exit status
# is 0 only if every process exited 0; a process past --timeout counts as 124.
# SIGINT/SIGTERM to local.sh are passed on to every process (SIGTERM makes dist_ens
# save a checkpoint and stop), and local.sh exits 130/143 once they have stopped.
# Environment: PYTHON (default: python) runs dist_ens.main.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

processes=2
devices=4
limit=1800
grace=60
log_dir=''
kill_after=10
while [[ $# -gt 0 ]]; do
  case "$1" in
    --processes) processes="$2"; shift 2 ;;
    --devices-per-process) devices="$2"; shift 2 ;;
    --timeout) limit="$2"; shift 2 ;;
    --grace) grace="$2"; shift 2 ;;
    --kill-after) kill_after="$2"; shift 2 ;;
    --log-dir) log_dir="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "local.sh: unknown option '$1' (options come before --; dist_ens flags after it)" >&2
       usage ;;
  esac
done
for pair in processes:processes devices:devices-per-process limit:timeout grace:grace \
            kill_after:kill-after; do
  name="${pair%%:*}"
  if [[ ! "${!name}" =~ ^[1-9][0-9]*$ ]]; then
    echo "local.sh: --${pair#*:} ${!name} must be a positive integer" >&2
    exit 2
  fi
done
python="${PYTHON:-python}"
if [[ -n "$log_dir" ]]; then mkdir -p "$log_dir"; fi

# A port the coordinator (process 0) can bind; the OS picks one that is free now.
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
state="$(mktemp -d)"

kill_all() {
  # TERM each process itself, then KILL it kill_after s later if it is still there. Not
  # through its `timeout`: GNU timeout passes a signal on twice (to the process and to
  # its process group), and dist_ens reads a second SIGTERM as "stop now, unsaved".
  local f pid child
  for f in "$state"/pid.*; do
    [[ -e "$f" ]] || continue
    pid="$(cat "$f")"
    child="$(pgrep -P "$pid" 2>/dev/null | head -n 1)"
    if [[ -z "$child" ]]; then  # Not started yet (or no pgrep): timeout passes it on.
      kill -TERM "$pid" 2>/dev/null || true
      continue
    fi
    kill -TERM "$child" 2>/dev/null || true
    (
      for ((t = 0; t < kill_after * 10; t++)); do
        kill -0 "$child" 2>/dev/null || exit 0
        sleep 0.1
      done
      kill -KILL "$child" 2>/dev/null
    ) &
  done
}
# Ctrl-C or a scheduler's SIGTERM: pass it on (dist_ens saves a checkpoint and
# stops on SIGTERM), wait for the processes, then exit 128 + the signal.
interrupted=''
trap 'interrupted=130; kill_all' INT
trap 'interrupted=143; kill_all' TERM
trap 'rm -rf "$state"' EXIT

prefix() {
  # Each line as soon as it is complete. Not awk: mawk (Debian's awk) reads a pipe in
  # blocks, which held a run's log lines back until the process ended.
  local line
  while IFS= read -r line || [[ -n "$line" ]]; do printf '%s%s\n' "$1" "$line"; done
}

echo "local.sh: ${processes} processes x ${devices} CPU devices, coordinator localhost:${port}," \
     "bound ${limit} s each" >&2
for ((i = 0; i < processes; i++)); do
  log="${log_dir:+$log_dir/process_$i.log}"
  (
    set +e -o pipefail
    # sh records the pid of `timeout` (it execs into it) so kill_all can reach it.
    XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${devices}" \
    JAX_PLATFORMS=cpu \
      sh -c 'echo $$ > "$0"; exec "$@"' "$state/pid.$i" \
      timeout -k "$kill_after" "$limit" "$python" -m dist_ens.main "$@" \
        --coordinator_address="localhost:${port}" --num_processes="$processes" \
        --process_id="$i" 2>&1 \
      | prefix "[$i] " \
      | if [[ -n "$log" ]]; then tee "$log"; else cat; fi
    echo "$?" > "$state/rc.$i.tmp" && mv "$state/rc.$i.tmp" "$state/rc.$i"
  ) 2>/dev/null &  # Quiets bash's "Killed ..." job notices; the summary below says it.
done

# Wait for all; after the first failure, give the others `grace` seconds, then stop them.
failed_at=''
while :; do
  done_count=0
  for ((i = 0; i < processes; i++)); do
    if [[ -e "$state/rc.$i" ]]; then
      done_count=$((done_count + 1))
      if [[ "$(cat "$state/rc.$i")" != 0 && -z "$failed_at" ]]; then
        failed_at=$SECONDS
        echo "local.sh: process $i exited with status $(cat "$state/rc.$i"); the others" \
             "get ${grace} s to stop" >&2
      fi
    fi
  done
  [[ $done_count -eq $processes ]] && break
  if [[ -n "$failed_at" && -z "$interrupted" && $((SECONDS - failed_at)) -ge $grace ]]; then
    echo "local.sh: processes still running ${grace} s after a failure; stopping them" >&2
    kill_all
    failed_at=$((SECONDS + kill_after + 5 - grace))  # Check again after the KILL fallback.
  fi
  sleep 0.5
done
wait

status=0
for ((i = 0; i < processes; i++)); do
  rc="$(cat "$state/rc.$i")"
  if [[ "$rc" != 0 ]]; then
    case "$rc" in
      124) why=" (still running after the ${limit} s bound)" ;;
      137) why=' (SIGKILL)' ;;
      *) why='' ;;
    esac
    echo "local.sh: process $i failed with status ${rc}${why}" >&2
    [[ $status == 0 ]] && status="$rc"
  fi
done
if [[ -n "$interrupted" ]]; then
  echo "local.sh: interrupted; the processes were stopped" >&2
  exit "$interrupted"
fi
exit "$status"
