#!/usr/bin/env bash
# Set up stemlm in ./.venv: the CPU torch wheel first when no torch is importable, then the package.
#
#   bash scripts/setup.sh            # then: .venv/bin/stemlm train
#
# The venv sees the system's site-packages, so a torch that is already installed (a GPU build, say) is used
# as it is and never replaced; only when no torch exists is the CPU wheel installed (torch==2.13.0 by default,
# override with STEMLM_TORCH="torch==X.Y.Z"), which keeps pip from pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    echo "stemlm setup: no torch found; installing the CPU wheel ${STEMLM_TORCH:-torch==2.13.0}"
    "${PIP[@]}" install "${STEMLM_TORCH:-torch==2.13.0}"
fi
"${PIP[@]}" install -e ".[dev,eval,gguf]"
.venv/bin/python -c "import torch, stemlm; print(f'stemlm setup: ok (torch {torch.__version__})')"
