#!/usr/bin/env bash
# Resharding, the socket transport and the multi-GPU bench (issues 36 and 37) on a machine with 2 or more GPUs and
# OpenMPI's mpirun; about five minutes on 2 H100s. Logs go to $OUT (default out/reshard_check).
#   dev/test/reshard_check.sh
# Each stage prints PASS or FAIL; the run passes when all do (exit status 0):
#   build     make cpu and ./train_llama3cu with MPI (the host checks of test_reliability.py run this binary)
#   cpu       resharding's ranges and state files (test_multi_gpu_cpu.py), the loader, the trainer's host checks
#   multigpu  dev/test/test_multi_gpu.py, which builds its own FP32 and BF16 trainers with MPI; the cases for 4 and 8
#             GPUs run only where that many GPUs are. Its tables (resumed against uninterrupted losses, the socket
#             run's transport and tok/s) are in multigpu.log, and the lines that matter are printed below.
#   bench     scripts/bench_multi_gpu.py on llama3.2-1B (B=8, T=2048 per GPU, random tokens): ours on 1 GPU and on
#             2 GPUs with ZeRO-1 over NCCL's default transport, then 2 GPUs over its socket transport alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/reshard_check}
source dev/test/gpu_check_common.sh

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
stage build make -j16 cpu train_llama3cu USE_MPI=1
stage cpu python3 -m pytest -q -rs dev/test/test_multi_gpu_cpu.py dev/test/test_reliability.py dev/test/test_data.py
stage multigpu python3 -m pytest -v -s -rs dev/test/test_multi_gpu.py
grep -E "(PASSED|FAILED|SKIPPED|ERROR)( |$)|^ *[0-9]+ \| [0-9.]+ [0-9.]+ \||tok/s|reads, |^worst" "$OUT/multigpu.log"
grep -E "[0-9]+ (passed|failed)" "$OUT/multigpu.log"

random_tokens
bench=(python3 scripts/bench_multi_gpu.py --gpus 2 --torch none --steps 10 --train .devdata/random_train.bin)
stage bench_default "${bench[@]}" --ours 1,Z1 --out "$OUT/default"
stage bench_socket "${bench[@]}" --ours Z1 --transport socket --out "$OUT/socket"
grep -E "^ours|^our scaling" "$OUT/bench_default.log" "$OUT/bench_socket.log"
exit $status
