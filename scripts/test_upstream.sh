#!/usr/bin/env bash
# The upstream-in-the-loop tests: MindSpeed's real adaptor and MindSpeed-MM's real Qwen2.5-VL
# on CPU (tests/upstream), plus the tests that load MindSpeed's real patch manager, the
# launcher's script-folder tests and the data loader against Hugging Face's Qwen2-VL classes
# (tests/data/test_hf.py; it skips in the main suite), in the environment of
# scripts/setup_upstream_env.sh (MindSpeed-MM's pins).  A missing dependency fails here instead of skipping.
# Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MINDSPEED_FLOW_UPSTREAM_VENV:-$ROOT/.venv-upstream}
bash "$ROOT/scripts/setup_upstream_env.sh"
cd "$ROOT"
MINDSPEED_FLOW_UPSTREAM_REQUIRED=1 exec "$VENV/bin/python" -m pytest \
    tests/upstream tests/adapters/mindspeed/test_feature_manager.py tests/test_launch_script_folder.py \
    tests/data/test_hf.py "$@"
