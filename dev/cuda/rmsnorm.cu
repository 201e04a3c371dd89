// RMSNorm forward, fused residual + RMSNorm forward, and backward (dinp accumulated, deterministic dweight),
// validated against the CPU reference (dev/cpu/llama3_cpu.h) and timed.
//
//   rstd = 1 / sqrt(mean_c x^2 + eps),  out = x * rstd * w
//   dx = rstd * (dout*w - xhat * mean_c(dout*w*xhat)),  dw = sum_n dout * xhat,  xhat = x * rstd
//
// version 1 = llmc/rmsnorm.cuh. C = 48 and 2048 take the 16-byte path in both precisions, C = 100 only in fp32,
// C = 50 never; N = 37 leaves a partial block of rows, N = 9000 gives several row chunks in the dweight reduction.
//
// build: make -C dev/cuda bin/rmsnorm   run: dev/cuda/bin/rmsnorm
#include "common.h"
#include "../../llmc/rmsnorm.cuh"

static void test_case(int N, int C, uint64_t seed) {
    printf("N=%d C=%d\n", N, C);
    const float eps = 1e-5f;
    size_t NC = (size_t)N * C;
    std::vector<float> a = round_to_floatX(random_floats(NC, seed));
    std::vector<float> b = round_to_floatX(random_floats(NC, seed + 1, 0.5f));
    std::vector<float> w = round_to_floatX(random_floats(C, seed + 2, 0.3f));
    for (auto& x : w) x += 1.0f;
    w = round_to_floatX(w);
    std::vector<float> dout = round_to_floatX(random_floats(NC, seed + 3));
    std::vector<float> dinp0 = round_to_floatX(random_floats(NC, seed + 4));
    std::vector<float> dw0 = round_to_floatX(random_floats(C, seed + 5));

    floatX* d_a = device_from_host<floatX>(a);
    floatX* d_b = device_from_host<floatX>(b);
    floatX* d_w = device_from_host<floatX>(w);
    floatX* d_dout = device_from_host<floatX>(dout);
    floatX *d_out, *d_res;
    float* d_rstd;
    cudaCheck(cudaMalloc(&d_out, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_res, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_rstd, N * sizeof(float)));

    // forward
    std::vector<float> ref_out(NC), ref_rstd(N);
    cpu::rmsnorm_forward(ref_out.data(), ref_rstd.data(), a.data(), w.data(), N, C, eps);
    poison(d_out, NC * sizeof(floatX));
    poison(d_rstd, N * sizeof(float));
    rmsnorm_forward(d_out, d_rstd, d_a, d_w, N, C, eps, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("forward out", host_from_device(d_out, NC), ref_out);
    validate("forward rstd", host_from_device(d_rstd, N), ref_rstd);

    // fused residual: the residual is a + b rounded to floatX, and the norm is of that rounded residual
    std::vector<float> sum(NC);
    for (size_t i = 0; i < NC; i++) sum[i] = a[i] + b[i];
    std::vector<float> ref_res = round_to_floatX(sum);
    std::vector<float> ref_fout(NC), ref_frstd(N);
    cpu::rmsnorm_forward(ref_fout.data(), ref_frstd.data(), ref_res.data(), w.data(), N, C, eps);
    poison(d_out, NC * sizeof(floatX));
    poison(d_res, NC * sizeof(floatX));
    poison(d_rstd, N * sizeof(float));
    fused_residual_rmsnorm_forward(d_res, d_out, d_rstd, d_a, d_b, d_w, N, C, eps, 0);
    cudaCheck(cudaDeviceSynchronize());
    // the residual is one fp32 add then one rounding on both sides: exact
    validate("fused residual_out", host_from_device(d_res, NC), ref_res, 0.0);
    validate("fused out", host_from_device(d_out, NC), ref_fout);
    validate("fused rstd", host_from_device(d_rstd, N), ref_frstd);
    // in place: residual_out aliases a (the trainer's residual += branch)
    floatX* d_a2 = device_from_host<floatX>(a);
    poison(d_out, NC * sizeof(floatX));
    fused_residual_rmsnorm_forward(d_a2, d_out, d_rstd, d_a2, d_b, d_w, N, C, eps, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("fused in-place residual", host_from_device(d_a2, NC), ref_res, 0.0);
    validate("fused in-place out", host_from_device(d_out, NC), ref_fout);

    // backward, using the GPU's rstd from the plain forward (what the trainer saves)
    rmsnorm_forward(d_out, d_rstd, d_a, d_w, N, C, eps, 0);
    std::vector<float> rstd_gpu = host_from_device(d_rstd, N);
    std::vector<float> ref_dinp = dinp0, ref_dw = dw0;
    cpu::rmsnorm_backward(ref_dinp.data(), ref_dw.data(), dout.data(), a.data(), w.data(), rstd_gpu.data(), N, C);
    size_t scratch_floats = rmsnorm_backward_scratch_floats(N, C);
    float* d_scratch;
    cudaCheck(cudaMalloc(&d_scratch, scratch_floats * sizeof(float)));
    floatX* d_dinp[2];
    floatX* d_dw[2];
    for (int k = 0; k < 2; k++) {
        d_dinp[k] = device_from_host<floatX>(dinp0);
        d_dw[k] = device_from_host<floatX>(dw0);
        poison(d_scratch, scratch_floats * sizeof(float));  // scratch contents must not matter
        rmsnorm_backward(d_dinp[k], d_dw[k], d_scratch, d_dout, d_a, d_w, d_rstd, N, C, 0);
    }
    cudaCheck(cudaDeviceSynchronize());
    validate("backward dinp (accumulate)", host_from_device(d_dinp[0], NC), ref_dinp);
    validate("backward dweight (accumulate)", host_from_device(d_dw[0], C), ref_dw);
    validate_bitwise("dinp determinism", d_dinp[0], d_dinp[1], NC);
    validate_bitwise("dweight determinism", d_dw[0], d_dw[1], C);

    for (void* p : {(void*)d_a, (void*)d_b, (void*)d_w, (void*)d_dout, (void*)d_out, (void*)d_res, (void*)d_rstd,
                    (void*)d_a2, (void*)d_scratch, (void*)d_dinp[0], (void*)d_dinp[1], (void*)d_dw[0],
                    (void*)d_dw[1]})
        cudaCheck(cudaFree(p));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case(37, 48, 1);
    test_case(37, 50, 2);
    test_case(37, 100, 3);
    test_case(37, 2048, 4);
    test_case(9000, 48, 5);
    test_case(1, 2, 6);

    int N = 16384, C = 2048;
    printf("timing N=%d C=%d\n", N, C);
    size_t NC = (size_t)N * C;
    floatX* d_x = device_random<floatX>(NC, 10);
    floatX* d_y = device_random<floatX>(NC, 11);
    floatX* d_w = device_random<floatX>(C, 12);
    floatX* d_g = device_random<floatX>(NC, 13, 1e-3f);
    floatX *d_out, *d_res, *d_dinp, *d_dw;
    float *d_rstd, *d_scratch;
    cudaCheck(cudaMalloc(&d_out, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_res, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dinp, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dw, C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_rstd, N * sizeof(float)));
    cudaCheck(cudaMalloc(&d_scratch, rmsnorm_backward_scratch_floats(N, C) * sizeof(float)));
    cudaCheck(cudaMemset(d_dinp, 0, NC * sizeof(floatX)));
    cudaCheck(cudaMemset(d_dw, 0, C * sizeof(floatX)));
    double row_bytes = (double)NC * sizeof(floatX);
    float ms = benchmark_ms(20, [&] { rmsnorm_forward(d_out, d_rstd, d_x, d_w, N, C, 1e-5f, 0); });
    report_bandwidth("forward", ms, 2 * row_bytes + N * 4.0);
    ms = benchmark_ms(20, [&] { fused_residual_rmsnorm_forward(d_res, d_out, d_rstd, d_x, d_y, d_w, N, C, 1e-5f, 0); });
    report_bandwidth("fused residual forward", ms, 4 * row_bytes + N * 4.0);
    // minimum traffic: read dout, inp, dinp; write dinp (the dweight pass re-reads dout and inp, counted as 0)
    ms = benchmark_ms(20, [&] { rmsnorm_backward(d_dinp, d_dw, d_scratch, d_g, d_x, d_w, d_rstd, N, C, 0); });
    report_bandwidth("backward", ms, 4 * row_bytes + N * 4.0);

    for (void* p : {(void*)d_x, (void*)d_y, (void*)d_w, (void*)d_g, (void*)d_out, (void*)d_res, (void*)d_dinp,
                    (void*)d_dw, (void*)d_rstd, (void*)d_scratch})
        cudaCheck(cudaFree(p));
    return finish(argv[0]);
}
