#!/usr/bin/env bash
# The prepared GPU check (one call on a lent GPU machine; about 3-5 minutes).
# Needs jax with CUDA, numpy; installs nothing. Results go to ${OUT:-benchmarks/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 480 python3 -m benchmarks.gpu_check --out "${OUT:-benchmarks/results}"
