#!/usr/bin/env bash
# Starts a local 3-member etcd cluster for measurements and manual runs (the tests start
# their own, tests/testing/etcd_cluster.h), with the same Raft timing as the tests.
#
#   scripts/etcd-cluster.sh start DIR   # members on 127.0.0.1:23790..23792 (peers 23800..23802)
#   scripts/etcd-cluster.sh stop DIR    # SIGKILLs them and removes DIR
#
# Prints the endpoints, "127.0.0.1:23790,127.0.0.1:23791,127.0.0.1:23792", once all are healthy.
set -euo pipefail
cmd=${1:?usage: etcd-cluster.sh start|stop DIR}
dir=${2:?usage: etcd-cluster.sh start|stop DIR}
case "$cmd" in
  start)
    mkdir -p "$dir"
    initial="m0=http://127.0.0.1:23800,m1=http://127.0.0.1:23801,m2=http://127.0.0.1:23802"
    for i in 0 1 2; do
      etcd --name "m$i" --data-dir "$dir/m$i" \
        --listen-client-urls "http://127.0.0.1:2379$i" --advertise-client-urls "http://127.0.0.1:2379$i" \
        --listen-peer-urls "http://127.0.0.1:2380$i" --initial-advertise-peer-urls "http://127.0.0.1:2380$i" \
        --initial-cluster "$initial" --initial-cluster-state new --initial-cluster-token ferry-local \
        --heartbeat-interval 50 --election-timeout 500 --log-level warn --logger zap \
        >"$dir/m$i.log" 2>&1 &
      echo $! >"$dir/m$i.pid"
    done
    for i in 0 1 2; do
      healthy=0
      for _ in $(seq 100); do
        if curl -sf "http://127.0.0.1:2379$i/health" | grep -q '"true"'; then healthy=1; break; fi
        sleep 0.1
      done
      if [ "$healthy" != 1 ]; then
        echo "etcd member m$i not healthy after 10 s; its log: $dir/m$i.log" >&2
        exit 1
      fi
    done
    echo "127.0.0.1:23790,127.0.0.1:23791,127.0.0.1:23792"
    ;;
  stop)
    for i in 0 1 2; do
      [ -f "$dir/m$i.pid" ] && kill -9 "$(cat "$dir/m$i.pid")" 2>/dev/null || true
    done
    rm -rf "$dir"
    ;;
  *) echo "usage: etcd-cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
