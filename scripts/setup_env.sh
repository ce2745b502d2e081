#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs everything that the
# demo and the tests need.  The README's two commands and .ci/run all go through here, so
# there is exactly one list of install steps.
#
#   MINDSPEED_FLOW_VENV      where the environment lives        (default: <repo>/.venv)
#   MEGATRON_CORE_VERSION    megatron-core to test against      (default: 0.12.3, the line
#                                                                 MindSpeed-MM pins)
#   MINDSPEED_FLOW_EXTRAS    extras of this package to install  (default: test,plots,mooncake)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MINDSPEED_FLOW_VENV:-$ROOT/.venv}
MEGATRON_CORE_VERSION=${MEGATRON_CORE_VERSION:-0.12.3}
EXTRAS=${MINDSPEED_FLOW_EXTRAS:-test,plots,mooncake}

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# megatron-core 0.12 goes in with --no-deps (below), so every later pip call lists its
# undeclared optional dependencies under "ERROR: pip's dependency resolver ...": expected,
# and a wall of ERROR lines for a newcomer.  Those lines only are dropped from stderr.
quiet_megatron_resolver() {
    grep -v -e '^megatron-core [0-9][0-9.a-z]* requires ' \
        -e "^ERROR: pip's dependency resolver does not currently take into account" >&2 || true
}

# torch first, pinned exactly: this is the CPU wheel on this machine's disk.  Any looser
# spec would pull a multi-GB CUDA build from the registry.
"${PIP[@]}" install "torch==2.13.0" "setuptools>=64" wheel

# megatron-core is an extra of ours (Ascend users bring Megatron as a source copy), but the
# tests run against it.  The 0.12 line declares heavy optional dependencies (modelopt,
# wandb, zarr, ...) that megatron.core does not import on this path: install it without
# them and add the light ones it does need.
case "$MEGATRON_CORE_VERSION" in
    0.12.*|0.13.*|0.14.*|0.15.*)
        "${PIP[@]}" install --no-deps "megatron-core==$MEGATRON_CORE_VERSION"
        "${PIP[@]}" install numpy packaging einops 2> >(quiet_megatron_resolver)
        ;;
    *)
        "${PIP[@]}" install "megatron-core==$MEGATRON_CORE_VERSION"
        ;;
esac

echo "[setup] installing mindspeed-flow[$EXTRAS] (editable)"
"${PIP[@]}" install -e "$ROOT[$EXTRAS]" 2> >(quiet_megatron_resolver)
echo "[setup] ready: $VENV"
