// How the flat parameter buffer (ParamTensor order, llmc/model.h) is split over the ranks of a multi-GPU run, the
// layer slots of ZeRO-2's gradients and ZeRO-3's gathered weights, and how an optimizer state written in one split is
// read back in another (resharding). Host code only: the GPU side (llmc/multi_gpu.cuh) and the state files' readers
// (llmc/reshard.h) share it, and a CPU test checks it.
//
// Slices. The buffer is cut into slices: each layer's part of each per-layer tensor (attn_norm[l], wqkv[l], ...) and
// the whole of each other tensor (tok_embedding, final_norm, lm_head). A slice of S elements is split into N equal
// parts (N ranks; S % N == 0 is required) and rank r owns part r, elements [offset + r S/N, offset + (r+1) S/N). A
// rank's shard is its parts of every slice, back to back in flat order, num_params / N elements; slice k's part
// starts at shard offset offset_k / N. The slices do not depend on N: only the parts do.
//
// Slots. A buffer that holds two layers at a time and the tensors outside the layers, one vocabulary table at a time
// (SlotLayout): stage 2's and 3's gradients as the backward writes them, and stage 3's gathered weights as the
// forward and backward read them.
//
// Resharding. A checkpoint's optimizer state (master weights, AdamW m and v) lies in one state file per rank: the
// whole state in every file (ZeRO stage 0, and every run on one GPU) or each rank's shard (stages 1 to 3). A run
// with another number of ranks or another stage reads, for each of its elements, the one file that holds it:
// reshard_ranges lists those reads as runs of elements contiguous in both the file and the reader's state.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "model.h"

struct ParamSlice {
    int tensor;          // its ParamTensor
    int layer;           // -1 for the tensors outside the layers
    size_t offset;       // in the flat parameter buffer
    size_t size;         // elements; a multiple of the number of ranks
    size_t tensor_offset;  // offset of the slice within its tensor
};

struct ShardLayout {
    int world = 1, rank = 0;
    size_t shard_size = 0;              // num_params / world
    std::vector<ParamSlice> slices;     // flat order
    std::vector<std::vector<int>> layer_slices;  // per layer, its slices' indices
    std::vector<int> head_slices;       // slices of the tensors outside the layers

    size_t part(const ParamSlice& s) const { return s.size / world; }                  // elements a rank owns
    size_t shard_offset(const ParamSlice& s) const { return s.offset / world; }        // in the shard buffers
    size_t owned_offset(const ParamSlice& s) const { return s.offset + rank * part(s); }  // in the flat buffer
};

// Returns false (with why) when some slice does not split evenly over the ranks.
inline bool make_shard_layout(const Llama3Config& c, int world, int rank, ShardLayout* out, std::string* why) {
    ParamLayout layout = param_layout(c);
    ShardLayout s;
    s.world = world;
    s.rank = rank;
    s.layer_slices.assign(c.n_layers, {});
    size_t offset = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t size = layout.sizes[t];
        if (size == 0) continue;
        bool per_layer = param_is_per_layer(t);
        int pieces = per_layer ? c.n_layers : 1;
        size_t piece = size / pieces;
        for (int l = 0; l < pieces; l++) {
            if (piece % world != 0) {
                char buf[192];
                snprintf(buf, sizeof(buf), "%s%s has %zu elements, not a multiple of %d ranks", layout.names[t],
                         per_layer ? " (per layer)" : "", piece, world);
                *why = buf;
                return false;
            }
            int index = (int)s.slices.size();
            s.slices.push_back({t, per_layer ? l : -1, offset + l * piece, piece, l * piece});
            if (per_layer) s.layer_slices[l].push_back(index);
            else s.head_slices.push_back(index);
        }
        offset += size;
    }
    s.shard_size = offset / world;
    *out = s;
    return true;
}

// Two layer-sized slots, layer l in slot l % 2, each holding that layer's slices of the per-layer tensors back to
// back in ParamTensor order, then the vocabulary table and final_norm. The table is tok_embedding's place, and an
// untied lm_head's too: the passes need the two at different times (the embedding at the forward's start, the
// lm_head in the classifier; their gradients at the backward's end and in the classifier), so one V x C place
// serves both (Gradients, Weights). Every offset is a multiple of dim elements, as in the flat buffer: where dim
// elements are a multiple of 256 bytes (every named config), each tensor starts 256-byte aligned in either, and the
// matmuls, which pick their algorithm by shape and pointer alignment, compute the same bits from either.
struct SlotLayout {
    size_t slot_size = 0;  // one layer's parameters
    size_t head_size = 0;  // the vocabulary table and final_norm
    size_t offsets[NUM_PARAM_TENSORS] = {};  // per-layer tensors: within a slot; the others: from the buffer's start

    size_t size() const { return 2 * slot_size + head_size; }
    size_t slot_offset(int layer) const { return (size_t)(layer % 2) * slot_size; }
    size_t head_offset() const { return 2 * slot_size; }
    // Where layer `layer`'s slice of a per-layer tensor starts, or the whole of another tensor (any `layer`).
    size_t at(int tensor, int layer) const {
        return param_is_per_layer(tensor) ? slot_offset(layer) + offsets[tensor] : offsets[tensor];
    }
};

inline SlotLayout make_slot_layout(const Llama3Config& c) {
    ParamLayout layout = param_layout(c);
    SlotLayout s;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (!param_is_per_layer(t)) continue;
        s.offsets[t] = s.slot_size;
        s.slot_size += layout.sizes[t] / c.n_layers;
    }
    s.offsets[TOK_EMBEDDING] = s.offsets[LM_HEAD] = s.head_offset();
    s.offsets[FINAL_NORM] = s.head_offset() + layout.sizes[TOK_EMBEDDING];
    s.head_size = layout.sizes[TOK_EMBEDDING] + layout.sizes[FINAL_NORM];
    return s;
}

// A buffer in SlotLayout seen as ParamTensors: the per-layer tensors at layer `layer`'s slices (in its slot), the
// others whole.
template <typename T>
inline ParamTensors<T> slot_tensors(T* base, const SlotLayout& s, int layer) {
    ParamTensors<T> p;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) p[t] = base + s.at(t, layer);
    return p;
}

// How a checkpoint's optimizer state is spread over its state files: written by `world` ranks, each file holding
// the whole state (stage 0) or its rank's shard (stages 1 to 3).
struct StateLayout {
    int world = 1, stage = 0;
    bool sharded() const { return stage >= 1; }
    bool operator==(const StateLayout& o) const { return world == o.world && stage == o.stage; }
    bool operator!=(const StateLayout& o) const { return !(*this == o); }
};

// `count` optimizer elements from the state file of writer rank `rank`, at element `src` of each of its arrays, to
// element `dst` of the reader's arrays.
struct StateRange {
    int rank;
    size_t src, dst, count;
};

// The reads, in the reader's element order, that fill the optimizer state of rank `rank` of a run in layout
// `reader` from a checkpoint of the same model `c` written in layout `writer`. From a stage-0 checkpoint, whose
// files all hold the whole state, reader rank r reads file r % writer.world, which spreads the reads over the files
// (and is its own file when the layout is unchanged). Reads that continue one another are merged, so an unchanged
// layout is one read of the rank's own file. Returns "" or why one of the layouts cannot split this model.
inline std::string reshard_ranges(const Llama3Config& c, StateLayout writer, StateLayout reader, int rank,
                                  std::vector<StateRange>* out) {
    const char* names[2] = {"the checkpoint's layout", "this run's layout"};
    const char* remedies[2] = {" (corrupt)", "; use -Z 0"};
    StateLayout layouts[2] = {writer, reader};
    for (int i = 0; i < 2; i++) {
        ShardLayout split;
        std::string why;
        if (layouts[i].sharded() && !make_shard_layout(c, layouts[i].world, 0, &split, &why)) {
            char buf[320];
            snprintf(buf, sizeof(buf), "%s (%d GPU(s), ZeRO stage %d) cannot split this model: %s%s", names[i],
                     layouts[i].world, layouts[i].stage, why.c_str(), remedies[i]);
            return buf;
        }
    }
    ShardLayout whole;
    std::string unused;
    make_shard_layout(c, 1, 0, &whole, &unused);  // one rank splits any model
    out->clear();
    auto read = [&](int file, size_t src, size_t dst, size_t count) {
        StateRange* last = out->empty() ? nullptr : &out->back();
        if (last != nullptr && last->rank == file && last->src + last->count == src && last->dst + last->count == dst) {
            last->count += count;
        } else {
            out->push_back({file, src, dst, count});
        }
    };
    for (const ParamSlice& s : whole.slices) {
        // the reader's elements of this slice, [lo, hi) in flat order, and where the first one goes
        size_t lo = s.offset, hi = s.offset + s.size, dst = s.offset;
        if (reader.sharded()) {
            size_t part = s.size / reader.world;
            lo = s.offset + rank * part;
            hi = lo + part;
            dst = s.offset / reader.world;
        }
        if (!writer.sharded()) {
            read(rank % writer.world, lo, dst, hi - lo);
            continue;
        }
        size_t part = s.size / writer.world;
        for (int w = (int)((lo - s.offset) / part); w < writer.world && s.offset + w * part < hi; w++) {
            size_t begin = std::max(lo, s.offset + w * part), end = std::min(hi, s.offset + (w + 1) * part);
            read(w, s.offset / writer.world + (begin - (s.offset + w * part)), dst + (begin - lo), end - begin);
        }
    }
    return "";
}
