// Integer hashes, the one source of random numbers in the trainer: the same on the host and the GPU, so every random
// value is a pure function of its seed and index (reproducible on any GPU, grid size or number of ranks).
//
//   splitmix64(x): 64 -> 64 bits, the output of one step of the splitmix64 generator from state x (Steele, Lea and
//                  Flood's finaliser after adding the golden-ratio increment). Used for the random init, the data
//                  order (SplitMix64 in dataloader.h) and the matmul output fingerprint.
//   hash32(x):     32 -> 32 bits, the "lowbias32" mixer: cheap enough for the optimizer's per-element stochastic
//                  rounding bits, where every integer instruction shows.
//   random_unit(&state): the one sequential generator (xorshift64*, host only): a double in [0, 1) per call, for
//                  the sampler, whose state is saved in the checkpoint so a resumed run samples the same text.
// Both mix every input bit into every output bit. Changing either changes the init, the data order and the bf16
// rounding of every run: the values are part of the trainer's reproducibility.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HASH_FUNC __host__ __device__ __forceinline__
#else
#define HASH_FUNC inline
#endif

constexpr uint64_t GOLDEN_RATIO_64 = 0x9E3779B97F4A7C15ull;

HASH_FUNC uint64_t splitmix64(uint64_t x) {
    x += GOLDEN_RATIO_64;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

HASH_FUNC uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// xorshift64* (Vigna): advances *state (never 0) and returns its top 53 bits as a double in [0, 1).
inline double random_unit(uint64_t* state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (double)((*state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}
