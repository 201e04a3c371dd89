#!/usr/bin/env bash
# ZeRO-3 (-Z 3, issue 36) on a machine with 2 or more GPUs and OpenMPI's mpirun. Logs go to $OUT (default
# out/zero3_check).
#   dev/test/zero3_check.sh                 # every part, in order
#   dev/test/zero3_check.sh build cpu       # some parts (each fits a 10-minute command; run them in this order)
# Each part prints PASS or FAIL and its lines that matter; the run passes when all do (exit status 0):
#   build        make cpu and ./train_llama3cu with MPI (BF16), and that the FP32 and non-MPI builds compile
#   cpu          the slot layout, resharding and bench plans (test_multi_gpu_cpu.py), the trainer's host checks
#                (test_reliability.py: -Z 3 refused on one GPU)
#   equivalence  test_multi_gpu.py: ZeRO 0 to 3 bit for bit in FP32, BF16 and FP8 (losses, samples, model files),
#                their optimizer state files (which test_multi_gpu.py builds its own FP32 and BF16 trainers for)
#   resume3      test_multi_gpu.py: resume bit for bit with ZeRO-3, also with -W 0 -O bf16, -R 2, -g and FP8
#   resume012    the same at the other stages (their code changed too: the weights' waits, stage 2's head)
#   reshard      test_multi_gpu.py: resharding to and from ZeRO-3 (other stage: bit for bit; other GPU count: the
#                loss continues to rounding)
#   bench        scripts/bench_multi_gpu.py: llama3.2-1B, B=8, T=2048 per GPU, random tokens, ours on 1 GPU and on
#                2 GPUs with ZeRO-1 and ZeRO-3 (scaling, tok/s, memory per GPU)
#   8b           llama3.1-8B, T=8192, B=1 per GPU, fp32 master weights and AdamW (no -W 0, no -O bf16), -R 2, -Z 3
#                on 2 GPUs, 8 steps: tok/s and memory per GPU; FAIL above 76 GiB
#   fsdp8b       the same model and batch with PyTorch FSDP2 (full shard, torch.compile, each layer recomputed), for
#                the ratio; reported, never FAIL (PyTorch may be missing or out of memory)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-out/zero3_check}
source dev/test/gpu_check_common.sh
MPIRUN=(mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE)

multigpu() {  # multigpu NAME -k EXPRESSION: the cases of test_multi_gpu.py that match
    stage "$1" python3 -m pytest -v -s -rs dev/test/test_multi_gpu.py -k "$2"
    grep -E "(PASSED|FAILED|SKIPPED|ERROR)( |$)|^Z[0-3]: peak mem|^ *[0-9]+ \| [0-9.]+ [0-9.]+ \||reads, " \
        "$OUT/$1.log"
    grep -E "[0-9]+ (passed|failed)" "$OUT/$1.log"
}

build() {
    make -j16 cpu train_llama3cu USE_MPI=1 &&
        make -j16 train_llama3cu PRECISION=FP32 USE_MPI=1 && make -j16 train_llama3cu USE_MPI=0 &&
        make -j16 train_llama3cu USE_MPI=1  # the binary the other parts run: BF16 with MPI
}

eight_b() {  # fails when a GPU needed more than 76 GiB
    "${MPIRUN[@]}" ./train_llama3cu -c llama3.1-8B -i .devdata/random_train.bin -j "" -b 1 -t 8192 -x 8 -l 3e-4 \
        -v 0 -R 2 -Z 3 || return 1
    python3 - "$OUT/8b.log" <<'EOF'
import re, sys
peak = float(re.search(r"summary: .*peak mem (\S+) GiB", open(sys.argv[1]).read()).group(1))
print(f"peak {peak:.2f} GiB per GPU (limit 76)")
sys.exit(0 if peak <= 76.0 else 1)
EOF
}

run_part() {
    case $1 in
        build) nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
               stage build build ;;
        cpu) stage cpu python3 -m pytest -q -rs dev/test/test_multi_gpu_cpu.py dev/test/test_reliability.py ;;
        equivalence) multigpu equivalence "zero_stages_agree or resharded_state or tied_embedding or eval_and_export" ;;
        resume3) multigpu resume3 "resume_is_bit_identical and Z3" ;;
        resume012) multigpu resume012 "resume_is_bit_identical and not Z3" ;;
        reshard) multigpu reshard "reshard_to_another" ;;
        bench) random_tokens
               stage bench python3 scripts/bench_multi_gpu.py --gpus 2 --torch none --ours 1,Z1,Z3 --steps 15 \
                   --train .devdata/random_train.bin --out "$OUT/bench"
               grep -E "^ours|^our scaling" "$OUT/bench.log" ;;
        8b) random_tokens
            stage 8b eight_b
            grep -E "^multi-GPU|^ZeRO-3:|^memory|^step +[0-9]+/|^summary|^peak" "$OUT/8b.log" ;;
        fsdp8b) random_tokens
                if python3 -m torch.distributed.run --nproc_per_node=2 scripts/bench_multi_gpu.py --worker fsdp \
                    --config llama3.1-8B -B 1 -T 8192 --steps 8 --train .devdata/random_train.bin \
                    --activation_checkpointing > "$OUT/fsdp8b.log" 2>&1; then
                    echo "INFO fsdp8b: $(grep -E '^summary' "$OUT/fsdp8b.log")"
                else
                    echo "INFO fsdp8b did not run to the end (see $OUT/fsdp8b.log): $(tail -n 1 "$OUT/fsdp8b.log")"
                fi ;;
        *) echo "unknown part '$1': build, cpu, equivalence, resume3, resume012, reshard, bench, 8b, fsdp8b"
           status=1 ;;
    esac
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(build cpu equivalence resume3 resume012 reshard bench 8b fsdp8b)
for part in "${parts[@]}"; do run_part "$part"; done
exit $status
