#!/usr/bin/env bash
# tritonserver with the given arguments plus the response cache the environment asks for:
#   TRITON_CACHE=local (default)  --cache-config=local,size=$TRITON_CACHE_SIZE (bytes, default 256 MiB)
#   TRITON_CACHE=redis            --cache-config=redis,host=$REDIS_HOST --cache-config=redis,port=$REDIS_PORT
#                                 (and password / db when REDIS_PASSWORD / REDIS_DB are set)
#   TRITON_CACHE=none             no cache
# Triton reads one setting per --cache-config flag (`<cache>,<key>=<value>`): a single
# `redis,host=redis,port=6379` would set the host to "redis,port=6379".
set -euo pipefail
cache=()
case "${TRITON_CACHE:-local}" in
  local) cache=("--cache-config=local,size=${TRITON_CACHE_SIZE:-268435456}") ;;
  redis)
    cache=("--cache-config=redis,host=${REDIS_HOST:-redis}" "--cache-config=redis,port=${REDIS_PORT:-6379}")
    if [ -n "${REDIS_PASSWORD:-}" ]; then cache+=("--cache-config=redis,password=${REDIS_PASSWORD}"); fi
    if [ -n "${REDIS_DB:-}" ]; then cache+=("--cache-config=redis,db=${REDIS_DB}"); fi
    ;;
  none) ;;
  *) echo "entrypoint.sh: TRITON_CACHE must be local, redis or none, got '${TRITON_CACHE}'" >&2; exit 2 ;;
esac
exec "${TRITONSERVER:-tritonserver}" "$@" "${cache[@]}"
