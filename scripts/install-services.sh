#!/usr/bin/env bash
# Installs the services Sift's demo and tests start themselves: redis-server and prometheus;
# and libfaketime (apt's faketime), which the clock-skew tests run processes under.
# Sift needs Redis 7.0 or later (its scripts declare flags, which Redis 6 refuses to load):
# a redis-server older, installed or the one apt offers (Debian 11, Ubuntu 22.04: 6.0.16),
# is refused, saying where to get a newer one, rather than installed for `sift up` to refuse.
set -euo pipefail

OLDEST_REDIS_MAJOR=7

refuse_old_redis() {  # $1: what is too old, and its version
  cat >&2 <<MSG
$1; Sift needs Redis 7.0 or later. Install one from your distribution's backports,
where they have it, or from Redis's own apt repository (https://packages.redis.io), then
run this again. Debian 12 and Ubuntu 24.04 ship 7.0 or later.
MSG
  exit 1
}

major() {  # the major version in "7.0.15", "5:6.0.16-1ubuntu1" (apt's, with its epoch)
  local version=${1#*:}
  echo "${version%%.*}"
}

need=()
if command -v redis-server >/dev/null; then
  installed=$(redis-server --version | sed -n 's/.* v=\([0-9.]*\).*/\1/p')
  [ "$(major "${installed:-0}")" -ge $OLDEST_REDIS_MAJOR ] ||
    refuse_old_redis "$(command -v redis-server) is Redis ${installed:-of an unknown version}"
else
  need+=(redis-server)
fi
command -v prometheus >/dev/null || need+=(prometheus)
# the clock-skew tests skip without it; only where apt is (a brew machine skips them)
command -v faketime >/dev/null || ! command -v apt-get >/dev/null || need+=(faketime)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if command -v apt-get >/dev/null; then
  $sudo apt-get update -qq
  if [[ " ${need[*]} " == *" redis-server "* ]]; then
    offered=$(apt-cache policy redis-server | sed -n 's/^ *Candidate: *//p')
    [ "$(major "${offered:-0}")" -ge $OLDEST_REDIS_MAJOR ] 2>/dev/null ||
      refuse_old_redis "apt offers redis-server ${offered:-(none)}"
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
elif command -v brew >/dev/null; then
  brew install redis prometheus
else
  echo "Please install: ${need[*]} (Redis 7.0 or later)" >&2
  exit 1
fi
