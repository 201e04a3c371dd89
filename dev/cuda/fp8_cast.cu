// FP8 casts (llmc/fp8.cuh): the amax, the scaled cast to e4m3 / e5m2, and the transposed cast, checked bit for bit
// against the CPU reference (dev/cuda/fp8_reference.h), then timed.
//
//   amax = max |x|,   s = FP8_MAX / amax (1 for 0 / inf / NaN, at most 2^126),   q = cvt_rn_satfinite(fl32(x * s))
//
// Checks, every one exact (each output byte, the amax's and the inverse scale's bits), outputs poisoned with 0xFF
// bytes first (0xFF is a NaN in both formats, so an unwritten byte can't pass):
//   0. the reference itself against cuda_fp8.h's host conversion: every bf16 value times 8 scales, both formats,
//      every byte decoded (fp8_reference_check).
//   1. inputs: normal values times magnitudes from 2^-12 to 2^4 (so many land among the FP8 subnormals after scaling),
//      with zeros, -0 and bf16 subnormals mixed in; a "stale" amax 8 times too small (delayed scaling after the
//      values grew), so that values pass the FP8 maximum and saturate; special values (inf, NaN, the formats'
//      rounding and saturation boundaries) with s = 1; all zeros; all bf16 subnormals (s at its 2^126 bound).
//   2. shapes: 1 x 1, odd sizes (scalar paths), 16-multiples with partial 64 x 64 tiles, a misaligned view.
//   3. the amax of four tensors in one launch (fp8_amax_accumulate, the trainer's per-layer weights), into amaxes
//      that keep a larger earlier value.
// Timing at the Llama 3.2 1B's shapes (16384 tokens x 2048 activations, the 8192 x 2048 w2 weight as (F, C) and
// as (C, F)), GB/s against the H100's 3350 GB/s, counting the bytes read and written once; each launch on its own
// copy of the data (no L2 hits).
// H100 80GB HBM3, bf16 input, ms (share of 3350 GB/s):
//   16384 x 2048: amax 0.028 (71%), cast 0.039 (76%), transposed cast 0.040 (76%), both copies 0.052 (77%)
//   8192 x 2048:  amax 0.017 (58%), cast 0.023 (66%), transposed cast 0.023 (66%), both copies 0.029 (70%)
// A 33.5 MB cudaMemcpyAsync (read + write) in the same run: 0.028 ms, 2370 GB/s (71%); so these are about as fast as
// the copy engine at these sizes (on 50 MB the fixed costs weigh more). The fp32 build's twice larger inputs reach
// 80-83%. Tried, not kept (scratch, same run): 2 or 4 loads in flight per thread in the amax and 1024-4096 blocks,
// 2350-2410 GB/s against 2380; 32 elements per thread in the cast, 2020 GB/s against 2570; 128 or 512 threads per
// block, 2560-2570.
//
// build: make -C dev/cuda bin/fp8_cast   run: dev/cuda/bin/fp8_cast   (prints FAIL and exits 1 on any mismatch)
#include "common.h"
#include "fp8_reference.h"
#include "../../llmc/fp8.cuh"

static const char* format_name(__nv_fp8_interpretation_t format) { return format == __NV_E4M3 ? "e4m3" : "e5m2"; }

// Prints one line per comparison; a mismatch shows the first differing element and counts a failure.
static bool validate_bytes(const char* name, const std::vector<uint8_t>& gpu, const std::vector<uint8_t>& ref) {
    size_t mismatches = 0, first = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        if (gpu[i] != ref[i] && mismatches++ == 0) first = i;
    }
    bool ok = mismatches == 0;
    printf("  %-34s mismatches %zu / %zu", name, mismatches, ref.size());
    if (!ok) printf(" (first at %zu: gpu 0x%02x, cpu 0x%02x)", first, gpu[first], ref[first]);
    printf("  %s\n", ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    return ok;
}

static bool validate_float_bits(const char* name, float gpu, float ref) {
    bool ok = float_bits(gpu) == float_bits(ref);
    printf("  %-34s gpu %a (0x%08x)  cpu %a (0x%08x)  %s\n", name, gpu, float_bits(gpu), ref, float_bits(ref),
           ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    return ok;
}

static std::vector<uint8_t> bytes_from_device(const __nv_fp8_storage_t* d, size_t n) {
    std::vector<uint8_t> h(n);
    cudaCheck(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
    return h;
}
static float float_from_device(const float* d) {
    float h;
    cudaCheck(cudaMemcpy(&h, d, sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

// ------------------------------------------------------------------------------------------------ inputs

enum class Input { SPREAD, SPECIAL, ZEROS, SUBNORMALS };

// The values a test sees, already rounded to floatX (what the GPU holds).
static std::vector<float> make_input(size_t n, Input kind, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> exponent(-12.0f, 4.0f);
    // rounding and saturation boundaries of both formats (s = 1 here: the NaN makes the amax NaN)
    const float special[] = {0.0f,    -0.0f,      INFINITY,  -INFINITY, NAN,         -NAN,       448.0f,
                             464.0f,  465.0f,     -480.0f,   1e5f,      -1e5f,       57344.0f,   61440.0f,
                             6e4f,    0x1p-6f,    0x1p-9f,   0x1p-10f,  0x1.8p-10f,  -0x1p-10f,  0x1p-14f,
                             0x1p-16f, 0x1p-17f,  0x1.8p-17f, 0x1p-133f, -0x1p-126f, 0x1.2p-7f,  0x1.3p0f};
    std::vector<float> x(n);
    for (size_t i = 0; i < n; i++) {
        switch (kind) {
            case Input::SPREAD:
                x[i] = normal(rng) * std::exp2(exponent(rng));
                if (i % 97 == 5) x[i] = 0.0f;
                if (i % 97 == 6) x[i] = -0.0f;
                if (i % 97 == 7) x[i] = (i % 2 ? -1.0f : 1.0f) * 0x1p-130f;  // a bf16 subnormal
                break;
            case Input::SPECIAL:
                x[i] = i % 3 == 0 ? special[(i / 3) % (sizeof(special) / sizeof(float))] : normal(rng) * 100.0f;
                break;
            case Input::ZEROS: x[i] = i % 5 == 0 ? -0.0f : 0.0f; break;
            case Input::SUBNORMALS: x[i] = normal(rng) * 0x1p-128f; break;
        }
    }
    return round_to_floatX(x);
}

// ------------------------------------------------------------------------------------------------ checks

// The cast and both transposed casts of x (rows, cols) with the amax at d_amax (the GPU's own, or a stale one)
// against the reference with that amax.
static void check_casts(const std::vector<float>& x, const floatX* d_x, const float* d_amax, float amax, int rows,
                        int cols, __nv_fp8_interpretation_t format) {
    const size_t n = (size_t)rows * cols;
    const float s = cpu_fp8_scale(amax, format);
    std::vector<uint8_t> ref(n), ref_t(n);
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++) {
            uint8_t q = cpu_fp8_quantize(x[(size_t)r * cols + c], s, format);
            ref[(size_t)r * cols + c] = q;
            ref_t[(size_t)c * rows + r] = q;
        }
    }
    const float ref_inv_scale = 1.0f / s;
    DeviceBuffer<__nv_fp8_storage_t> d_out(n), d_out_t(n);
    DeviceBuffer<float> d_inv_scale(1);

    poison(d_out.ptr, n);
    poison(d_inv_scale.ptr, sizeof(float));
    fp8_cast(d_out.ptr, d_inv_scale.ptr, d_x, d_amax, n, format, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate_bytes("cast", bytes_from_device(d_out.ptr, n), ref);
    validate_float_bits("cast inv_scale", float_from_device(d_inv_scale.ptr), ref_inv_scale);

    poison(d_out.ptr, n);
    poison(d_out_t.ptr, n);
    poison(d_inv_scale.ptr, sizeof(float));
    fp8_cast_transpose(d_out_t.ptr, d_out.ptr, d_inv_scale.ptr, d_x, d_amax, rows, cols, format, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate_bytes("cast_transpose out_t", bytes_from_device(d_out_t.ptr, n), ref_t);
    validate_bytes("cast_transpose out", bytes_from_device(d_out.ptr, n), ref);
    validate_float_bits("cast_transpose inv_scale", float_from_device(d_inv_scale.ptr), ref_inv_scale);

    poison(d_out_t.ptr, n);
    fp8_cast_transpose(d_out_t.ptr, nullptr, nullptr, d_x, d_amax, rows, cols, format, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate_bytes("cast_transpose out_t alone", bytes_from_device(d_out_t.ptr, n), ref_t);
}

// x (rows, cols) of the given kind: the amax, then the casts with it; for SPREAD also with a stale amax.
// offset > 0 casts a view starting `offset` elements into the buffer (not 16-byte aligned: the scalar paths).
static void test_case(int rows, int cols, Input kind, __nv_fp8_interpretation_t format, uint64_t seed,
                      int offset = 0) {
    const char* kinds[] = {"spread", "special", "zeros", "subnormals"};
    printf("%s, %d x %d, %s%s\n", kinds[(int)kind], rows, cols, format_name(format), offset ? ", misaligned" : "");
    const size_t n = (size_t)rows * cols;
    std::vector<float> x = make_input(n, kind, seed);
    std::vector<float> padded(offset, 1.0f);  // never read: the view starts after them
    padded.insert(padded.end(), x.begin(), x.end());
    floatX* d_buffer = device_from_host<floatX>(padded);
    const floatX* d_x = d_buffer + offset;

    DeviceBuffer<float> d_amax(1);
    poison(d_amax.ptr, sizeof(float));
    fp8_amax(d_amax.ptr, d_x, n, 0);
    cudaCheck(cudaDeviceSynchronize());
    const float amax = cpu_amax(x);
    validate_float_bits("amax", float_from_device(d_amax.ptr), amax);
    check_casts(x, d_x, d_amax.ptr, amax, rows, cols, format);

    if (kind == Input::SPREAD) {
        printf(" with a stale amax (amax / 8: values saturate)\n");
        const float stale = amax / 8.0f;
        cudaCheck(cudaMemcpy(d_amax.ptr, &stale, sizeof(float), cudaMemcpyHostToDevice));
        check_casts(x, d_x, d_amax.ptr, stale, rows, cols, format);
    }
    cudaCheck(cudaFree(d_buffer));
}

// fp8_amax_accumulate: four tensors of different sizes and alignments in one launch (a layer's weights), each into
// its own amax, which keeps a larger value it held before (the trainer's slots are maxed into, zeroed per step).
static void test_amax_batch(uint64_t seed) {
    printf("amax of 4 tensors in one launch\n");
    const size_t sizes[] = {37 * 100, 4096 * 1024, 16, 64 * 200};
    const float starts[] = {0.0f, 0.0f, 1e30f, 0.0f};
    std::vector<std::vector<float>> x;
    std::vector<floatX*> d_x;
    for (int i = 0; i < 4; i++) {
        x.push_back(make_input(sizes[i], i == 3 ? Input::SPECIAL : Input::SPREAD, seed + i));
        d_x.push_back(device_from_host<floatX>(x.back()));
    }
    DeviceBuffer<float> d_amax(4 * 4);  // 16 bytes apart, as separate slots
    float* amax[4];
    for (int i = 0; i < 4; i++) {
        amax[i] = d_amax.ptr + 4 * i;
        cudaCheck(cudaMemcpy(amax[i], &starts[i], sizeof(float), cudaMemcpyHostToDevice));
    }
    fp8_amax_accumulate(amax, d_x.data(), sizes, 4, 0);
    cudaCheck(cudaDeviceSynchronize());
    for (int i = 0; i < 4; i++) {
        x[i].push_back(starts[i]);
        validate_float_bits("batched amax", float_from_device(amax[i]), cpu_amax(x[i]));
        cudaCheck(cudaFree(d_x[i]));
    }
    // the vector path needs every tensor aligned with n % VEC16 == 0: one odd tensor sends all four to the scalar one
    std::vector<float> odd = make_input(101, Input::SPREAD, seed + 9);
    floatX* d_odd = device_from_host<floatX>(odd);
    std::vector<float> big = make_input(4096, Input::SPREAD, seed + 10);
    floatX* d_big = device_from_host<floatX>(big);
    const floatX* both[] = {d_odd, d_big};
    const size_t both_sizes[] = {odd.size(), big.size()};
    cudaCheck(cudaMemset(d_amax.ptr, 0, 4 * 4 * sizeof(float)));
    fp8_amax_accumulate(amax, both, both_sizes, 2, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate_float_bits("batched amax (scalar path)", float_from_device(amax[0]), cpu_amax(odd));
    validate_float_bits("batched amax (scalar path)", float_from_device(amax[1]), cpu_amax(big));
    cudaCheck(cudaFree(d_odd));
    cudaCheck(cudaFree(d_big));
}

// ------------------------------------------------------------------------------------------------ timing

constexpr double HBM_GB_PER_S = 3350.0;  // H100 SXM

static void report(const char* name, int rows, int cols, float ms, double bytes) {
    double gb_per_s = bytes / (ms * 1e-3) / 1e9;
    printf("  %-30s %5d x %5d  %8.4f ms  %7.1f GB/s  %5.1f%% of HBM\n", name, rows, cols, ms, gb_per_s,
           100.0 * gb_per_s / HBM_GB_PER_S);
}

// Each launch takes the next of several copies of input and outputs, 256 MB or more in all, so that no launch finds
// its data in the 50 MB L2 left by the previous ones (the trainer casts each tensor once per use, from HBM).
static void time_shape(int rows, int cols, __nv_fp8_interpretation_t format) {
    const size_t n = (size_t)rows * cols;
    const int copies = (int)std::max<size_t>(2, ceil_div<size_t>(256ull << 20, n * (sizeof(floatX) + 2)));
    std::vector<floatX*> x(copies);
    std::vector<DeviceBuffer<__nv_fp8_storage_t>> out, out_t;
    for (int i = 0; i < copies; i++) {
        x[i] = device_random<floatX>(n, 7 + i, 3.0f);
        out.emplace_back(n);
        out_t.emplace_back(n);
    }
    DeviceBuffer<float> d_amax(1), d_inv_scale(1);
    int next = 0;
    auto take = [&] {  // the copy for this launch
        int i = next;
        next = (next + 1) % copies;
        return i;
    };
    const double in_bytes = (double)n * sizeof(floatX);
    const char* f = format_name(format);
    char name[64];
    float ms = benchmark_ms(50, [&] { fp8_amax(d_amax.ptr, x[take()], n, 0); });
    report("amax", rows, cols, ms, in_bytes);
    ms = benchmark_ms(50, [&] {
        int i = take();
        fp8_cast(out[i].ptr, d_inv_scale.ptr, x[i], d_amax.ptr, n, format, 0);
    });
    snprintf(name, sizeof(name), "cast %s", f);
    report(name, rows, cols, ms, in_bytes + n);
    ms = benchmark_ms(50, [&] {
        int i = take();
        fp8_cast_transpose(out_t[i].ptr, nullptr, d_inv_scale.ptr, x[i], d_amax.ptr, rows, cols, format, 0);
    });
    snprintf(name, sizeof(name), "cast_transpose %s (out_t)", f);
    report(name, rows, cols, ms, in_bytes + n);
    ms = benchmark_ms(50, [&] {
        int i = take();
        fp8_cast_transpose(out_t[i].ptr, out[i].ptr, d_inv_scale.ptr, x[i], d_amax.ptr, rows, cols, format, 0);
    });
    snprintf(name, sizeof(name), "cast_transpose %s (both)", f);
    report(name, rows, cols, ms, in_bytes + 2.0 * n);
    for (floatX* p : x) cudaCheck(cudaFree(p));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);

    size_t mismatches = fp8_reference_check();
    printf("CPU reference vs cuda_fp8.h host conversion: %zu mismatches  %s\n", mismatches,
           mismatches == 0 ? "OK" : "FAIL");
    if (mismatches != 0) g_failures++;

    uint64_t seed = 1;
    for (__nv_fp8_interpretation_t format : {__NV_E4M3, __NV_E5M2}) {
        test_case(1, 1, Input::SPREAD, format, seed++);
        test_case(37, 100, Input::SPREAD, format, seed++);      // scalar cast (n % 16 != 0), scalar transpose
        test_case(48, 2056, Input::SPREAD, format, seed++);     // vector paths in bf16, partial tiles in both dims
        test_case(256, 512, Input::SPREAD, format, seed++);     // whole tiles
        test_case(100, 48, Input::SPREAD, format, seed++);      // rows % 16 != 0: scalar transpose
        test_case(64, 64, Input::SPREAD, format, seed++, 3);    // misaligned view: scalar paths everywhere
        test_case(64, 200, Input::SPECIAL, format, seed++);
        test_case(32, 64, Input::ZEROS, format, seed++);
        test_case(32, 64, Input::SUBNORMALS, format, seed++);
        test_case(4096, 1024, Input::SPREAD, format, seed++);   // more than one pass of the amax grid
    }
    test_amax_batch(seed);

    printf("timing (median of 50; bytes read and written once; %s input)\n", PRECISION_NAME);
    time_shape(16384, 2048, __NV_E4M3);  // activations: the 1B's residual width at 16384 tokens
    time_shape(16384, 2048, __NV_E5M2);  // their gradients
    time_shape(8192, 2048, __NV_E4M3);   // w2 as (F, C) ...
    time_shape(2048, 8192, __NV_E4M3);   // ... and as (C, F)
    return finish(argv[0]);
}
