#!/usr/bin/env bash
# Creates (or reuses) the virtual environment in which tests/upstream runs MindSpeed's real
# adaptor and MindSpeed-MM's real model code.  It is separate from .venv because
# MindSpeed-MM pins packages (transformers==4.57.0, ...) that the main suite does not want;
# the pins live in tests/upstream/constraints.txt.  Same conventions as setup_env.sh:
# torch first, pinned exactly (the CPU wheel on this machine's disk).
#
#   MINDSPEED_FLOW_UPSTREAM_VENV   where the environment lives   (default: <repo>/.venv-upstream)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MINDSPEED_FLOW_UPSTREAM_VENV:-$ROOT/.venv-upstream}
CONSTRAINTS=$ROOT/tests/upstream/constraints.txt

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup-upstream] creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

"${PIP[@]}" install "torch==2.13.0" "setuptools>=64" wheel
"${PIP[@]}" install -c "$CONSTRAINTS" -r "$ROOT/tests/upstream/requirements.txt"
# No megatron-core wheel here: Megatron is the source copy inside the unpacked MindSpeed-MM
# tree, put first on the harness subprocess's sys.path, exactly as on a cluster.
echo "[setup-upstream] installing mindspeed-flow[test] (editable)"
"${PIP[@]}" install -c "$CONSTRAINTS" -e "$ROOT[test]"
echo "[setup-upstream] ready: $VENV"
