#!/usr/bin/env bash
# Issue 36: how much of the gradient reduction a ZeRO-1 step on 2 GPUs leaves exposed (llama3.2-1B, B=8, T=2048 per
# GPU, random tokens), and NCCL's own levers, on a machine with 2 GPUs and OpenMPI's mpirun. Fits in 9 minutes.
#   dev/test/overlap_check.sh                       # logs in $OUT (default out/overlap_check)
#   STEPS=20 BUDGET=400 dev/test/overlap_check.sh   # more steps per run; stop starting runs after 400 s
# Builds train_llama3cu (BF16, MPI), then runs, each under `timeout`, $STEPS steps (default 12; median and mean over
# the steps after the first 3):
#   one           1 GPU
#   z1            2 GPUs, -Z 1 (NCCL's init log: $OUT/nccl_z1.*.log, its channels summarised)
#   z1_q0         2 GPUs, -Z 1 -Q 0: each collective waited for as soon as it is queued (the serial cost)
#   trace         nsys, if installed: 2 GPUs -Z 1, 6 steps; rank 0's kernel summary (NCCL's kernels and the top ones),
#                 the NVTX regions, and dev/test/overlap_trace.py: per step the compute, NCCL, NCCL-alone (exposed
#                 communication, by collective) and idle times; without nsys, the same from dev/kernel_trace.so on
#                 both ranks (10 steps)
#   one_again, z1_again   the baseline pair again: the run-to-run spread
# then NCCL's levers, each a -Z 1 run (the first to go when the budget runs out):
#   z1_ch8/ch4    NCCL_MAX_NCHANNELS=8 / 4: fewer channels (CTAs, so SMs) for NCCL beside the GEMMs
#   z1_cta16      NCCL_MIN_CTAS=16 NCCL_MAX_CTAS=16 (NCCL 2.17 on)
#   z1_ctaeff     NCCL_CTA_POLICY=1, NCCL's efficiency policy: as few CTAs as give decent bandwidth (NCCL 2.27 on)
#   z1_conn1      CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue, kernels of all streams start in launch order
# and prints a table: median and mean step, tok/s, scaling (the 1-GPU median over the run's), and exposed = the run's
# median minus the 1-GPU median (mean of one and one_again); the serial cost is z1_q0's. The 2-GPU step also does half
# the optimizer's work (about 5 ms less at the 1B), so a fully hidden reduction shows a negative exposed time.
# Runs that would end past BUDGET seconds (default 500; estimated from the longest run so far) are skipped and say so.
# NCCL_NVLS_ENABLE=0 (NVLink multicast off) is set for every run and handed to every rank.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-out/overlap_check}
STEPS=${STEPS:-12}
BUDGET=${BUDGET:-500}
# shellcheck source=dev/test/gpu_check_common.sh
source dev/test/gpu_check_common.sh
rm -f "$OUT/runs.txt" "$OUT"/nccl_z1.*.log
MPIRUN=(mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE)
COMMON=(-c llama3.2-1B -i .devdata/random_train.bin -j "" -b 8 -t 2048 -l 3e-4 -v 0)
START=$SECONDS
longest=60  # the longest run so far, in seconds (a first guess until one has run)

gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "$gpus" -lt 2 ] || ! command -v mpirun > /dev/null; then
    echo "needs 2 GPUs and OpenMPI's mpirun (GPUs: $gpus, mpirun: $(command -v mpirun || echo none))"
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | sort | uniq -c

fits() {  # fits NAME SECONDS: whether a run of about SECONDS still ends within the budget (else says it is skipped)
    if (( SECONDS - START + $2 > BUDGET )); then
        echo "SKIP $1: $((SECONDS - START)) s gone, about $2 s more would pass the budget of $BUDGET s"
        return 1
    fi
}

limit() {  # limit CAP: a command's timeout, CAP seconds at most and no later than 30 s past the budget
    local left=$((BUDGET + 30 - (SECONDS - START)))
    (( left < 10 )) && left=10
    echo $(( left < $1 ? left : $1 ))
}

run() {  # run NAME GPUS "VAR=VALUE ..." TRAINER-FLAGS...: one run, its log in $OUT/NAME.log, a line in runs.txt
    local name=$1 n=$2 vars=$3
    shift 3
    fits "$name" "$longest" || return 0
    local forward=() cmd=()
    for kv in $vars; do forward+=(-x "${kv%%=*}"); done
    if [ "$n" = 1 ]; then cmd=(./train_llama3cu); else cmd=("${MPIRUN[@]}" "${forward[@]}" ./train_llama3cu); fi
    local t0=$SECONDS
    # shellcheck disable=SC2086  # vars: VAR=VALUE words for env
    env $vars timeout "$(limit 150)" "${cmd[@]}" "${COMMON[@]}" -x "$STEPS" "$@" > "$OUT/$name.log" 2>&1
    local rc=$? took=$((SECONDS - t0))
    (( took > longest )) && longest=$took
    echo "$name|$n|$vars|$*|$rc|$took" >> "$OUT/runs.txt"
    local summary
    summary=$(grep -E "^summary" "$OUT/$name.log")
    if [ $rc -eq 0 ] && [ -n "$summary" ]; then echo "ran $name (${took} s): $summary"
    else echo "FAIL $name (exit $rc, see $OUT/$name.log): $(tail -n 2 "$OUT/$name.log" | tr '\n' ' ')"; fi
}

nccl_at_least() {  # nccl_at_least 2.27: the NCCL version z1 printed is at least that (true when unknown)
    local v
    v=$(grep -oE "\| NCCL [0-9]+\.[0-9]+\.[0-9]+" "$OUT/z1.log" 2>/dev/null | grep -oE "[0-9]+\.[0-9]+\.[0-9]+")
    [ -z "$v" ] && return 0
    [ "$(printf '%s\n%s\n' "$1" "$v" | sort -V | head -n 1)" = "$1" ]
}

kernel_trace() {  # without nsys: dev/kernel_trace.so (CUPTI) on each rank, 2 GPUs, -Z 1, 10 steps
    fits trace $((longest + 60)) || return 0
    if ! make dev/kernel_trace.so > "$OUT/trace_build.log" 2>&1; then
        echo "SKIP trace: no nsys, and dev/kernel_trace.so did not build (see $OUT/trace_build.log)"
        return 0
    fi
    rm -f "$OUT"/trace_*.txt
    # each rank's shell names its own file and preloads the tracer into the trainer alone
    # shellcheck disable=SC2016
    timeout "$(limit 150)" "${MPIRUN[@]}" bash -c \
        'export TRACE_FILE=$0/trace_$OMPI_COMM_WORLD_RANK.txt LD_PRELOAD=$1; shift; exec "$@"' \
        "$OUT" "$PWD/dev/kernel_trace.so" ./train_llama3cu "${COMMON[@]}" -x 10 -Z 1 > "$OUT/trace.log" 2>&1
    if [ ! -s "$OUT/trace_0.txt" ]; then echo "FAIL trace (see $OUT/trace.log)"; return 0; fi
    for rank in 0 1; do
        echo "rank $rank (dev/kernel_trace.so):"
        timeout "$(limit 60)" python3 dev/test/overlap_trace.py "$OUT/trace_$rank.txt" --skip 3 |
            tee "$OUT/trace_exposed_$rank.txt"
    done
}

trace() {  # nsys on 2 GPUs, -Z 1, 6 steps; rank 0's kernels
    if ! command -v nsys > /dev/null; then kernel_trace; return 0; fi
    fits trace $((longest * 2 + 90)) || return 0
    rm -f "$OUT"/trace_*.nsys-rep "$OUT"/trace_*.sqlite
    local t0=$SECONDS profile=(nsys profile -s none --cpuctxsw=none -f true -o "$OUT/trace_%q{OMPI_COMM_WORLD_RANK}")
    if ! timeout "$(limit 200)" "${MPIRUN[@]}" "${profile[@]}" -t cuda,nvtx,mpi --mpi-impl=openmpi ./train_llama3cu \
            "${COMMON[@]}" -x 6 -Z 1 > "$OUT/trace.log" 2>&1 || [ ! -f "$OUT/trace_0.nsys-rep" ]; then
        echo "trace with MPI tracing failed (see $OUT/trace.log); again with CUDA and NVTX only"
        fits trace $((longest * 2 + 60)) || return 0
        timeout "$(limit 200)" "${MPIRUN[@]}" "${profile[@]}" -t cuda,nvtx ./train_llama3cu "${COMMON[@]}" -x 6 -Z 1 \
            > "$OUT/trace.log" 2>&1
    fi
    if [ ! -f "$OUT/trace_0.nsys-rep" ]; then echo "FAIL trace (see $OUT/trace.log)"; return 0; fi
    timeout "$(limit 120)" nsys stats -f table --report cuda_gpu_kern_sum --report nvtx_sum \
        "$OUT/trace_0.nsys-rep" > "$OUT/trace_stats.txt" 2>&1 ||
        timeout "$(limit 120)" nsys stats -f table --report gpukernsum --report nvtxsum "$OUT/trace_0.nsys-rep" \
            > "$OUT/trace_stats.txt" 2>&1
    [ -f "$OUT/trace_0.sqlite" ] || timeout "$(limit 120)" nsys export --type sqlite -o "$OUT/trace_0.sqlite" \
        "$OUT/trace_0.nsys-rep" > /dev/null 2>&1
    echo "trace ($((SECONDS - t0)) s): $OUT/trace_0.nsys-rep, kernel and NVTX sums in $OUT/trace_stats.txt"
    echo "rank 0's NCCL kernels (time %, total ns, instances, avg, med, min, max, stddev, name):"
    grep -iE "nccl" "$OUT/trace_stats.txt" | head -n 8
    timeout "$(limit 60)" python3 dev/test/overlap_trace.py "$OUT/trace_0.sqlite" --skip 1 |
        tee "$OUT/trace_exposed.txt"
}

summary() {
    if [ ! -f "$OUT/runs.txt" ]; then echo "no run finished"; return 0; fi
    python3 - "$OUT" <<'EOF'
import re, statistics, sys
out = sys.argv[1]
rows = []
for line in open(f"{out}/runs.txt"):
    name, n, env, flags, rc, took = line.rstrip("\n").split("|")
    text = open(f"{out}/{name}.log", errors="replace").read()
    m = re.search(r"summary: median step (\S+) ms over \d+ steps \| (\d+) tok/s.*?peak mem (\S+) GiB", text)
    steps = [float(x) for x in re.findall(r"^step +\d+/\d+ \|.*?\| ([\d.]+) ms", text, re.M)][3:]
    if rc != "0" or not m or not steps:
        rows.append((name, n, env, flags, None))
        continue
    rows.append((name, n, env, flags, (float(m.group(1)), statistics.mean(steps), int(m.group(2)),
                                       float(m.group(3)), max(steps) - min(steps))))
ones = [r[4][0] for r in rows if r[1] == "1" and r[4]]
one = statistics.mean(ones) if ones else None
print(f"\nllama3.2-1B, B=8 T=2048 per GPU, random tokens; medians and means over the steps after the first 3")
if len(ones) > 1:
    print("1-GPU medians: " + ", ".join(f"{x:.2f}" for x in ones) + f" ms (baseline: their mean {one:.2f})")
print(f"{'run':<11} {'GPUs':>4} {'median ms':>9} {'mean ms':>8} {'spread':>7} {'tok/s':>8} {'GiB':>6} "
      f"{'scaling':>7} {'exposed':>8}  settings")
for name, n, env, flags, r in rows:
    if r is None:
        print(f"{name:<11} {n:>4} failed (see {out}/{name}.log)")
        continue
    median, mean, tok, gib, spread = r
    scaling = f"{one / median:.3f}" if one and n == "2" else ""
    exposed = f"{median - one:+.2f}" if one and n == "2" else ""
    print(f"{name:<11} {n:>4} {median:9.2f} {mean:8.2f} {spread:7.2f} {tok:8d} {gib:6.2f} {scaling:>7} {exposed:>8}  "
          f"{' '.join(x for x in (env, flags) if x)}")
z1 = [r[4][0] for r in rows if r[0] in ("z1", "z1_again") and r[4]]
q0 = [r[4][0] for r in rows if r[0] == "z1_q0" and r[4]]
if one and z1 and q0:
    exposed, serial = statistics.mean(z1) - one, q0[0] - one
    print(f"ZeRO-1: exposed {exposed:+.2f} ms (median z1 - 1 GPU), serial cost {serial:+.2f} ms (z1 -Q 0 - 1 GPU)"
          + (f", hidden {1 - exposed / serial:.0%}" if serial > 0 else "") + "; the issue's target: exposed <= 3 ms, "
          "scaling >= 0.975")
EOF
}

echo "== build"
if ! make -j16 train_llama3cu USE_MPI=1 > "$OUT/build.log" 2>&1; then
    echo "FAIL build (see $OUT/build.log)"
    tail -n 20 "$OUT/build.log"
    exit 1
fi
random_tokens || { echo "FAIL: could not write .devdata/random_train.bin"; exit 1; }
echo "== runs ($STEPS steps each, budget $BUDGET s, $((SECONDS - START)) s gone)"
run one 1 ""
run z1 2 "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV NCCL_DEBUG_FILE=$OUT/nccl_z1.%h.%p.log" -Z 1
grep -hoE "NCCL version [^ ]+|[0-9]+ coll channels.*|via P2P/[A-Za-z/]+|NCCL_[A-Z_]+ set by environment to .*" \
    "$OUT"/nccl_z1.*.log 2>/dev/null | sort | uniq -c | head -n 10
echo "the trainer's $(grep -oE "NCCL [0-9.]+" "$OUT/z1.log" | head -n 1); torch's NCCL: $(timeout 60 python3 -c \
    'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>/dev/null || echo "n/a")"
run z1_q0 2 "" -Z 1 -Q 0
echo "== trace ($((SECONDS - START)) s gone)"
trace
echo "== the baseline again ($((SECONDS - START)) s gone)"
run one_again 1 ""
run z1_again 2 "" -Z 1
echo "== NCCL's levers ($((SECONDS - START)) s gone)"
run z1_ch8 2 "NCCL_MAX_NCHANNELS=8" -Z 1
run z1_ch4 2 "NCCL_MAX_NCHANNELS=4" -Z 1
if nccl_at_least 2.17; then run z1_cta16 2 "NCCL_MIN_CTAS=16 NCCL_MAX_CTAS=16" -Z 1
else echo "SKIP z1_cta16: NCCL older than 2.17"; fi
if nccl_at_least 2.27; then run z1_ctaeff 2 "NCCL_CTA_POLICY=1" -Z 1
else echo "SKIP z1_ctaeff: NCCL older than 2.27 (no CTA policy)"; fi
run z1_conn1 2 "CUDA_DEVICE_MAX_CONNECTIONS=1" -Z 1
summary
echo "total $((SECONDS - START)) s; logs in $OUT"
