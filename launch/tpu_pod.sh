#!/usr/bin/env bash
# Runs dist_ens on every worker of a Cloud TPU VM pod slice (e.g. v4-32: 4 hosts).
# The same command starts on all workers at once over `gcloud ... ssh --worker=all`;
# with --distributed each process finds the others through JAX's TPU detection
# (the VM metadata), so no addresses are needed.
#
#   launch/tpu_pod.sh --name my-pod --zone us-central2-b --setup -- \
#       --config=configs/default.py --workdir=gs://bucket/runs/ens --config.num_members=64
#
# Members larger than a chip: add --config.mesh.model=K (K chips per member, neighbours in
# (process, device) order, so a K dividing the chips per host keeps a member on one host)
# with --config.mesh.member across hosts; docs/multihost.md lays out a slice.
#
# Options (before --; everything after -- goes to `python3 -m dist_ens.main`):
#   --name NAME        TPU VM name (required)
#   --zone ZONE        its zone (required)
#   --project PROJECT  GCP project (default: gcloud's configured one)
#   --repo-dir DIR     where the code lives on the workers (default: dist_ens)
#   --setup            first copy this checkout to DIR on every worker and
#                      pip install it with its tpu extra (jax[tpu], the supported versions)
#   --dry-run          print the gcloud commands instead of running them
#
# The workdir must be one every worker reaches (a gs:// bucket or an NFS mount):
# process 0 writes the metrics, every process its own checkpoint shards.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

name=''
zone=''
project=''
repo_dir='dist_ens'
setup=0
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --repo-dir) repo_dir="$2"; shift 2 ;;
    --setup) setup=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "tpu_pod.sh: unknown option '$1' (options come before --; dist_ens flags after it)" >&2
       usage ;;
  esac
done
if [[ -z "$name" || -z "$zone" ]]; then
  echo "tpu_pod.sh: --name and --zone are required (e.g. --name my-pod --zone us-central2-b)" >&2
  exit 2
fi
if [[ $# -eq 0 ]]; then
  echo "tpu_pod.sh: give the dist_ens flags after --, e.g. -- --config=configs/default.py" \
       "--workdir=gs://bucket/run" >&2
  exit 2
fi

where=(--zone "$zone")
if [[ -n "$project" ]]; then where+=(--project "$project"); fi

# Shell-quotes each argument only where needed (POSIX single quotes), for a
# readable, copy-pasteable line.
quote() {
  local out=() a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+=("$a")
    else
      out+=("'${a//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

run() {
  if [[ $dry_run == 1 ]]; then quote "$@"; else "$@"; fi
}

if [[ $setup == 1 ]]; then
  checkout="$(cd "$(dirname "$0")/.." && pwd)"
  run gcloud compute tpus tpu-vm scp --recurse "$checkout" "${name}:${repo_dir}" \
    "${where[@]}" --worker=all
  # The package's own tpu extra (pyproject.toml): the jax versions dist_ens supports, one
  # pin for every install, not a second one here to fall behind it.
  run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all \
    --command="pip install -e $(quote "${repo_dir}[tpu]")"
fi

# One string for the remote shell; quoting keeps each flag one word there.
run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all \
  --command="cd $(quote "$repo_dir") && python3 -m dist_ens.main --distributed $(quote "$@")"
