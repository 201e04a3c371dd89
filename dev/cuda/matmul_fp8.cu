// FP8 matmuls (llmc/matmul_fp8.cuh, cuBLASLt) on the trainer's three products per linear layer, checked against
// the CPU product of the same quantized values, then timed against the bf16 matmuls of llmc/matmul.cuh.
//
//   forward  out  = inp W^T      inp (T, C) e4m3,   W (OC, C) e4m3            (T tokens)
//   dinp     dinp = dout W       dout (T, OC) e5m2, W^T (C, OC) e4m3
//   dweight  dW  += dout^T inp   dout^T (OC, T) e5m2, inp^T (C, T) e4m3       (accumulating into dW)
// The FP8 operands are made as the trainer will make them: llmc/fp8.cuh's amax, then fp8_cast_transpose writing
// each tensor's FP8 copy and its transpose. The CPU reference decodes the row-major copies (the GPU's bytes) and
// multiplies them in their natural layouts, so it also checks that each product uses the right copies.
//
// Bound, per element. a_k, b_k: the decoded FP8 values; alpha = inv_scale_a * inv_scale_b; S = sum_k a_k b_k and
// A = sum_k |a_k b_k| (in double on the CPU: exact enough); c: the old dW when accumulating, else 0; ref = alpha S + c.
//   fp32 arithmetic, u = 2^-24: each a_k b_k is exact in fp32 (4 x 4 significant bits); an fp32 sum in any order is
//     within (K - 1) u A of S; alpha is rounded once, alpha * sum once, the add of c once:
//     E32 = (K + 2) u (alpha A + |c|).
//   The tensor core. Hopper's FP8 MMA adds products in a window about 13 bits below the largest magnitude in play
//     (the probe below, fp32 build: next to a product of 1, products of 2^-12 count and 2^-14 are dropped; DeepSeek-V3
//     reports about 14 bits), so a partial sum is off by about 2^-13 of what it holds until cuBLASLt promotes it into
//     fp32 (FAST_ACCUM = 0). So E32 alone does not hold: a first run failed it on every small shape. On operands of
//     random sign, as here and in training, the largest error the probe measured was 2^-12.0 A (at K = 128; 2^-15
//     at K = 1024, 2^-16.4 at 4096); the bound allows E_tc = 2^-11 alpha A. It is no worst case: on operands of one
//     sign the truncations add up (2^-9.6 A at K = 128; with fast accumulation 2^-3.7 A at K = 4096).
//   Rounding to floatX, u_out = 2^-8 (bf16; 2^-24 in the fp32 build): u_out |ref|. When accumulating, cuBLASLt rounds
//     alpha * sum to floatX before adding c (seen on an H100: with c = -bf16(alpha S) the output was exactly 0), a
//     second rounding: u_out |alpha S|. (Without that term the bf16 build's dW check fails where c cancels alpha S.)
//   |gpu - ref| <= u_out (|ref| + [accumulating] |alpha S|) (1 + u_out) + (1 + u_out)^2 (E32 + E_tc)
// Rows checked on the CPU: all of them on small shapes; 8 spread over M (first and last included) on the Llama 3.2
// 1B's layers at T = 16384 tokens: qkv (C 2048 -> 3072), wo (2048 -> 2048), w13 (2048 -> 16384: w1 and w3 stacked),
// w2 (8192 -> 2048). The forward's optional amax of the output is checked bit for bit on the small shapes, and a
// second run of each shape bit for bit against the first (one algorithm per shape).
//
// Timing (bf16 build): each product in FP8 (default, and with fast accumulation) and in bf16 (llmc/matmul.cuh), the
// median of 50 back-to-back runs, in two passes (the second in reverse order: at the power cap, order matters).
// H100 80GB HBM3 (700 W), T = 16384, TFLOP/s bf16 -> FP8 in the two passes (casts not included):
//   qkv  forward 801 / 699 -> 1262 / 1058   dinp 752 / 675 -> 1253 / 1136   dweight 762 / 676 -> 1382 / 1276
//   wo   forward 723 / 642 ->  768 / 1040   dinp 714 / 657 -> 1140 / 1045   dweight 767 / 710 -> 1349 / 1285
//   w13  forward 738 / 708 -> 1165 / 1211   dinp 694 / 666 -> 1296 / 1258   dweight 689 / 640 -> 1279 / 1223
//   w2   forward 636 / 642 -> 1172 / 1236   dinp 715 / 705 -> 1103 / 1163   dweight 707 / 664 -> 1299 / 1284
// FP8 is 1.5-1.9x as fast (the wo forward's 768 in the first pass an outlier: 1.06x there, 1.62x in the second); the
// twelve products of a layer take 4.92 ms against 8.44 ms in bf16 (first pass). Fast accumulation: 4.92 ms too,
// product by product from 7% faster to 10% slower (beside the wo outlier).
//
// build: make -C dev/cuda bin/matmul_fp8   run: dev/cuda/bin/matmul_fp8   (needs sm_89+; prints FAIL, exits 1)
#include <array>

#include "common.h"
#include "fp8_reference.h"
#include "../../llmc/fp8.cuh"
#include "../../llmc/matmul_fp8.cuh"

#if defined(ENABLE_FP32)
constexpr double U_OUT = 0x1p-24;
#else
constexpr double U_OUT = 0x1p-8;
#endif

// A floatX tensor (rows, cols) on the device with its FP8 copy, transposed copy and inverse scale.
struct Fp8Tensor {
    int rows, cols;
    __nv_fp8_interpretation_t format;
    floatX* x;  // owned
    DeviceBuffer<__nv_fp8_storage_t> q, q_t;
    DeviceBuffer<float> amax, inv_scale;
    Fp8Tensor(int rows_, int cols_, __nv_fp8_interpretation_t format_, uint32_t seed, float range)
        : rows(rows_), cols(cols_), format(format_), x(device_random<floatX>((size_t)rows_ * cols_, seed, range)),
          q((size_t)rows_ * cols_), q_t((size_t)rows_ * cols_), amax(1), inv_scale(1) {
        fp8_amax(amax.ptr, x, (size_t)rows * cols, 0);
        fp8_cast_transpose(q_t.ptr, q.ptr, inv_scale.ptr, x, amax.ptr, rows, cols, format, 0);
        cudaCheck(cudaDeviceSynchronize());
    }
    Fp8Tensor(const Fp8Tensor&) = delete;
    ~Fp8Tensor() { cudaCheck(cudaFree(x)); }
    // The row-major copy decoded on the host (exact in fp32).
    std::vector<float> decoded() const {
        std::vector<uint8_t> bytes((size_t)rows * cols);
        cudaCheck(cudaMemcpy(bytes.data(), q.ptr, bytes.size(), cudaMemcpyDeviceToHost));
        float table[256];
        for (int b = 0; b < 256; b++) table[b] = cpu_fp8_decode((uint8_t)b, format);
        std::vector<float> out(bytes.size());
        for (size_t i = 0; i < bytes.size(); i++) out[i] = table[bytes[i]];
        return out;
    }
    float inv_scale_host() const {
        float h;
        cudaCheck(cudaMemcpy(&h, inv_scale.ptr, sizeof(float), cudaMemcpyDeviceToHost));
        return h;
    }
};

static std::vector<float> transposed(const std::vector<float>& x, int rows, int cols) {
    std::vector<float> t(x.size());
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) t[(size_t)c * rows + r] = x[(size_t)r * cols + c];
    return t;
}

// Rows spread over [0, M), first and last included; all of them when count >= M.
static std::vector<int> spread_rows(int M, int count) {
    std::vector<int> rows;
    if (count >= M) {
        for (int i = 0; i < M; i++) rows.push_back(i);
    } else {
        for (int i = 0; i < count; i++) rows.push_back((int)((long long)i * (M - 1) / (count - 1)));
    }
    return rows;
}

// The checked rows of a product D (M, N) = alpha A B^T (+ C): a_rows holds the checked rows of A (rows.size() x K),
// b all of B (N x K), c_rows the same rows of C (accumulating) or nothing. The GPU's rows against the bound above.
static void check_product(const char* name, const floatX* d_out, const std::vector<int>& rows,
                          const std::vector<float>& a_rows, const std::vector<float>& b,
                          const std::vector<float>& c_rows, double alpha, int N, int K) {
    const int R = (int)rows.size();
    std::vector<float> gpu((size_t)R * N);
    for (int r = 0; r < R; r++) {
        std::vector<float> row = host_from_device(d_out + (size_t)rows[r] * N, N);
        std::copy(row.begin(), row.end(), gpu.begin() + (size_t)r * N);
    }
    double worst = 0.0, diff2 = 0.0, ref2 = 0.0;
    size_t violations = 0;
#pragma omp parallel for collapse(2) reduction(max : worst) reduction(+ : violations, diff2, ref2)
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < N; j++) {
            const float* a = &a_rows[(size_t)r * K];
            const float* bj = &b[(size_t)j * K];
            double sum = 0.0, abs_sum = 0.0;
            for (int k = 0; k < K; k++) {
                double p = (double)a[k] * bj[k];
                sum += p;
                abs_sum += std::fabs(p);
            }
            const bool accumulating = !c_rows.empty();
            double c = accumulating ? c_rows[(size_t)r * N + j] : 0.0;
            double ref = alpha * sum + c;
            double e32 = (K + 2) * 0x1p-24 * (alpha * abs_sum + std::fabs(c)), e_tc = 0x1p-11 * alpha * abs_sum;
            double rounding = U_OUT * (std::fabs(ref) + (accumulating ? std::fabs(alpha * sum) : 0.0));
            double bound = rounding * (1.0 + U_OUT) + (1.0 + U_OUT) * (1.0 + U_OUT) * (e32 + e_tc);
            double g = gpu[(size_t)r * N + j];
            double err = std::fabs(g - ref);
            if (!(err <= bound)) violations++;  // NaN counts
            worst = std::max(worst, bound > 0.0 ? err / bound : (err > 0.0 ? INFINITY : 0.0));
            diff2 += (g - ref) * (g - ref);
            ref2 += ref * ref;
        }
    }
    bool ok = violations == 0;
    printf("  %-34s %d rows  max err/bound %.3f  rel_err %.2e  violations %zu  %s\n", name, R, worst,
           std::sqrt(diff2 / std::max(ref2, 1e-300)), violations, ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
}

// One linear layer (T tokens, C -> OC): its three FP8 products against the CPU on `sample` rows of each.
static void check_layer(const char* label, int T, int C, int OC, __nv_fp8_interpretation_t grad_format, int sample,
                        uint32_t seed) {
    printf("%s: T=%d C=%d OC=%d, gradients %s\n", label, T, C, OC, grad_format == __NV_E4M3 ? "e4m3" : "e5m2");
    Fp8Tensor inp(T, C, __NV_E4M3, seed, 2.0f), w(OC, C, __NV_E4M3, seed + 1, 0.03f);
    Fp8Tensor dout(T, OC, grad_format, seed + 2, 1e-3f);
    floatX* d_dw0 = device_random<floatX>((size_t)OC * C, seed + 3, 1e-2f);  // the accumulated dW before this step
    DeviceBuffer<floatX> out((size_t)T * OC), dinp((size_t)T * C), dw((size_t)OC * C);
    DeviceBuffer<float> amax_out(1);

    poison(out.ptr, out.bytes());
    poison(dinp.ptr, dinp.bytes());
    poison(amax_out.ptr, sizeof(float));
    cudaCheck(cudaMemcpy(dw.ptr, d_dw0, dw.bytes(), cudaMemcpyDeviceToDevice));
    matmul_fp8(out.ptr, inp.q.ptr, __NV_E4M3, w.q.ptr, __NV_E4M3, T, OC, C, inp.inv_scale.ptr, w.inv_scale.ptr, false,
               amax_out.ptr, 0);
    matmul_fp8(dinp.ptr, dout.q.ptr, grad_format, w.q_t.ptr, __NV_E4M3, T, C, OC, dout.inv_scale.ptr,
               w.inv_scale.ptr, false, nullptr, 0);
    matmul_fp8(dw.ptr, dout.q_t.ptr, grad_format, inp.q_t.ptr, __NV_E4M3, OC, C, T, dout.inv_scale.ptr,
               inp.inv_scale.ptr, true, nullptr, 0);
    cudaCheck(cudaDeviceSynchronize());

    const std::vector<float> inp_h = inp.decoded(), w_h = w.decoded(), dout_h = dout.decoded();
    const std::vector<float> dw0_h = host_from_device(d_dw0, (size_t)OC * C);
    const double s_inp = inp.inv_scale_host(), s_w = w.inv_scale_host(), s_dout = dout.inv_scale_host();
    auto rows_of = [](const std::vector<float>& x, int width, const std::vector<int>& rows) {
        std::vector<float> part;
        for (int r : rows) part.insert(part.end(), x.begin() + (size_t)r * width, x.begin() + (size_t)(r + 1) * width);
        return part;
    };
    auto columns_of = [](const std::vector<float>& x, int height, int width, const std::vector<int>& cols) {
        std::vector<float> part;
        for (int c : cols)
            for (int r = 0; r < height; r++) part.push_back(x[(size_t)r * width + c]);
        return part;
    };
    const std::vector<int> token_rows = spread_rows(T, sample), out_rows = spread_rows(OC, sample);
    check_product("forward out = inp W^T", out.ptr, token_rows, rows_of(inp_h, C, token_rows), w_h, {},
                  s_inp * s_w, OC, C);
    check_product("dinp = dout W", dinp.ptr, token_rows, rows_of(dout_h, OC, token_rows), transposed(w_h, OC, C), {},
                  s_dout * s_w, C, OC);
    check_product("dW += dout^T inp", dw.ptr, out_rows, columns_of(dout_h, T, OC, out_rows), transposed(inp_h, T, C),
                  rows_of(dw0_h, C, out_rows), s_dout * s_inp, C, T);

    if (sample >= T) {  // the whole output was produced on small shapes: check its amax bit for bit
        float gpu_amax;
        cudaCheck(cudaMemcpy(&gpu_amax, amax_out.ptr, sizeof(float), cudaMemcpyDeviceToHost));
        float ref_amax = cpu_amax(host_from_device(out.ptr, (size_t)T * OC));
        bool ok = float_bits(gpu_amax) == float_bits(ref_amax);
        printf("  %-34s gpu %a  cpu %a  %s\n", "forward amax_out", gpu_amax, ref_amax, ok ? "OK" : "FAIL");
        if (!ok) g_failures++;
    }
    // a fixed algorithm per shape: bit-identical on a second run
    DeviceBuffer<floatX> again((size_t)T * OC);
    matmul_fp8(again.ptr, inp.q.ptr, __NV_E4M3, w.q.ptr, __NV_E4M3, T, OC, C, inp.inv_scale.ptr, w.inv_scale.ptr,
               false, nullptr, 0);
    validate_bitwise("forward determinism", out.ptr, again.ptr, (size_t)T * OC);
    cudaCheck(cudaFree(d_dw0));
}

#if defined(ENABLE_FP32)
// ------------------------------------------------------------------------------------------------ accumulation probe
// What the bound's tensor-core term rests on (fp32 build: its fp32 outputs show the accumulator, not bf16 rounding).
// Unit scales; M = N = 64.

static std::vector<float> product_of_bytes(const std::vector<uint8_t>& qa, __nv_fp8_interpretation_t fa,
                                           const std::vector<uint8_t>& qb, __nv_fp8_interpretation_t fb, int M, int N,
                                           int K, bool fast) {
    DeviceBuffer<__nv_fp8_storage_t> da(qa.size()), db(qb.size());
    DeviceBuffer<float> d((size_t)M * N), one(1);
    const float h_one = 1.0f;
    cudaCheck(cudaMemcpy(da.ptr, qa.data(), qa.size(), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(db.ptr, qb.data(), qb.size(), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(one.ptr, &h_one, sizeof(float), cudaMemcpyHostToDevice));
    matmul_fp8(d.ptr, da.ptr, fa, db.ptr, fb, M, N, K, one.ptr, one.ptr, false, nullptr, 0, fast);
    return host_from_device(d.ptr, (size_t)M * N);
}

static void probe_accumulation() {
    const int M = 64, N = 64;
    printf("tensor-core accumulation probe (unit scales, fp32 output)\n");
    // (a) each dot product: one product 1 * 1 and K - 1 products of 2^-j (e5m2 2^-ja times e4m3 2^-jb)
    const int K = 128;
    for (int j = 10; j <= 16; j += 2) {
        const int jb = std::min(j / 2, 8), ja = j - jb;
        std::vector<uint8_t> qa((size_t)M * K), qb((size_t)N * K);
        for (size_t i = 0; i < qa.size(); i++)
            qa[i] = cpu_fp8_encode(i % K == 0 ? 1.0f : std::ldexp(1.0f, -ja), __NV_E5M2);
        for (size_t i = 0; i < qb.size(); i++)
            qb[i] = cpu_fp8_encode(i % K == 0 ? 1.0f : std::ldexp(1.0f, -jb), __NV_E4M3);
        float d = product_of_bytes(qa, __NV_E5M2, qb, __NV_E4M3, M, N, K, false)[0];
        printf("  1 + %d products of 2^-%d: gpu - 1 = %a, exact %a  (%s)\n", K - 1, j, d - 1.0f,
               std::ldexp((double)(K - 1), -j), d == 1.0f ? "dropped" : "counted");
    }
    // (b) max |gpu - S| / A on e4m3 operands (normal * 100) of random sign and of one sign, without and with fast
    // accumulation
    std::mt19937_64 rng(5);
    std::normal_distribution<float> normal(0.0f, 100.0f);
    for (int k : {32, 128, 1024, 4096}) {
        printf("  K = %4d  max err / A:", k);
        for (bool one_sign : {false, true}) {
            std::vector<uint8_t> qa((size_t)M * k), qb((size_t)N * k);
            std::vector<float> a(qa.size()), b(qb.size());
            for (size_t i = 0; i < qa.size(); i++) {
                qa[i] = cpu_fp8_encode(one_sign ? std::fabs(normal(rng)) : normal(rng), __NV_E4M3);
                a[i] = cpu_fp8_decode(qa[i], __NV_E4M3);
            }
            for (size_t i = 0; i < qb.size(); i++) {
                qb[i] = cpu_fp8_encode(one_sign ? std::fabs(normal(rng)) : normal(rng), __NV_E4M3);
                b[i] = cpu_fp8_decode(qb[i], __NV_E4M3);
            }
            std::vector<double> sum((size_t)M * N), abs_sum((size_t)M * N);
            for (int i = 0; i < M; i++) {
                for (int j = 0; j < N; j++) {
                    for (int x = 0; x < k; x++) {
                        double p = (double)a[(size_t)i * k + x] * b[(size_t)j * k + x];
                        sum[(size_t)i * N + j] += p;
                        abs_sum[(size_t)i * N + j] += std::fabs(p);
                    }
                }
            }
            for (bool fast : {false, true}) {
                std::vector<float> d = product_of_bytes(qa, __NV_E4M3, qb, __NV_E4M3, M, N, k, fast);
                double worst = 0.0;
                for (size_t i = 0; i < d.size(); i++) worst = std::max(worst, std::fabs(d[i] - sum[i]) / abs_sum[i]);
                printf("  %s%s 2^%.1f", one_sign ? "one sign" : "random signs", fast ? " fast" : "", std::log2(worst));
            }
        }
        printf("\n");
    }
}
#endif

// ------------------------------------------------------------------------------------------------ timing

struct Layer {
    const char* name;
    int C, OC;
};

#if !defined(ENABLE_FP32)
// Prints one line per product: bf16, FP8, FP8 with fast accumulation (ms and TFLOP/s), and FP8's speedup.
static void time_layer(const Layer& layer, int T, bool reverse) {
    const int C = layer.C, OC = layer.OC;
    Fp8Tensor inp(T, C, __NV_E4M3, 21, 2.0f), w(OC, C, __NV_E4M3, 22, 0.03f), dout(T, OC, __NV_E5M2, 23, 1e-3f);
    DeviceBuffer<floatX> out((size_t)T * OC), dinp((size_t)T * C), dw((size_t)OC * C);
    cudaCheck(cudaMemset(dw.ptr, 0, dw.bytes()));
    const char* uses[3] = {"forward", "dinp", "dweight"};
    const std::array<int, 3> shapes[3] = {{T, OC, C}, {T, C, OC}, {OC, C, T}};  // M, N, K
    for (int u = 0; u < 3; u++) {
        auto bf16 = [&] {
            if (u == 0) matmul_forward(out.ptr, inp.x, w.x, T, C, OC, 0);
            else if (u == 1) matmul_backward(dinp.ptr, nullptr, dout.x, nullptr, w.x, T, C, OC, true, 0);
            else matmul_backward(nullptr, dw.ptr, dout.x, inp.x, w.x, T, C, OC, true, 0);
        };
        auto fp8 = [&](bool fast) {
            if (u == 0)
                matmul_fp8(out.ptr, inp.q.ptr, __NV_E4M3, w.q.ptr, __NV_E4M3, T, OC, C, inp.inv_scale.ptr,
                           w.inv_scale.ptr, false, nullptr, 0, fast);
            else if (u == 1)
                matmul_fp8(dinp.ptr, dout.q.ptr, __NV_E5M2, w.q_t.ptr, __NV_E4M3, T, C, OC, dout.inv_scale.ptr,
                           w.inv_scale.ptr, false, nullptr, 0, fast);
            else
                matmul_fp8(dw.ptr, dout.q_t.ptr, __NV_E5M2, inp.q_t.ptr, __NV_E4M3, OC, C, T, dout.inv_scale.ptr,
                           inp.inv_scale.ptr, true, nullptr, 0, fast);
        };
        float ms[3];
        for (int i = 0; i < 3; i++) {
            int v = reverse ? 2 - i : i;
            if (v == 0) ms[v] = benchmark_ms(50, bf16);
            else ms[v] = benchmark_ms(50, [&] { fp8(v == 2); });
        }
        const double tflop = 2.0 * shapes[u][0] * shapes[u][1] * shapes[u][2] / 1e12;
        printf("  %-4s %-8s (%5d, %5d, %5d)%s  bf16 %7.3f ms %6.1f | fp8 %7.3f ms %6.1f | fast %7.3f ms %6.1f | "
               "x%.2f\n", layer.name, uses[u], shapes[u][0], shapes[u][1], shapes[u][2], reverse ? " rev" : "    ",
               ms[0], tflop / (ms[0] * 1e-3), ms[1], tflop / (ms[1] * 1e-3), ms[2], tflop / (ms[2] * 1e-3),
               ms[0] / ms[1]);
    }
}
#endif

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    if (prop.major * 10 + prop.minor < 89) {
        printf("matmul_fp8: FP8 matmuls need sm_89 or newer; this GPU is sm_%d%d: skipped\n", prop.major, prop.minor);
        return 0;
    }
    matmul_init(0);

    const int T = 16384;
    const Layer layers[] = {{"qkv", 2048, 3072}, {"wo", 2048, 2048}, {"w13", 2048, 16384}, {"w2", 8192, 2048}};
    printf("validation\n");
    check_layer("small", 128, 256, 384, __NV_E5M2, 128, 1);
    check_layer("small, e4m3 gradients", 128, 256, 384, __NV_E4M3, 128, 11);
    check_layer("small, K = 48", 48, 80, 112, __NV_E5M2, 48, 21);
    for (const Layer& layer : layers) check_layer(layer.name, T, layer.C, layer.OC, __NV_E5M2, 8, 31);

#if !defined(ENABLE_FP32)
    printf("timing, T=%d: ms and TFLOP/s (median of 50), bf16 = llmc/matmul.cuh, fp8 = e4m3 x e4m3 forward, e5m2 "
           "gradients, fast = fp8 with fast accumulation; x = bf16 time / fp8 time\n", T);
    for (int pass = 0; pass < 2; pass++)
        for (const Layer& layer : layers) time_layer(layer, T, pass == 1);
#else
    probe_accumulation();  // timing: bf16 build only (the FP8 products are for the bf16 trainer)
#endif
    matmul_destroy();
    return finish(argv[0]);
}
