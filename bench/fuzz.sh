#!/usr/bin/env bash
# The long fuzz run against a real daemon (the normal suite runs 60 examples).
#   bash bench/fuzz.sh [EXAMPLES]     (default 5000)
set -euo pipefail
cd "$(dirname "$0")/.."
EVERYCYCLE_FUZZ_EXAMPLES=${1:-5000} exec .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_fuzz_daemon.py tests/test_protocol.py -o timeout=0
