// The shapes attention_forward.cu and attention_backward.cu both validate and time (B, T, H query heads, KV kv heads,
// head dim hd). Their CPU reference is cpu::attention_forward / attention_backward in dev/cpu/llama3_cpu.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

struct Shape {
    int B, T, H, KV, hd;
};

// Every version is validated on these: T not a multiple of any tile, group sizes 1, 4, 8, head dims 16, 64, 128;
// edges (a single token, an exact tile, one past it, head dims that are neither 64 nor 128, a tiny one); and long
// rows and key ranges (the pipelines' steady state, ragged ends) at the tensor-core head dims.
static std::vector<Shape> attention_validation_shapes() {
    std::vector<Shape> shapes;
    for (int T : {13, 100, 257}) {
        for (int KV : {8, 2, 1}) {
            for (int hd : {16, 64, 128}) shapes.push_back({2, T, 8, KV, hd});
        }
    }
    for (Shape sh : {Shape{2, 1, 4, 2, 64}, Shape{2, 64, 4, 1, 32}, Shape{2, 65, 4, 4, 100}, Shape{1, 130, 2, 1, 8},
                     Shape{2, 64, 4, 1, 128}, Shape{1, 1000, 4, 1, 128}, Shape{1, 703, 8, 2, 64}}) {
        shapes.push_back(sh);
    }
    return shapes;
}

// More work items (B H ceil(T / 128) query tiles) than an H100 or H200 has SMs (132), for the persistent Hopper
// kernels (llmc/attention_wgmma_forward.cuh, the dQ kernel of llmc/attention_wgmma_backward.cuh): a CTA takes several
// items of unequal lengths, its rings running on from one to the next. 768 items at T = 257: up to 6 per CTA, each of
// the forward's two Q buffers through 3 phases; 1152 at T = 1100: up to 9 key tiles per item, so that the K / V ring
// also wraps within an item.
static const Shape ATTENTION_PERSISTENT_SHAPES[] = {{8, 257, 32, 8, 64}, {8, 257, 32, 8, 128}, {4, 1100, 32, 8, 64},
                                                   {4, 1100, 32, 4, 128}};

// The sweep's spot validation of a tile configuration (both tensor-core head dims, ragged, grouped).
static const Shape ATTENTION_SWEEP_SHAPES[] = {{2, 257, 8, 2, 64}, {1, 1000, 4, 1, 64}, {2, 257, 8, 2, 128},
                                              {1, 1000, 4, 1, 128}};
// The timing shapes (B, T, H, KV, hd): the three.
static const Shape ATTENTION_TIMING_SHAPES[] = {{4, 2048, 32, 8, 64}, {2, 4096, 32, 8, 128}, {1, 8192, 32, 8, 128}};

// Whether every requested version exists in this build; prints which one does not.
static bool attention_versions_known(const std::vector<int>& requested, const std::vector<int>& known,
                                     const char* precision) {
    for (int version : requested) {
        if (std::find(known.begin(), known.end(), version) == known.end()) {
            fprintf(stderr, "unknown version %d (this %s build has versions 1..%d)\n", version, precision,
                    (int)known.size());
            return false;
        }
    }
    return true;
}
