#!/usr/bin/env bash
# The README's test command: set up, lint, run every test. Non-zero on any failure, including "no tests ran".
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
printf '\n== ruff\n'
ruff check .
ruff format --check .
printf '\n== pytest\n'
set +e
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
