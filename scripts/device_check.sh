#!/usr/bin/env bash
# The device check: one command for when a CUDA GPU is lent (docs/device.md).
#
#   scripts/device_check.sh OUT_DIR            # on a CUDA machine: at most 8 minutes
#   scripts/device_check.sh OUT_DIR --dry      # CPU, tiny config (also DEVICE_CHECK_DRY=1): what CI runs
#
# Writes OUT_DIR/device_check.json (one entry per section: ran, or exactly why not) and the
# PNGs; fails at once on a machine without CUDA unless --dry.  $PYTHON picks the interpreter
# (default: the repository's .venv, else python3); mindspeed-flow must be installed in it.
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: $0 OUT_DIR [--dry]" >&2
    exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
dry="${DEVICE_CHECK_DRY:-0}"
for arg in "$@"; do [ "$arg" = "--dry" ] && dry=1; done
if [ "$dry" != 1 ] && ! ls /dev/nvidia0 >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device_check: no CUDA device on this machine (no /dev/nvidia0, no nvidia-smi); the device check" \
         "needs a CUDA GPU. Use --dry (or DEVICE_CHECK_DRY=1) for the CPU dry run." >&2
    exit 1
fi
# (device_check.py checks torch.cuda too.)  It keeps to its own 480 s budget; this is the hard stop behind it
exec timeout --kill-after=10 490 "$python" "$root/scripts/device_check.py" "$@"
