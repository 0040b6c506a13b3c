#!/usr/bin/env bash
# The prepared GPU check: one `run` call with timeout_s 590 on a lent GPU machine (parts
# capped at 350 + 180 + 45 s, most wanted first; a device command may run 600 s): kernels vs
# the references, an engine's log-probs vs the trainer's bit for bit (XLA's dots and the
# batch-invariant kernels, JAXRL_CACHE_KERNELS=pallas), tiled_matmul and prefill and decode
# timings (exact and exact=False), the demo with --kernels pallas, row_invariance.
# Each section's results are written as soon as it ends: a timeout keeps what was measured.
# Needs jax with CUDA, numpy; installs nothing. Results go to ${OUT:-benchmarks/results}.
#   benchmarks/gpu_check.sh            # on the GPU machine
#   benchmarks/gpu_check.sh --smoke    # CPU dry run: tiny shapes, interpret mode (~1-2 min)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
if [[ "${1:-}" == "--smoke" ]]; then
  JAX_PLATFORMS=cpu exec timeout 600 "$PY" -m benchmarks.gpu_check --smoke \
    --out "${OUT:-${TMPDIR:-/tmp}/gpu_check_smoke}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 350 "$PY" -m benchmarks.gpu_check --out "${OUT:-benchmarks/results}" || echo "gpu_check: exit $?"
# the path users run: the built-in demo with the batch-invariant kernels, 6 GRPO steps (each
# logs its sampler/trainer mismatch and the audit's tolerance; ~320 audited tokens a step, so
# if every bit reproduces, the run adopts tolerance 0 after step 3: audit_exact_tokens); ~2 min
RUN="${TMPDIR:-/tmp}/gpu_demo_pallas"
rm -rf "$RUN"
timeout 180 "$PY" -m jaxrl_cache.app.cli demo --kernels pallas --steps 6 --sft-steps 40 \
  --out "$RUN" > "${OUT:-benchmarks/results}/gpu_demo_pallas.log" 2>&1 || echo "demo: exit $?"
"$PY" -m benchmarks.gpu_demo_summary "$RUN" --label "demo --kernels pallas" \
  | tee "${OUT:-benchmarks/results}/gpu_demo_pallas.txt" || true
# which matmul formulation / XLA flags keep a row's bits at any row count (issue 33); ~1 min
timeout 45 "$PY" -m benchmarks.row_invariance \
  --json "${OUT:-benchmarks/results}/row_invariance.json" || true
