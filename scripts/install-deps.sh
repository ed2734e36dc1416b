#!/usr/bin/env bash
# Installs every Debian package ferry needs to build, test and benchmark.
# Idempotent: packages already present are skipped; uses sudo when not root.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libtensorpipe-dev libgloo-dev libuv1-dev libcereal-dev libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libssl-dev libncurses-dev
  libdlpack-dev libtorch-dev
  clang-14 libfuzzer-14-dev lld
  python3 python3-matplotlib
  python3-dev pybind11-dev python3-pytest python3-numpy python3-torch
  iproute2 liburing-dev
  etcd-server etcd-client
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
# etcd-server's package starts a system etcd on 127.0.0.1:2379 where the machine lets
# services start. ferry's tests start clusters of their own on free ports and want no
# stray server: stop it and keep it from starting again.
if [[ " ${missing[*]} " == *" etcd-server "* ]]; then
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
    $sudo systemctl disable --now etcd || true
  elif [ -x /etc/init.d/etcd ]; then
    $sudo /etc/init.d/etcd stop >/dev/null 2>&1 || true
    $sudo update-rc.d etcd disable >/dev/null 2>&1 || true
  fi
fi
echo "install-deps: done"
