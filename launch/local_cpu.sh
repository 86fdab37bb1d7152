#!/usr/bin/env bash
# Runs dist_ens on N fake CPU devices in one process, to try a mesh on a laptop.
#   launch/local_cpu.sh 8 --config=configs/default.py --workdir=/tmp/run --config.mesh.data=2
# Fake devices share the host's cores: use them to check sharding, not speed.
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 NUM_DEVICES [dist-ens flags...]" >&2
  exit 2
fi
devices="$1"
shift
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${devices}"
export JAX_PLATFORMS=cpu
exec python -m dist_ens.main "$@"
