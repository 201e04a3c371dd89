#!/usr/bin/env bash
# The GPU checks in one pass, for a GPU machine: kernel validation (dev/cuda), tie-out of the trainer against
# PyTorch in both precisions, and throughput of the two benchmark configs. Logs go to $OUT (default out/).
#   dev/gpu_checks.sh [kernels] [tieout] [bench] [pytest]     (default: all four)
# bench needs the tinyshakespeare shards in data/tinyshakespeare (make data).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
stages=${*:-kernels tieout bench pytest}
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

if [[ $stages == *kernels* ]]; then
    (make -C dev/cuda -j16 all && make -C dev/cuda run_all) > "$OUT/kernels.log" 2>&1 || status=1
    grep -E "FAIL|===|TFLOP|GB/s|passed" "$OUT/kernels.log" | tail -80
fi

if [[ $stages == *tieout* ]]; then
    dbg=$(mktemp -d)
    python3 scripts/train_llama3.py --config test-gqa -B 2 -T 13 --steps 10 --lr 3e-3 --device cuda \
        --write_model $dbg/gqa_model.bin --write_debug $dbg/gqa_debug.bin > /dev/null || status=1
    python3 scripts/train_llama3.py --config llama3.2-1B --depth 2 -B 2 -T 64 --steps 10 --lr 1e-4 --device cuda \
        --write_model $dbg/1b_model.bin --write_debug $dbg/1b_debug.bin > /dev/null || status=1
    for p in FP32 BF16; do
        make -B -j16 train_llama3cu test_llama3cu PRECISION=$p > "$OUT/build_$p.log" 2>&1 || { status=1; tail "$OUT/build_$p.log"; }
        cp train_llama3cu train_llama3cu_$p
        for m in gqa 1b; do
            ./test_llama3cu $dbg/${m}_model.bin $dbg/${m}_debug.bin > "$OUT/tieout_${p}_$m.log" 2>&1 || status=1
            echo "--- tie-out $p $m"; grep -E "^\[|logits|loss  |^d|step (1|10) |FAIL|passed|Error" "$OUT/tieout_${p}_$m.log"
        done
    done
fi

if [[ $stages == *bench* ]]; then
    make -B -j16 train_llama3cu PRECISION=BF16 > /dev/null || status=1
    python3 scripts/bench_vs_pytorch.py --train data/tinyshakespeare/tiny_shakespeare_train.bin --out "$OUT" \
        --extra "" --extra "-O bf16" --extra "-W 0 -O bf16" --extra "-W 0 -O bf16 -R 0" > "$OUT/bench.log" 2>&1 || status=1
    tail -10 "$OUT/bench.log"
    python3 dev/cuda/attention_vs_pytorch.py --iters 20 > "$OUT/attention_vs_pytorch.log" 2>&1 || status=1
    tail -8 "$OUT/attention_vs_pytorch.log"
fi

if [[ $stages == *pytest* ]]; then
    python3 -m pytest -q -x dev/test/test_gpu.py > "$OUT/pytest_gpu.log" 2>&1 || status=1
    tail -15 "$OUT/pytest_gpu.log"
fi
exit $status
