#!/usr/bin/env bash
# The README's test command: set up (or reuse) the environment, then run the whole suite.
# Extra arguments go to pytest.  Exits non-zero on any failure, including "no tests ran".
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MINDSPEED_FLOW_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
