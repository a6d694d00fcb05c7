#!/usr/bin/env bash
# The device check, for a machine with an accelerator (one device is enough): our engine at world
# size 1 on it (bf16 / fp16 policies, pinned CPU offload, the memory probe on the allocator, the
# bitwise rerun under deterministic settings), then the benchmark of the L3 decoder, ours against
# torch FSDP2. Prints everything; the output also lands in $OUT/device_check.log when OUT is set.
#   bash tools/device_check.sh            (about 2 minutes on one GPU; on a CPU it runs on the CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
log="${OUT:-/tmp}/device_check.log"
{
  python - <<'PY'
import torch
print("torch", torch.__version__, "accelerator:", torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None)
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
PY
  python -m torch.distributed.run --standalone --nproc-per-node 1 tools/device_check.py; check=$?
  BENCH_NPROC=1 python benchmarks/bench_fsdp2.py --models decoder --steps 5 --warmup 2; bench=$?
  echo "device check exit $check, bench exit $bench"
  exit $(( check || bench ))
} 2>&1 | tee "$log"
