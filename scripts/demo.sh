#!/usr/bin/env bash
# The README's main-job command: set up (or reuse) the environment, then run the CPU demo.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MINDSPEED_FLOW_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" scripts/selftest.py "$@"
