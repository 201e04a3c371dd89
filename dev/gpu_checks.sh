#!/usr/bin/env bash
# The GPU checks in one pass, for a GPU machine: kernel validation (dev/cuda), tie-out of the trainer against
# PyTorch in both precisions, and throughput of the two benchmark configs. Logs go to $OUT (default out/).
#   dev/gpu_checks.sh [kernels] [tieout] [bench] [pytest]     (default: all four)
#   dev/gpu_checks.sh multigpu multibench multi8b             (2 or more GPUs: tests, side by side, the 8B)
# bench needs the tinyshakespeare shards in data/tinyshakespeare (make data); the multi-GPU stages use random tokens.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
stages=${*:-kernels tieout bench pytest}
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

# kernels and tie-out: the pytest files `make test` runs, which build in a temporary directory
if [[ " $stages " == *" kernels "* ]]; then
    python3 -m pytest -q -rs dev/test/test_kernels_gpu.py > "$OUT/kernels.log" 2>&1 || status=1
    tail -5 "$OUT/kernels.log"
fi

if [[ " $stages " == *" tieout "* ]]; then
    python3 -m pytest -q -s -rs -k tie_out dev/test/test_gpu.py > "$OUT/tieout.log" 2>&1 || status=1
    grep -E "^\[|^bounds|logits|loss  |^d|step (1|10) |FAIL|passed|Error" "$OUT/tieout.log"
fi

if [[ " $stages " == *" bench "* ]]; then
    make -j16 train_llama3cu PRECISION=BF16 > /dev/null || status=1
    python3 scripts/bench_vs_pytorch.py --train data/tinyshakespeare/tiny_shakespeare_train.bin --out "$OUT" \
        --extra "" --extra "-O bf16" --extra "-W 0 -O bf16" --extra "-W 0 -O bf16 -R 0" > "$OUT/bench.log" 2>&1 || status=1
    tail -10 "$OUT/bench.log"
    python3 dev/cuda/attention_vs_pytorch.py --iters 20 > "$OUT/attention_vs_pytorch.log" 2>&1 || status=1
    tail -8 "$OUT/attention_vs_pytorch.log"
fi

if [[ " $stages " == *" pytest "* ]]; then
    python3 -m pytest -q -x dev/test/test_gpu.py > "$OUT/pytest_gpu.log" 2>&1 || status=1
    tail -15 "$OUT/pytest_gpu.log"
fi
random_shard() {  # random_shard PATH TOKENS: an llm.c shard of uniform random ids below 128256
    python3 -c "import numpy as np, sys; n = int(sys.argv[2]); h = np.zeros(256, np.int32); h[:3] = [20240801, 7, n]
open(sys.argv[1], 'wb').write(h.tobytes() + np.random.default_rng(0).integers(0, 128256, n, dtype=np.uint32).tobytes())" "$1" "$2"
}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
gpus=$(nvidia-smi -L | grep -c GPU)

if [[ " $stages " == *" multigpu "* ]]; then
    python3 -m pytest -v -s dev/test/test_multi_gpu.py > "$OUT/pytest_multi_gpu.log" 2>&1 || status=1
    grep -E "PASSED|FAILED|SKIPPED|ERROR|max \|loss|passed|failed" "$OUT/pytest_multi_gpu.log" | tail -30
fi

if [[ " $stages " == *" multibench "* ]]; then
    mkdir -p .devdata && random_shard .devdata/random_train.bin 8000000
    make -j16 train_llama3cu PRECISION=BF16 > /dev/null || status=1
    python3 scripts/bench_multi_gpu.py --gpus "$gpus" --train .devdata/random_train.bin --out "$OUT" \
        ${MULTIBENCH_FLAGS:-} > "$OUT/bench_multi_gpu.log" 2>&1 || status=1
    tail -22 "$OUT/bench_multi_gpu.log"
fi

if [[ " $stages " == *" multi8b "* ]]; then
    mkdir -p .devdata && random_shard .devdata/random_train.bin 8000000
    make -j16 train_llama3cu PRECISION=BF16 > /dev/null || status=1
    mpirun -np "$gpus" --bind-to none -x NCCL_NVLS_ENABLE ./train_llama3cu -c llama3.1-8B -i .devdata/random_train.bin \
        -j "" -b 1 -t 8192 -R 2 -x 8 -l 1e-4 -v 0 > "$OUT/multi_8b.log" 2>&1 || status=1
    grep -E "^device|^batch|^multi-GPU|^memory|step +[0-9]+/|summary|Error|error" "$OUT/multi_8b.log" | tail -14
fi
exit $status
