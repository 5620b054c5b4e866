#!/usr/bin/env bash
# Installs the services Sift's demo and tests start themselves: redis-server and prometheus.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v prometheus >/dev/null || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if command -v apt-get >/dev/null; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
elif command -v brew >/dev/null; then
  brew install redis prometheus
else
  echo "Please install: ${need[*]}" >&2
  exit 1
fi
