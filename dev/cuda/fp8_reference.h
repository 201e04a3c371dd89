// The CPU reference of llmc/fp8.cuh, shared by dev/cuda/fp8_cast.cu and dev/cuda/matmul_fp8.cu: FP8 encoding and
// decoding written from the formats' definitions (not from cuda_fp8.h's bit manipulations, against which
// fp8_reference_check tests it), the amax, and the scale convention.
//
//   e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448 = 1.75 * 2^8; no infinity, S.1111.111 is NaN.
//   e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; max 57344 = 1.75 * 2^15; S.11111.00 is infinity.
//   Exponent field 0 holds the subnormals, m * 2^(1 - bias - mantissa bits).
// Encoding is the hardware cast's (cvt.rn.satfinite): round to nearest, ties to even; a result past the largest
// finite value, infinity included, saturates to it (with the sign); NaN becomes 0x7F.
#pragma once

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

struct Fp8Format {
    int mantissa_bits;
    int exponent_bias;
    float max;  // largest finite value
};
inline Fp8Format cpu_fp8_format(__nv_fp8_interpretation_t format) {
    return format == __NV_E4M3 ? Fp8Format{3, 7, 448.0f} : Fp8Format{2, 15, 57344.0f};
}

inline uint32_t float_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof(b));
    return b;
}
inline float float_from_bits(uint32_t b) {
    float x;
    memcpy(&x, &b, sizeof(x));
    return x;
}

// Rounds x to the format's grid: in a binade [2^e, 2^(e+1)) the representable values are the multiples of
// 2^(e - mantissa bits); below the smallest normal 2^(1 - bias) the subnormals keep that binade's spacing. The
// division by a power of two and the rounding are exact in double; nearbyint rounds ties to even.
inline uint8_t cpu_fp8_encode(float x, __nv_fp8_interpretation_t format) {
    const Fp8Format f = cpu_fp8_format(format);
    if (std::isnan(x)) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const double a = std::fabs((double)x);
    const int min_normal_exponent = 1 - f.exponent_bias;
    double rounded = f.max;  // infinity saturates
    if (!std::isinf(a)) {
        int e = a == 0.0 ? min_normal_exponent : std::max(std::ilogb(a), min_normal_exponent);
        double spacing = std::ldexp(1.0, e - f.mantissa_bits);
        rounded = std::min(std::nearbyint(a / spacing) * spacing, (double)f.max);  // may step up a binade
    }
    if (rounded == 0.0) return sign;
    int e = std::ilogb(rounded);
    if (e < min_normal_exponent) {  // subnormal: exponent field 0
        return sign | (uint8_t)std::ldexp(rounded, f.mantissa_bits - min_normal_exponent);
    }
    int mantissa = (int)std::ldexp(rounded, f.mantissa_bits - e) - (1 << f.mantissa_bits);
    return sign | (uint8_t)((e + f.exponent_bias) << f.mantissa_bits) | (uint8_t)mantissa;
}

inline float cpu_fp8_decode(uint8_t byte, __nv_fp8_interpretation_t format) {
    const Fp8Format f = cpu_fp8_format(format);
    const int exponent_field_max = (1 << (7 - f.mantissa_bits)) - 1;
    int exponent = (byte & 0x7F) >> f.mantissa_bits;
    int mantissa = byte & ((1 << f.mantissa_bits) - 1);
    float value;
    if (format == __NV_E4M3 && exponent == exponent_field_max && mantissa == (1 << f.mantissa_bits) - 1) {
        value = NAN;
    } else if (format == __NV_E5M2 && exponent == exponent_field_max) {
        value = mantissa == 0 ? INFINITY : NAN;
    } else if (exponent == 0) {
        value = (float)std::ldexp((double)mantissa, 1 - f.exponent_bias - f.mantissa_bits);
    } else {
        value = (float)std::ldexp((double)((1 << f.mantissa_bits) + mantissa),
                                  exponent - f.exponent_bias - f.mantissa_bits);
    }
    return (byte & 0x80) ? -value : value;
}

// max |x| as the float whose bits are the largest of the |x| bits: the plain maximum for finite values, infinity
// if there is one, and a NaN (the largest payload) if there is one, which a float max would skip.
inline float cpu_amax(const std::vector<float>& x) {
    uint32_t m = 0;
    for (float v : x) m = std::max(m, float_bits(v) & 0x7FFFFFFFu);
    return float_from_bits(m);
}

// The scale convention (llmc/fp8.cuh): s = max / amax, 1 when amax is 0, infinite or NaN, and at most 2^126 so
// that 1 / s stays a normal float.
inline float cpu_fp8_scale(float amax, __nv_fp8_interpretation_t format) {
    uint32_t bits = float_bits(amax);
    if (bits == 0 || bits >= 0x7F800000u) return 1.0f;
    return std::min(cpu_fp8_format(format).max / amax, 0x1p126f);
}

// q = encode(x * s): the product rounded to fp32 first, as the kernels do.
inline uint8_t cpu_fp8_quantize(float x, float scale, __nv_fp8_interpretation_t format) {
    return cpu_fp8_encode(x * scale, format);
}

// Checks this reference against cuda_fp8.h's own conversion (its host code path, a bit-level emulation of the
// hardware cast): every bf16 bit pattern times each scale (the scaled products have full fp32 mantissas), both
// formats, every byte decoded. Returns the number of mismatches (NaN matches NaN when decoding).
inline size_t fp8_reference_check() {
    const float scales[] = {1.0f, 0.5f, 448.0f / 3.0f, 57344.0f / 7.0f, 1.0f / 3.0f, 0x1p-100f, 0x1p100f, 1.1f};
    size_t mismatches = 0;
    for (__nv_fp8_interpretation_t format : {__NV_E4M3, __NV_E5M2}) {
        for (int byte = 0; byte < 256; byte++) {
            __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)byte, format);
            float expected = __half2float(__half(h));
            float got = cpu_fp8_decode((uint8_t)byte, format);
            bool same = (std::isnan(expected) && std::isnan(got)) || float_bits(expected) == float_bits(got);
            mismatches += !same;
        }
        for (float s : scales) {
            for (uint32_t bf16 = 0; bf16 < 65536; bf16++) {
                float y = float_from_bits(bf16 << 16) * s;
                mismatches += cpu_fp8_encode(y, format) != __nv_cvt_float_to_fp8(y, __NV_SATFINITE, format);
            }
        }
    }
    return mismatches;
}
