"""
The multi-GPU code's CPU side:
  - resharding (llmc/shard_layout.h, llmc/reshard.h) through dev/test/test_reshard (built by `make`): the ranges of
    every pair of layouts, real state files read back in every layout, and the refusals; the layer slots of ZeRO-2's
    gradients and ZeRO-3's gathered weights, and ZeRO-3's shards gathered into them on the host;
  - scripts/bench_multi_gpu.py: its arguments, the runs and commands it plans (GPU counts, ZeRO stages, the socket
    transport, the 8B line) and its summary, from made-up results;
  - dev/test/overlap_trace.py (dev/test/overlap_check.sh's trace part): the per-step compute, NCCL, NCCL-alone and
    idle times, from a made-up nsys sqlite file.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_multi_gpu  # noqa: E402

HELPER = os.path.join(ROOT, "dev", "test", "test_reshard")


def reshard(*args):
    if not os.path.exists(HELPER):
        pytest.fail(f"{HELPER} is missing: run `make` first")
    return subprocess.run([HELPER, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("check", ["ranges", "files", "slots"])
def test_reshard(check, tmp_path):
    result = reshard(check, tmp_path) if check == "files" else reshard(check)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------------------------
# scripts/bench_multi_gpu.py


def names(argv):
    return [name for name, _, _, _ in bench_multi_gpu.plan(bench_multi_gpu.parse_args(argv))]


def test_bench_default_is_one_and_two_gpus():
    assert names(["--train", "s.bin"]) == ["ours 1 GPU", "ours 2 GPUs Z1", "ours 2 GPUs Z0", "ours 2 GPUs Z2",
                                           "ours 2 GPUs Z1 -Q 0", "torch 1 GPU", "torch DDP 2 GPUs",
                                           "torch FSDP2 2 GPUs"]


def test_bench_a_hosts_table():
    """One command for a host's table: ours on each count with each stage, PyTorch on the largest, the 8B line."""
    args = bench_multi_gpu.parse_args(["--gpus", "8,2,4", "--ours", "1,Z1,Z2,Z3", "--with_8b", "--train", "s.bin"])
    runs = {name: (cmd, tokens, required) for name, cmd, tokens, required in bench_multi_gpu.plan(args)}
    for n in (2, 4, 8):
        for stage in ("1", "2", "3"):
            cmd, tokens, _ = runs[f"ours {n} GPUs Z{stage}"]
            assert cmd[:3] == ["mpirun", "-np", str(n)] and cmd[-2:] == ["-Z", stage] and tokens == 8 * 2048 * n
    assert runs["ours 1 GPU"][0][0] == args.binary and runs["ours 1 GPU"][1] == 8 * 2048
    assert "--nproc_per_node=8" in runs["torch DDP 8 GPUs"][0] and "--nproc_per_node=8" in runs["torch FSDP2 8 GPUs"][0]
    assert "--nproc_per_node=1" in runs["torch 1 GPU"][0]
    bf16, tokens, required = runs["8B ours 8 GPUs bf16"]
    assert "llama3.1-8B" in bf16 and bf16[-4:] == ["-Z", "1", "-R", "2"] and tokens == 8192 * 8 and required
    assert runs["8B ours 8 GPUs fp8"][0][-2:] == ["-M", "fp8"]
    fsdp, _, required = runs["8B torch FSDP2 8 GPUs"]
    assert "--activation_checkpointing" in fsdp and "8192" in fsdp and not required


def test_bench_zero3():
    """ZeRO-3 on 2 GPUs: the 1B at Z1 and Z3 against 1 GPU, the 8B line at -Z 3 (fp32 master weights and AdamW)."""
    args = bench_multi_gpu.parse_args(["--gpus", "2", "--torch", "none", "--ours", "1,Z1,Z3", "--with_8b",
                                       "--stage_8b", "3", "--train", "s.bin"])
    runs = {name: cmd for name, cmd, _, _ in bench_multi_gpu.plan(args)}
    assert list(runs) == ["ours 1 GPU", "ours 2 GPUs Z1", "ours 2 GPUs Z3", "8B ours 2 GPUs bf16", "8B ours 2 GPUs fp8",
                          "8B torch FSDP2 2 GPUs"]
    assert runs["ours 2 GPUs Z3"][-2:] == ["-Z", "3"]
    big = runs["8B ours 2 GPUs bf16"]
    assert big[-4:] == ["-Z", "3", "-R", "2"] and "-W" not in big and "-O" not in big


def test_bench_socket_transport():
    args = bench_multi_gpu.parse_args(["--transport", "socket", "--torch", "none", "--ours", "1,Z1", "--train", "s"])
    runs = {name: cmd for name, cmd, _, _ in bench_multi_gpu.plan(args)}
    assert list(runs) == ["ours 1 GPU", "ours 2 GPUs Z1"]
    cmd = runs["ours 2 GPUs Z1"]
    for var in ("NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"):
        assert cmd[cmd.index(var) - 1] == "-x"
    env = bench_multi_gpu.env("socket")
    assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert bench_multi_gpu.env("default") == bench_multi_gpu.ENV


def bench_output(argv, ms, monkeypatch, capsys):
    """What bench_multi_gpu.main(argv) prints when each run named in `ms` takes that many ms a step (tok/s = tokens
    per step / step) and every other run fails."""
    by_log = {bench_multi_gpu.log_name(name): name for name, _, _, _ in
              bench_multi_gpu.plan(bench_multi_gpu.parse_args(argv))}

    def fake_run(cmd, log_path, tokens, run_env):
        name = by_log[os.path.basename(log_path)]
        return (ms[name], tokens / (ms[name] / 1000), ms[name], 10.0) if name in ms else None

    monkeypatch.setattr(bench_multi_gpu, "run", fake_run)
    bench_multi_gpu.main(argv)
    return capsys.readouterr().out


def test_bench_each_gpu(monkeypatch, capsys, tmp_path):
    """--each_gpu: our 1-GPU run on GPUs 1 to N-1 too, and the scaling against the slowest of the first n."""
    argv = ["--gpus", "2,4", "--ours", "1,Z1", "--torch", "none", "--each_gpu", "--train", "s", "--out", str(tmp_path)]
    runs = {name: cmd for name, cmd, _, _ in bench_multi_gpu.plan(bench_multi_gpu.parse_args(argv))}
    assert list(runs) == ["ours 1 GPU", "ours 1 GPU (GPU 1)", "ours 1 GPU (GPU 2)", "ours 1 GPU (GPU 3)",
                          "ours 2 GPUs Z1", "ours 4 GPUs Z1"]
    assert runs["ours 1 GPU (GPU 2)"][:2] == ["env", "CUDA_VISIBLE_DEVICES=2"]
    assert runs["ours 1 GPU (GPU 2)"][2:] == runs["ours 1 GPU"]
    ms = {"ours 1 GPU": 100.0, "ours 1 GPU (GPU 1)": 98.0, "ours 1 GPU (GPU 2)": 102.0, "ours 1 GPU (GPU 3)": 99.0,
          "ours 2 GPUs Z1": 105.0, "ours 4 GPUs Z1": 108.0}
    out = bench_output(argv, ms, monkeypatch, capsys)
    assert "our scaling 1 -> 2 GPUs: Z1 0.952" in out, out
    assert "our scaling 1 -> 2 GPUs against the slowest of GPUs 0-1 alone (GPU 0, 100.0 ms): Z1 0.952" in out
    assert "our scaling 1 -> 4 GPUs against the slowest of GPUs 0-3 alone (GPU 2, 102.0 ms): Z1 0.944" in out
    assert re.search(r"^ours 1 GPU \(GPU 3\) +99\.0 ", out, re.M)


def test_bench_each_gpu_exposed_time(monkeypatch, capsys, tmp_path):
    """--each_gpu with -Q 0: the exposed reduction time also against the slowest GPU alone, not only GPU 0."""
    argv = ["--gpus", "2", "--ours", "1,Z1,Q0", "--torch", "none", "--each_gpu", "--train", "s", "--out",
            str(tmp_path)]
    ms = {"ours 1 GPU": 100.0, "ours 1 GPU (GPU 1)": 102.0, "ours 2 GPUs Z1": 105.0, "ours 2 GPUs Z1 -Q 0": 110.0}
    out = bench_output(argv, ms, monkeypatch, capsys)
    assert "gradient reduction on 2 GPUs: 10.0 ms per step not overlapped, 5.0 ms exposed when overlapped: 50% hidden" \
        in out, out
    assert "against the slowest GPU alone (GPU 1, 102.0 ms): 8.0 ms not overlapped, 3.0 ms exposed" in out


def test_bench_copy_engines_line(monkeypatch, capsys, tmp_path):
    """E0 runs Z1 with -E 0 on the largest count and prints both step times."""
    argv = ["--gpus", "2", "--ours", "1,Z1,E0", "--torch", "none", "--train", "s", "--out", str(tmp_path)]
    ms = {"ours 1 GPU": 100.0, "ours 2 GPUs Z1": 103.0, "ours 2 GPUs Z1 -E 0": 104.5}
    out = bench_output(argv, ms, monkeypatch, capsys)
    assert "copy engines on 2 GPUs (Z1): 103.0 ms per step, 104.5 ms with NCCL's kernels for every collective" in out
    cmds = [cmd for _, cmd, _, _ in bench_multi_gpu.plan(bench_multi_gpu.parse_args(argv))]
    assert sum(" -E 0" in " ".join(cmd) for cmd in cmds) == 1, cmds


@pytest.mark.parametrize("argv,words", [
    (["--gpus", "1,2"], ["--gpus 1,2", "2 or more"]),
    (["--gpus", "two"], ["--gpus two", "comma-separated"]),
    (["--ours", "1,Z1,X"], ["'X'"]),
    (["--torch", "ddp,jax"], ["'jax'"]),
    (["--transport", "ib"], ["--transport", "'ib'"]),
    (["--ours", "Z1", "--each_gpu"], ["--each_gpu", "--ours must hold 1"]),
])
def test_bench_rejects(argv, words, capsys):
    with pytest.raises(SystemExit):
        bench_multi_gpu.parse_args([*argv, "--train", "s.bin"])
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err
    with pytest.raises(SystemExit):
        bench_multi_gpu.parse_args([])
    assert "--train" in capsys.readouterr().err


def test_bench_summary(monkeypatch, capsys, tmp_path):
    """The table and the ratios, from made-up step times (tok/s = tokens per step / mean step); the 8B PyTorch run
    fails, which the table reports."""
    ms = {"ours 1 GPU": 100.0, "ours 2 GPUs Z1": 105.0, "ours 2 GPUs Z2": 110.0, "ours 4 GPUs Z1": 108.0,
          "ours 4 GPUs Z2": 112.0, "ours 4 GPUs Z1 -Q 0": 120.0, "torch 1 GPU": 150.0, "torch DDP 4 GPUs": 170.0,
          "torch FSDP2 4 GPUs": 160.0, "8B ours 4 GPUs bf16": 2000.0, "8B ours 4 GPUs fp8": 1500.0}
    argv = ["--gpus", "2,4", "--ours", "1,Z1,Z2,Q0", "--with_8b", "--train", "s", "--out", str(tmp_path)]
    out = bench_output(argv, ms, monkeypatch, capsys)
    assert "our scaling 1 -> 2 GPUs: Z1 0.952, Z2 0.909" in out, out
    assert "our scaling 1 -> 4 GPUs: Z1 0.926, Z2 0.893" in out
    assert "ours / PyTorch on 1 GPU: 1.500" in out
    assert "ours Z1 / PyTorch DDP on 4 GPUs: 1.574" in out and "PyTorch DDP scaling 1 -> 4 GPUs: 0.882" in out
    assert "gradient reduction on 4 GPUs: 20.0 ms per step not overlapped, 8.0 ms exposed when overlapped: 60% hidden" \
        in out
    assert re.search(r"^8B torch FSDP2 4 GPUs +failed", out, re.M)
    assert "llama3.1-8B T=8192 on 4 GPUs, tok/s per GPU: ours bf16 4096, fp8 5461" in out


# ---------------------------------------------------------------------------------------------------------------
# dev/test/overlap_trace.py (the trace part of dev/test/overlap_check.sh), on made-up nsys and kernel_trace.so files


def fake_trace(path, kernels):
    """An nsys-like sqlite file holding `kernels`, [(start_ms, end_ms, name)]."""
    import sqlite3
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, streamId INTEGER, "
               "shortName INTEGER, demangledName INTEGER)")
    ids = {}
    for s, e, name in kernels:
        if name not in ids:
            ids[name] = len(ids) + 1
            db.execute("INSERT INTO StringIds VALUES (?, ?)", (ids[name], name))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 7, ?, ?)",
                   (int(s * 1e6), int(e * 1e6), ids[name], ids[name]))
    db.commit()
    db.close()


def test_overlap_trace(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "dev", "test"))
    import overlap_trace
    kernels = []
    for k in range(3):  # three steps of 100 ms, each ending with an update of two AdamW launches
        t = 100.0 * k
        kernels += [(t + 0, t + 80, "sm90_xmma_gemm_bf16"),                          # forward and backward
                    (t + 70, t + 84, "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"),  # 10 ms beside compute, 4 alone
                    (t + 86, t + 87, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),       # grad norm: 1 ms alone
                    (t + 88, t + 91, "adamw_kernel"), (t + 91, t + 94, "adamw_kernel"),
                    (t + 90, t + 103, "ncclDevKernel_AllGather_RING_LL")]              # 4 beside AdamW, 9 after
    fake_trace(tmp_path / "t.sqlite", kernels)
    steps = overlap_trace.analyse(overlap_trace.read_kernels(str(tmp_path / "t.sqlite")), skip=0)
    assert len(steps) == 2  # update 0 -> 1 and 1 -> 2
    st = steps[1]  # from 194 to 294 ms: the last 9 ms of step 1's gather, 3 of them beside step 2's gemm
    assert st["step"] == pytest.approx(100.0)
    assert st["compute"] == pytest.approx(80 + 6)  # the gemm, the AdamW launches
    assert st["nccl"] == pytest.approx(9 + 14 + 1 + 4)  # [194, 203], [270, 284], [286, 287], [290, 294]
    assert st["alone"] == pytest.approx({"AllGather": 6, "ReduceScatter": 4, "AllReduce": 1})
    assert st["nccl_alone"] == pytest.approx(11)
    assert st["idle"] == pytest.approx(3)  # 284-286, 287-288
    out = tmp_path / "report.txt"
    with open(out, "w") as f:
        overlap_trace.report(steps, f)
    assert "nccl alone, AllGather: 6.00 ms per step" in out.read_text()
    # the same kernels as dev/kernel_trace.so writes them (with a memcpy line, which is not a kernel), out of order
    with open(tmp_path / "t.txt", "w") as f:
        f.write("C 184500000 185500000 7 4 2\n")  # in step 0's idle gap: counted as a kernel, it would show
        for s, e, name in reversed(kernels):
            f.write(f"K {int(s * 1e6)} {int(e * 1e6)} 7 132 {name}\n")
    assert overlap_trace.analyse(overlap_trace.read_kernels(str(tmp_path / "t.txt")), skip=0) == steps
