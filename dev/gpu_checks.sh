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
    [ -x train_llama3cu_BF16 ] || { make -B -j16 train_llama3cu PRECISION=BF16 > /dev/null && cp train_llama3cu train_llama3cu_BF16; }
    data="-i data/tinyshakespeare/tiny_shakespeare_train.bin -j data/tinyshakespeare/tiny_shakespeare_val.bin"
    ./train_llama3cu_BF16 -c d12 $data -b 16 -t 1024 -x 20 -v 0 -l 3e-4 > "$OUT/bench_d12.log" 2>&1 || status=1
    ./train_llama3cu_BF16 -c llama3.2-1B $data -b 8 -t 2048 -x 10 -v 0 -l 3e-4 > "$OUT/bench_1b.log" 2>&1 || status=1
    for f in d12 1b; do echo "--- bench $f"; head -4 "$OUT/bench_$f.log"; tail -3 "$OUT/bench_$f.log"; done
fi

if [[ $stages == *pytest* ]]; then
    python3 -m pytest -q -x dev/test/test_gpu.py > "$OUT/pytest_gpu.log" 2>&1 || status=1
    tail -15 "$OUT/pytest_gpu.log"
fi
exit $status
