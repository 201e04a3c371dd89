# What the GPU check scripts (reshard, zero3, overlap_check.sh) share; sourced from the repo root with OUT set.
# The environment these machines need, `stage` (a command's PASS or FAIL, its output in $OUT) and random tokens.
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$OUT"
status=0

stage() {  # stage NAME COMMAND...: runs it with its output in $OUT/NAME.log; a failure sets status=1
    local name=$1
    shift
    if "$@" > "$OUT/$name.log" 2>&1; then
        echo "PASS $name"
    else
        echo "FAIL $name (see $OUT/$name.log)"
        status=1
    fi
}

random_tokens() {  # .devdata/random_train.bin: 8M uniform token ids of Llama 3's vocabulary, made once
    mkdir -p .devdata
    [ -f .devdata/random_train.bin ] || python3 -c "import numpy as np; n = 8000000; h = np.zeros(256, np.int32)
h[:3] = [20240801, 7, n]
tokens = np.random.default_rng(0).integers(0, 128256, n, dtype=np.uint32)
open('.devdata/random_train.bin', 'wb').write(h.tobytes() + tokens.tobytes())"
}
