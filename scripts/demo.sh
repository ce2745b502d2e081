#!/usr/bin/env bash
# The README's main command: set up (or reuse) the environment, make the demo corpus if it is
# missing, then run the main job: the tiny VLM trained as the MindSpeed-MM-style baseline and
# with --use-flowtrain, the text-only upper bound, the parity and resume checks, and the
# report (docs/train.md).
# Extra arguments go to `mindspeed-flow train` (e.g. --steps 4, --only flowtrain, --ablation:
# every run of the ablation chain baseline -> packing -> varlen -> conv-matmul -> flowtrain).
# The old piecewise demo (patch table, PP=2 regression, packing, simulations) is
# `mindspeed-flow selftest`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MINDSPEED_FLOW_VENV:-$ROOT/.venv}
CONFIG=${MINDSPEED_FLOW_TRAIN_CONFIG:-configs/train/demo.yaml}
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
if ! ls outputs/demo_data/*.json* >/dev/null 2>&1; then
    "$VENV/bin/python" scripts/make_demo_data.py --out outputs/demo_data
fi
exec "$VENV/bin/mindspeed-flow" train "$CONFIG" "$@"
