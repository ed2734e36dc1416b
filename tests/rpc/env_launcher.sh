#!/usr/bin/env bash
# Runs a program as an env:// launcher (torchrun, a scheduler) would: WORLD_SIZE copies
# on this host, each with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.
# Exits 0 only if every copy does.
#   env_launcher.sh WORLD_SIZE PROGRAM [ARGS...]
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 WORLD_SIZE PROGRAM [ARGS...]" >&2
  exit 2
fi
world=$1
shift
# A free port: bind to port 0 and read back what the kernel chose.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
       echo $((30000 + RANDOM % 20000)))
pids=()
for ((rank = 0; rank < world; rank++)); do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$@" &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
exit $failed
