#!/usr/bin/env bash
# The FP8 mode's tie-out against PyTorch (test_llama3cu -M fp8), everything it adds, on a GPU machine with FP8 tensor
# cores (an H100): builds ./test_llama3cu (BF16) and the CPU reference, runs the host-side and fixture tests, then
# dev/test/test_gpu.py -k fp8_tie_out (which builds its own test_llama3cu in both precisions and writes the FP8 debug
# state of llama3.2-1B-d2 with PyTorch on the GPU), and prints how close each FP8 tie-out came to its bounds. About a
# minute and a half on an H100 after the builds.
#
#   dev/test/fp8_tieout_check.sh        (PYTHON=... for a Python with PyTorch other than dev/python_env.sh's)
#
# Pass: both pytest runs end "N passed" with nothing failed or skipped, and the summary shows
#   - every "-M fp8" tie-out ("layers' matmuls fp8") ending "all checks passed", its closest check below 1 of its
#     bound and its largest error / PyTorch's below the multiple (4);
#   - test_fp8_tie_out_fails_against_bf16_errors with FAIL lines (among them dwqkv, dwo, dw13 or dw2) and
#     "FAILED: N check(s)": the FP8 mode against bf16 autocast's errors must fail, and does.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$(dev/python_env.sh)}
log=$(mktemp -d)/test_gpu_fp8.log

make test_llama3cu dev/cpu/test_llama3_cpu
"$PYTHON" -m pytest -q -rs dev/test/test_reliability.py::test_tie_out_fp8_checks \
    dev/test/test_fp8_scripts.py::test_fp8_fixture dev/test/test_fp8_scripts.py::test_fp8_debug_state \
    "dev/test/test_cpu_reference.py::test_fixture_ties_out[fp8]"

status=0
"$PYTHON" -m pytest -q -rPs dev/test/test_gpu.py -k fp8_tie_out >"$log" 2>&1 || status=$?
echo "--- dev/test/test_gpu.py -k fp8_tie_out (full output: $log)"
grep -E "^_{3,} test_|^\[bf16|^closest|^largest|FAIL$|^FAILED: [0-9]|^all checks passed|^SKIPPED" "$log" || true
tail -n 1 "$log"
exit "$status"
