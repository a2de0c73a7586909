#!/usr/bin/env bash
# Dense, dense_embed and STEM under --recipe official at matched FLOPs, 2 seeds, on one CUDA GPU in at most 8
# minutes: held-out losses and their paired differences as RESULT lines (benchmarks/gpu_evidence.py holds the
# plan, its throughput assumption of 100 TFLOP/s on one H200 in bf16, and the refusal of a budget that cannot fit).
#
#   bash benchmarks/gpu_evidence.sh                  # the embedded corpus, from the repository root
#   bash benchmarks/gpu_evidence.sh runs/shards      # a folder from `stemlm data prepare`
#   bash benchmarks/gpu_evidence.sh --plan           # the plan only (no GPU needed)
#   bash benchmarks/gpu_evidence.sh --cpu-smoke      # the same path at a toy shape on the CPU (no evidence)
#   PYTHON=.venv/bin/python bash benchmarks/gpu_evidence.sh
#
# Every argument goes to gpu_evidence.py. The hard limit (EVIDENCE_TIMEOUT, default 540 s: the 480 s budget and a
# minute's margin) stops a run that its own budget check could not. Exit status: the driver's (2: refused).
# docs/recipe.md ("The GPU evidence run") says how to read the output.
set -u
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
exec timeout "${EVIDENCE_TIMEOUT:-540}" "$PY" benchmarks/gpu_evidence.py "$@"
