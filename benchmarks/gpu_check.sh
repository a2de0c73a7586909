#!/usr/bin/env bash
# The CUDA paths CPU tests cannot exercise, in one run of under 8 minutes on one GPU; prints each RESULT line.
#
#   bash benchmarks/gpu_check.sh                # on a machine with a CUDA GPU, from the repository root
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --dry-run      # every line on the CPU at a tiny size (gloo, 2 processes for
#                                               # --nproc), so that no line reaches its first GPU broken
#
# Checks, each bounded by `timeout` so one hang cannot eat the budget:
#   1. train_step: trainer's real step under bf16 autocast, dense vs STEM (row-sparse tables) vs HF Llama.
#   2. host_train: `--tables host` with pinned host tables and the side-stream prefetch vs resident tables.
#   3. host_equal: 20 bf16 steps with --tables host vs --tables device on the GPU; losses must agree to 2e-2
#      (bitwise is a CPU guarantee; on CUDA the host-side optimizer and the norm run on another device).
#   4. decode_offload: host tables behind the hot-row cache at the paper-350m shape with vocab 8192.
#   5. nproc_smoke: 2 bf16 steps of `stemlm train --nproc N` (N = visible GPUs, at most 2: NCCL, FSDP2 with its
#      bf16 MixedPrecisionPolicy, chunked loss, activation checkpointing) on shards from `stemlm data prepare`;
#      then its sharded checkpoint resumed for a third step and exported (`stemlm export`).
#   6. host_shards_smoke: 3 bf16 steps of `--nproc N --tables host --grad-accum 2` (pinned row shards gathered
#      ahead on a side stream, the host plan, the async row exchange, the table update on the worker thread),
#      under `--profile --memory-snapshot` (CUDA profiler activity and the allocator history must be written).
#   7. exchange (2+ GPUs only): `table_comm.py --exchange --device cuda`, the host-planned, ahead-issued exchange
#      vs the collective plan on NCCL.
#   8. serve_throughput: the continuous-batching engine (stemlm serve's decode loop) at concurrency 1, 4, 16
#      with resident and host tables at the paper-350m shape; batched outputs must equal single-stream greedy.
#   Close to the machine (issue 23), in their own block at the end:
#   9. fused_loss: the fused lm_head + cross-entropy against the plain loss in bf16 at V = 8192 and 131072
#      (time and CUDA-allocator peak ratios).
#  10. decode_speed: the tiny decode step (ours dense and STEM, HF generate) against the HBM read bound measured
#      in the same (wall) clock: share_of_bound and ours/HF.
#   With vLLM (in their own block at the end; skipped, not failed, where `$VLLM_PYTHON` (default: $PYTHON) cannot
#   import vllm, as on a machine set up without it; docs/vllm.md):
#  11. vllm_tables: tests/vllm/test_engine.py and test_serve.py on the GPU, where the STEM server's
#      `--cpu-offload-params stem_embedding` really moves the tables to pinned host memory (UVA): greedy tokens must
#      equal stemlm's, dense (vllm.LLM) and STEM (vLLM's server).
#  12. vllm_serve: serve_throughput.py --vllm --host-tables, stemlm serve against vLLM (resident and host tables)
#      over HTTP at 1 and 16 streams at the paper-350m shape with vocab 8192: vllm_over_stemlm.
# Exit status: the number of failed checks. Prepared on a CPU-only machine; see docs/results.md ("GPU check").
# --dry-run runs the same commands with --device cpu and, from `small`, flags appended that shrink them (argparse
# keeps the last value of a repeated flag); the measured figures then mean nothing, only "ok" does.
#
#   bash benchmarks/gpu_check.sh evidence [SHARD_DIR]   # instead of the checks: the GPU evidence run alone
# runs benchmarks/gpu_evidence.sh (dense, dense_embed and STEM under --recipe official at matched FLOPs, 2 seeds;
# at most 8 minutes of its own, so not added to the checks' 8) and shows its plan, runs and RESULT lines; see
# docs/recipe.md ("The GPU evidence run").
set -u
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
failed=0
dry=0
if [ "${1:-}" = --dry-run ]; then
  dry=1
  shift
fi
DEV=cuda
SEQ=256
SNAPSHOT=--memory-snapshot
if [ "$dry" = 1 ]; then
  DEV=cpu
  SEQ=32
  SNAPSHOT=  # torch keeps no allocation history on the CPU (stemlm.train.profiling refuses the flag there)
  export OMP_NUM_THREADS=1
fi
# small NAME: the flags that shrink NAME's line to a tiny CPU run under --dry-run, nothing otherwise; the lines
# leave $(small NAME) unquoted so that its flags split into words.
small() {
  [ "$dry" = 1 ] || return 0
  case $1 in
    train_step) echo --hidden 32 --layers 2 --heads 2 --ffn-dim 64 --stem-layers 1 --batch 2 --seq 16 \
      --fused-chunk 8 --warmup 1 --reps 1 ;;
    host_train) echo --batch 2 --seq 16 --warmup 1 --reps 1 ;;
    exchange) echo --batch 4 --seq 16 --grad-accum 2 --warmup 1 --reps 1 ;;
    decode_offload) echo --preset tiny --decode 4 --prompt 4 --warmup 8 --reps 1 --warm-chars 2000 \
      --ppl-tokens 64 --ppl-window 32 --fractions 0,0.2 --table-dtypes fp32,int8 ;;
    serve_throughput) echo --preset tiny --set hidden_size=32 --set intermediate_size=64 --set num_hidden_layers=2 \
      --prompt 6 --new 3 --reps 1 --concurrency 1,3 ;;
    fused_loss) echo --vocabs 64,256 --tokens 96 --hidden 16 --chunk 40 --reps 1 ;;
    decode_speed) echo --prompt 4 --new 3 --reps 1 --stream-mib 8 ;;
    vllm_serve) echo --preset tiny --set hidden_size=64 --set intermediate_size=128 --set num_hidden_layers=2 \
      --set num_attention_heads=2 --set num_key_value_heads=1 --prompt 8 --new 4 --requests 1 --concurrency 1,3 ;;
  esac
}
run() {  # run NAME SECONDS CMD...: show the RESULT lines (or the tail on failure)
  local name=$1 limit=$2
  shift 2
  local log
  log=$(mktemp)
  local start=$SECONDS
  if timeout "$limit" "$@" >"$log" 2>&1; then
    echo "[$name] ok in $((SECONDS - start)) s"
    grep -E "${SHOW:-^(RESULT|STEM/dense|host worker|shape:)}" "$log" || tail -3 "$log"
  else
    echo "[$name] FAILED (exit $?) after $((SECONDS - start)) s; last lines:"
    tail -15 "$log"
    failed=$((failed + 1))
  fi
  rm -f "$log"
}

if [ "$dry" = 1 ]; then
  echo "device: cpu (dry run)"
else
  "$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('device:', torch.cuda.get_device_name(0) if ok else 'no CUDA'); sys.exit(0 if ok else 1)" || exit 1
fi

if [ "${1:-}" = evidence ]; then
  shift
  SHOW='^(RESULT|plan:|seed |stem_minus_|budget:)' run gpu_evidence 570 bash benchmarks/gpu_evidence.sh "$@"
  echo "gpu_check: $failed failed"
  exit "$failed"
fi

run train_step 120 "$PY" benchmarks/train_step.py --device $DEV --dtype bf16 --reps 30 --warmup 5 $(small train_step)
run host_train 120 "$PY" benchmarks/host_train.py --device $DEV --dtype bf16 --reps 30 --warmup 5 $(small host_train)
DEV=$DEV DRY=$dry run host_equal 120 "$PY" - <<'PYEOF'
import os
import tempfile
from stemlm.train import Trainer, TrainConfig
from stemlm.model.presets import get_preset
losses = {}
steps, small = (2, dict(batch_size=2, seq_len=32)) if os.environ["DRY"] == "1" else (20, {})
with tempfile.TemporaryDirectory() as tmp:
    for tables in ("device", "host"):
        cfg = TrainConfig(steps=steps, device=os.environ["DEV"], dtype="bf16", table_optim="rowwise_adagrad",
                          tables=tables, eval_every=0, out=f"{tmp}/{tables}", **small)
        trainer = Trainer(get_preset("tiny"), cfg, progress=False)
        records = [trainer.train_step()["loss"] for _ in range(cfg.steps)]
        losses[tables] = records
        if tables == "host":
            summary = trainer.tables.summary(trainer.optimizers)
diff = max(abs(a - b) for a, b in zip(losses["device"], losses["host"]))
print(f"step-{steps} loss device {losses['device'][-1]:.4f} host {losses['host'][-1]:.4f}; max |diff| {diff:.2e}; "
      f"kept off the GPU {summary['device_bytes_saved'] / 2**20:.1f} MiB")
print(f"RESULT host_equal_max_loss_diff={diff:.2e} overlap={summary['host_overlap']:.3f}")
assert diff < 2e-2, diff
PYEOF
smoke_dir=$(mktemp -d)
"$PY" -c "from stemlm.data import load_embedded_corpus as c; open('$smoke_dir/corpus.txt','w').write(c()[0].text)"
if [ "$dry" = 1 ]; then
  gpus=2  # gloo processes on the CPU
else
  gpus=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")
fi
run nproc_smoke 360 bash -c "'$PY' -m stemlm.cli.main data prepare '$smoke_dir/corpus.txt' --out '$smoke_dir/shards' \
  --workers 2 --no-progress && '$PY' -m stemlm.cli.main train --data '$smoke_dir/shards' --nproc $gpus \
  --device $DEV --dtype bf16 --parallel fsdp --steps 2 --batch-size 2 --seq-len $SEQ --loss-chunk $SEQ \
  --activation-checkpointing --sample-tokens 0 --no-progress --out '$smoke_dir/run' --json \
  && '$PY' -m stemlm.cli.main train --resume '$smoke_dir/run' --steps 3 --nproc $gpus --sample-tokens 0 \
  --no-progress --json && '$PY' -m stemlm.cli.main export '$smoke_dir/run' --out '$smoke_dir/exported' \
  && echo RESULT nproc_smoke_ok=1 ranks=$gpus"
run host_shards_smoke 180 bash -c "'$PY' -m stemlm.cli.main train --data '$smoke_dir/shards' --nproc $gpus \
  --device $DEV --dtype bf16 --tables host --table-optim rowwise_adagrad --steps 3 --grad-accum 2 --batch-size 2 \
  --seq-len $SEQ --sample-tokens 0 --no-progress --out '$smoke_dir/host_run' --json --profile $SNAPSHOT \
  && { [ -z '$SNAPSHOT' ] || test -s '$smoke_dir/host_run/profile/memory-rank0.pickle'; } \
  && test -s '$smoke_dir/host_run/profile/summary-rank0.txt' \
  && echo RESULT host_shards_smoke_ok=1 ranks=$gpus"
rm -rf "$smoke_dir"
if [ "$gpus" -ge 2 ]; then
  run exchange 300 "$PY" benchmarks/table_comm.py --exchange --device $DEV --grad-accum 4 --reps 10 $(small exchange)
fi
run decode_offload 180 "$PY" benchmarks/decode_offload.py --device $DEV --preset paper-350m --set vocab_size=8192 \
  --decode 128 --warmup 32 --reps 2 --warm-chars 200000 --ppl-tokens 4000 $(small decode_offload)
run serve_throughput 240 "$PY" benchmarks/serve_throughput.py --device $DEV --preset paper-350m \
  --set vocab_size=8192 --prompt 64 --new 32 --reps 2 $(small serve_throughput)
# --- close to the machine (issue 23): small entries, about a minute together ---
run fused_loss 120 "$PY" benchmarks/fused_loss.py --device $DEV --dtype bf16 --vocabs 8192,131072 --reps 5 \
  $(small fused_loss)
run decode_speed 120 "$PY" benchmarks/decode_speed.py --device $DEV --clock wall --reps 3 $(small decode_speed)
# --- vLLM (issue 37): only where vllm imports; a vLLM start is about a minute, so these take longer ---
VLLM_PY=${VLLM_PYTHON:-$PY}
if "$VLLM_PY" -c "import vllm" >/dev/null 2>&1; then
  run vllm_tables 420 "$VLLM_PY" -m pytest -q -p no:cacheprovider tests/vllm/test_engine.py tests/vllm/test_serve.py
  run vllm_serve 540 "$VLLM_PY" benchmarks/serve_throughput.py --vllm --host-tables --device $DEV \
    --preset paper-350m --set vocab_size=8192 --prompt 64 --new 32 --reps 1 $(small vllm_serve)
else
  for name in vllm_tables vllm_serve; do
    echo "[$name] skipped: $VLLM_PY cannot import vllm (set VLLM_PYTHON to a venv with vllm and stemlm, docs/vllm.md)"
  done
fi
echo "gpu_check: $failed failed"
exit "$failed"
