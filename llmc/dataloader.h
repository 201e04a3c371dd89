// Reads batches of tokens from llm.c-style Llama 3 shards (written by dev/data/shards.py).
//
// Shard layout (little-endian): a header of 256 int32 ([0] magic 20240801, [1] version 7, [2] token count N,
// [3] loss-mask flag, the rest zero), then N uint32 token ids. A plain shard (llm.c's format, flag 0) is exactly
// 1024 + 4 N bytes. With flag 1 a loss mask follows the tokens: N uint8, mask[i] = 1 when token i counts as a
// target of the loss (predicting it from the tokens before it is trained), 0 when not; such a shard is exactly
// 1024 + 5 N bytes (dev/data/chat_to_shards.py writes them: only the assistant's tokens count).
//
// The mask reaches the trainer through the targets: a target whose token has mask 0 is delivered as -1, which the
// loss (llmc/fused_classifier.cuh) ignores. Inputs are never masked. A plain shard counts every target.
//
// How a shard is read (the llm.c convention). With P processes, a "sample" is P*B*T consecutive tokens plus one;
// shard s holds (N_s - 1) / (P*B*T) samples, the tokens left after the last one are never used. Rank r reads
// B*T+1 tokens of every sample, starting at r*B*T: inputs are the first B*T, targets the same shifted by one.
// So at each step the ranks read disjoint parts of the same sample, and together they see every sample once.
//
// Order. Without shuffling: the shards in sorted file-name order, each one's samples front to back, then again
// (epoch 1, ...). With shuffling: each epoch visits the shards in a permutation and each shard's samples in a
// permutation, both drawn afresh for every epoch. A permutation depends only on (seed, epoch, shard), never on how
// the loader got there, so every rank computes the same one and a restored position gives the same batches.
//
// The eval loader (init_eval) walks every shard once in order; next_batch() then returns false until reset().
//
// Every file is checked when the loader starts, every batch's ids are checked against vocab_size before they can
// reach the GPU; a bad file, an id out of range or a state that does not fit names the file and exits with status 1.
//
// API:
//   DataLoader loader;
//   loader.init(pattern, B, T, rank, num_ranks, shuffle, seed, vocab_size);  // training: endless, epochs
//   loader.init_eval(pattern, B, T, rank, num_ranks, vocab_size);            // validation: one pass
//   bool ok = loader.next_batch();      // fills loader.inputs / loader.targets (B*T ints each, row-major (B, T));
//                                       // false only for an eval loader that has finished its pass
//   loader.reset();                     // back to the start of epoch 0 (the eval pass starts over)
//   loader.done(); loader.num_batches();  // eval pass finished; batches in one epoch / one eval pass
//   DataLoaderState s = loader.state(); loader.restore(s, "where it came from");   // resume, in memory
//   loader.save_state(fp); loader.load_state(fp, "path");                         // resume, through a file
//   loader.batch_shard, loader.batch_offset   // shard index and token offset the last batch was read from
//   DataLoader::read_whole_shard(path, vocab_size)   // every token of one shard (a prompt for sampling)
#pragma once

#include <glob.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "hash.h"
#include "utils.h"

constexpr int SHARD_MAGIC = 20240801;
constexpr int SHARD_VERSION = 7;
constexpr int SHARD_HEADER_INTS = 256;
constexpr int64_t SHARD_HEADER_BYTES = SHARD_HEADER_INTS * sizeof(int32_t);
constexpr int64_t DATALOADER_STATE_MAGIC = 20261124;
constexpr int64_t DATALOADER_STATE_VERSION = 1;

// splitmix64 (llmc/hash.h): a tiny, well-mixed 64-bit generator whose whole state is one integer.
struct SplitMix64 {
    uint64_t state;
    explicit SplitMix64(uint64_t seed) : state(seed) {}
    uint64_t next() {
        uint64_t z = splitmix64(state);
        state += GOLDEN_RATIO_64;
        return z;
    }
    // Uniform in [0, n), n > 0: draws past the last whole multiple of n are redrawn, so no value is favored.
    uint64_t below(uint64_t n) {
        uint64_t limit = UINT64_MAX - UINT64_MAX % n;
        uint64_t x;
        do { x = next(); } while (x >= limit);
        return x % n;
    }
};

// A permutation of 0..n-1 (Fisher-Yates) determined by (seed, epoch, stream).
inline void seeded_permutation(std::vector<int64_t>* perm, int64_t n, uint64_t seed, int64_t epoch, int64_t stream) {
    SplitMix64 mix(seed);
    mix.state = mix.next() ^ (uint64_t)epoch;
    mix.state = mix.next() ^ (uint64_t)stream;
    SplitMix64 rng(mix.next());
    perm->resize((size_t)n);
    for (int64_t i = 0; i < n; i++) (*perm)[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)rng.below((uint64_t)(i + 1));
        int64_t t = (*perm)[i]; (*perm)[i] = (*perm)[j]; (*perm)[j] = t;
    }
}

// Everything needed to resume a loader, as 16 int64 (128 bytes) so it can be written as is. All ranks share it:
// saving rank 0's is enough. The settings fields are only there to refuse a state from a different run.
struct DataLoaderState {
    int64_t magic, version;
    int64_t B, T, num_processes, shuffle, eval, num_shards, total_tokens;  // settings it belongs to
    int64_t seed;                                                         // uint64 bits
    int64_t epoch, shard_pos, sample_pos, done;                           // where it is
    int64_t reserved[2];
};
static_assert(sizeof(DataLoaderState) == 128, "DataLoaderState is written to files: keep it 16 int64");

struct DataLoader {
    // settings
    std::string pattern;
    int B = 0, T = 0, process_rank = 0, num_processes = 1, vocab_size = 0;
    bool shuffle = false, eval = false;
    uint64_t seed = 0;
    // the shards, in sorted name order
    std::vector<std::string> files;
    std::vector<int64_t> shard_tokens;   // N_s
    std::vector<int64_t> shard_samples;  // (N_s - 1) / (P*B*T)
    std::vector<bool> shard_masked;      // the shard carries a loss mask
    int64_t total_tokens = 0, total_samples = 0;
    // position: the next batch is sample sample_order[sample_pos] of shard shard_order[shard_pos]
    int64_t epoch = 0, shard_pos = 0, sample_pos = 0;
    bool finished = false;  // eval pass over
    std::vector<int64_t> shard_order, sample_order;
    int64_t order_epoch = -1, order_shard = -1;  // which permutations shard_order / sample_order hold
    // the last batch
    std::vector<int> inputs, targets;
    int64_t batch_shard = -1, batch_offset = -1;

    DataLoader() = default;
    DataLoader(const DataLoader&) = delete;  // owns an open FILE*
    DataLoader& operator=(const DataLoader&) = delete;
    ~DataLoader() { close_file(); }

    void init(const char* glob_pattern, int B_, int T_, int rank, int num_ranks, bool shuffle_, uint64_t seed_,
              int vocab_size_) {
        setup(glob_pattern, B_, T_, rank, num_ranks, shuffle_, seed_, vocab_size_, false);
    }

    void init_eval(const char* glob_pattern, int B_, int T_, int rank, int num_ranks, int vocab_size_) {
        setup(glob_pattern, B_, T_, rank, num_ranks, false, 0, vocab_size_, true);
    }

    int64_t num_batches() const { return total_samples; }
    bool done() const { return finished; }

    void reset() {
        epoch = shard_pos = sample_pos = 0;
        finished = false;
        update_orders();
    }

    bool next_batch() {
        if (finished) return false;
        int64_t shard = shard_order[shard_pos];
        int64_t sample = shuffle ? sample_order[sample_pos] : sample_pos;
        int64_t BT = (int64_t)B * T;
        int64_t offset = sample * num_processes * BT + process_rank * BT;  // in tokens from the shard's start
        read_tokens(shard, offset, BT + 1);
        for (int64_t i = 0; i < BT + 1; i++) {
            if (buffer[i] >= (uint32_t)vocab_size) {
                fprintf(stderr, "Error: shard '%s' holds token id %u at token offset %lld (byte offset %lld), but the "
                                "model's vocab_size is %d: the data was made with a different tokenizer, or is "
                                "corrupt\n", files[shard].c_str(), buffer[i], (long long)(offset + i),
                        (long long)(SHARD_HEADER_BYTES + 4 * (offset + i)), vocab_size);
                fail_exit();
            }
        }
        if (shard_masked[shard]) read_mask(shard, offset, BT + 1);
        for (int64_t i = 0; i < BT; i++) {
            bool counts = !shard_masked[shard] || mask_buffer[i + 1] != 0;
            inputs[i] = (int)buffer[i];
            targets[i] = counts ? (int)buffer[i + 1] : -1;
        }
        batch_shard = shard;
        batch_offset = offset;
        advance();
        return true;
    }

    DataLoaderState state() const {
        DataLoaderState s;
        memset(&s, 0, sizeof(s));
        s.magic = DATALOADER_STATE_MAGIC;
        s.version = DATALOADER_STATE_VERSION;
        s.B = B; s.T = T; s.num_processes = num_processes; s.shuffle = shuffle; s.eval = eval;
        s.num_shards = (int64_t)files.size(); s.total_tokens = total_tokens;
        s.seed = (int64_t)seed;
        s.epoch = epoch; s.shard_pos = shard_pos; s.sample_pos = sample_pos; s.done = finished;
        return s;
    }

    // Continues from a saved state; `what` names where it came from for error messages. The loader must have been
    // initialized with the same pattern, T and shuffle setting (the rank may differ); the seed is taken from the
    // state. B and the number of processes may differ too (a run resumed on another number of GPUs): with the same
    // sample size (processes x B x T) the position is the same sample, so the same batches follow, split differently
    // over the ranks. With another sample size the samples themselves differ, so the position carries over in
    // tokens: the loader goes on at the first of its samples that starts at or after the tokens the saved one had
    // read of its current shard. In order, that is where it stopped (when the sizes divide evenly); shuffled, the
    // rest of that shard comes in the new size's permutation (some of its tokens are seen twice, others not at all
    // in this epoch); from the next shard on, each shard is read whole in either case.
    void restore(const DataLoaderState& s, const char* what) {
        if (s.magic != DATALOADER_STATE_MAGIC || s.version != DATALOADER_STATE_VERSION) {
            fprintf(stderr, "Error: %s is not a dataloader state (magic %lld version %lld, expected %lld and %lld)\n",
                    what, (long long)s.magic, (long long)s.version, (long long)DATALOADER_STATE_MAGIC,
                    (long long)DATALOADER_STATE_VERSION);
            fail_exit();
        }
        if (s.T != T || s.shuffle != (int64_t)shuffle || s.eval != (int64_t)eval ||
            s.num_shards != (int64_t)files.size() || s.total_tokens != total_tokens) {
            fprintf(stderr, "Error: dataloader state %s was saved with T=%lld shuffle=%lld eval=%lld over %lld "
                            "shards / %lld tokens, but this loader has T=%d shuffle=%d eval=%d over %zu shards / %lld "
                            "tokens ('%s'); resuming would not continue the same batch sequence\n", what,
                    (long long)s.T, (long long)s.shuffle, (long long)s.eval, (long long)s.num_shards,
                    (long long)s.total_tokens, T, (int)shuffle, (int)eval, files.size(), (long long)total_tokens,
                    pattern.c_str());
            fail_exit();
        }
        if (s.B < 1 || s.num_processes < 1 || s.B * s.num_processes > INT32_MAX || s.epoch < 0 || s.shard_pos < 0 ||
            s.shard_pos >= s.num_shards || s.sample_pos < 0 || (s.done != 0 && s.done != 1)) {
            fprintf(stderr, "Error: dataloader state %s holds an impossible position (B %lld processes %lld epoch %lld "
                            "shard %lld sample %lld)\n", what, (long long)s.B, (long long)s.num_processes,
                    (long long)s.epoch, (long long)s.shard_pos, (long long)s.sample_pos);
            fail_exit();
        }
        seed = (uint64_t)s.seed;
        epoch = s.epoch;
        shard_pos = s.shard_pos;
        finished = s.done != 0;
        order_epoch = order_shard = -1;  // the seed may have changed: recompute the permutations
        update_orders();
        int64_t shard = shard_order[shard_pos];
        int64_t saved_sample_tokens = s.num_processes * s.B * T;
        if (s.sample_pos >= (shard_tokens[shard] - 1) / saved_sample_tokens) {
            fprintf(stderr, "Error: dataloader state %s: sample %lld (of %lld x %lld x %d tokens) is past the end of "
                            "shard '%s'\n", what, (long long)s.sample_pos, (long long)s.num_processes,
                    (long long)s.B, T, files[shard].c_str());
            fail_exit();
        }
        if (saved_sample_tokens == sample_tokens()) {
            sample_pos = s.sample_pos;
            return;
        }
        int64_t read = s.sample_pos * saved_sample_tokens;
        sample_pos = (read + sample_tokens() - 1) / sample_tokens();
        if (sample_pos >= shard_samples[shard]) next_shard();
    }

    void save_state(FILE* fp) const {
        DataLoaderState s = state();
        fwriteCheck(&s, sizeof(s), 1, fp, "dataloader state");
    }

    // Restores the state saved at fp's position, and returns it (what it was saved with).
    DataLoaderState load_state(FILE* fp, const char* what) {
        DataLoaderState s;
        freadCheck(&s, sizeof(s), 1, fp, what);
        restore(s, what);
        return s;
    }

    // Tokens of one sample: every process's B x T (the targets' one more token is shared with the next sample).
    int64_t sample_tokens() const { return (int64_t)num_processes * B * T; }

    // The tokens of one whole shard (a sampling prompt, say; a loss mask is not read), each checked against
    // vocab_size.
    static std::vector<int> read_whole_shard(const char* path, int vocab_size) {
        bool masked;
        int64_t n = validate_shard(path, &masked);
        std::vector<uint32_t> raw((size_t)n);
        FILE* f = fopenCheck(path, "rb");
        fseekCheck(f, SHARD_HEADER_BYTES, SEEK_SET);
        freadCheck(raw.data(), sizeof(uint32_t), (size_t)n, f, path);
        fcloseCheck(f);
        std::vector<int> tokens((size_t)n);
        for (int64_t i = 0; i < n; i++) {
            if (raw[i] >= (uint32_t)vocab_size) {
                fprintf(stderr, "Error: shard '%s' holds token id %u at token offset %lld, but the model's vocab_size "
                                "is %d\n", path, raw[i], (long long)i, vocab_size);
                fail_exit();
            }
            tokens[i] = (int)raw[i];
        }
        return tokens;
    }

private:
    std::vector<uint32_t> buffer;      // B*T+1 raw tokens
    std::vector<uint8_t> mask_buffer;  // their loss mask, for masked shards
    FILE* fp = nullptr;
    int64_t open_shard = -1;

    void setup(const char* glob_pattern, int B_, int T_, int rank, int num_ranks, bool shuffle_, uint64_t seed_,
               int vocab_size_, bool eval_) {
        if (B_ < 1 || T_ < 1 || (int64_t)B_ * T_ >= INT32_MAX) {
            fprintf(stderr, "Error: dataloader B=%d T=%d: both must be >= 1 and B*T < 2^31\n", B_, T_);
            fail_exit();
        }
        if (num_ranks < 1 || rank < 0 || rank >= num_ranks) {
            fprintf(stderr, "Error: dataloader rank %d of %d processes is not a valid rank\n", rank, num_ranks);
            fail_exit();
        }
        if (vocab_size_ < 1) {
            fprintf(stderr, "Error: dataloader vocab_size %d must be >= 1\n", vocab_size_);
            fail_exit();
        }
        close_file();
        pattern = glob_pattern;
        B = B_; T = T_; process_rank = rank; num_processes = num_ranks; vocab_size = vocab_size_;
        shuffle = shuffle_; eval = eval_; seed = seed_;
        files = glob_files(glob_pattern);
        shard_tokens.clear();
        shard_samples.clear();
        shard_masked.clear();
        total_tokens = total_samples = 0;
        for (const std::string& f : files) {
            bool masked;
            int64_t n = validate_shard(f.c_str(), &masked);
            if (n < sample_tokens() + 1) {
                fprintf(stderr, "Error: shard '%s' has %lld tokens, fewer than the %lld one batch needs "
                                "(processes %d x B %d x T %d + 1): use a smaller B or T, or bigger shards\n",
                        f.c_str(), (long long)n, (long long)(sample_tokens() + 1), num_processes, B, T);
                fail_exit();
            }
            shard_tokens.push_back(n);
            shard_masked.push_back(masked);
            shard_samples.push_back((n - 1) / sample_tokens());
            total_tokens += n;
            total_samples += shard_samples.back();
        }
        buffer.assign((size_t)B * T + 1, 0);
        mask_buffer.assign((size_t)B * T + 1, 0);
        inputs.assign((size_t)B * T, 0);
        targets.assign((size_t)B * T, 0);
        order_epoch = order_shard = -1;
        batch_shard = batch_offset = -1;
        reset();
    }

    static std::vector<std::string> glob_files(const char* glob_pattern) {
        glob_t g;
        memset(&g, 0, sizeof(g));
        int rc = glob(glob_pattern, 0, nullptr, &g);  // sorted by name
        if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
            fprintf(stderr, "Error: no files match the shard pattern '%s'\n", glob_pattern);
            globfree(&g);
            fail_exit();
        }
        if (rc != 0) {
            fprintf(stderr, "Error: glob failed on the shard pattern '%s' (code %d)\n", glob_pattern, rc);
            globfree(&g);
            fail_exit();
        }
        std::vector<std::string> out(g.gl_pathv, g.gl_pathv + g.gl_pathc);
        globfree(&g);
        return out;
    }

    // Checks header and size; returns the token count and whether a loss mask follows the tokens.
    static int64_t validate_shard(const char* path, bool* masked) {
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            fprintf(stderr, "Error: shard '%s' is not a regular file\n", path);
            fail_exit();
        }
        FILE* f = fopenCheck(path, "rb");
        int64_t size = file_size_bytes(f);
        if (size < SHARD_HEADER_BYTES) {
            fprintf(stderr, "Error: shard '%s' is %lld bytes, shorter than its %lld-byte header (truncated?)\n", path,
                    (long long)size, (long long)SHARD_HEADER_BYTES);
            fail_exit();
        }
        int32_t h[SHARD_HEADER_INTS];
        freadCheck(h, sizeof(int32_t), SHARD_HEADER_INTS, f, path);
        fcloseCheck(f);
        if (h[0] != SHARD_MAGIC) {
            fprintf(stderr, "Error: '%s' is not a Llama 3 token shard: magic %d, expected %d\n", path, h[0],
                    SHARD_MAGIC);
            fail_exit();
        }
        if (h[1] != SHARD_VERSION) {
            fprintf(stderr, "Error: shard '%s' has version %d, expected %d (Llama 3 shards are uint32, version 7)\n",
                    path, h[1], SHARD_VERSION);
            fail_exit();
        }
        if (h[3] != 0 && h[3] != 1) {
            fprintf(stderr, "Error: shard '%s' has loss-mask flag %d in header slot 3, expected 0 (none) or 1\n", path,
                    h[3]);
            fail_exit();
        }
        *masked = h[3] == 1;
        int64_t n = h[2];
        int64_t expected = SHARD_HEADER_BYTES + (*masked ? 5 : 4) * n;
        if (n < 0 || size != expected) {
            fprintf(stderr, "Error: shard '%s' is %lld bytes, but its header's %lld tokens%s make %lld bytes (%s)\n",
                    path, (long long)size, (long long)n, *masked ? " and their loss mask" : "", (long long)expected,
                    size < expected ? "truncated" : "corrupt: extra bytes or a bad count");
            fail_exit();
        }
        return n;
    }

    void close_file() {
        if (fp != nullptr) fclose(fp);
        fp = nullptr;
        open_shard = -1;
    }

    void read_tokens(int64_t shard, int64_t offset, int64_t count) {
        if (shard != open_shard) {
            close_file();
            fp = fopenCheck(files[shard].c_str(), "rb");
            open_shard = shard;
        }
        fseekCheck(fp, SHARD_HEADER_BYTES + 4 * offset, SEEK_SET);  // 64-bit: fseeko
        freadCheck(buffer.data(), sizeof(uint32_t), (size_t)count, fp, files[shard].c_str());
    }

    // The loss mask of `count` tokens from token `offset` on (the shard's file is open: read_tokens came first);
    // each byte must be 0 or 1.
    void read_mask(int64_t shard, int64_t offset, int64_t count) {
        int64_t start = SHARD_HEADER_BYTES + 4 * shard_tokens[shard] + offset;
        fseekCheck(fp, start, SEEK_SET);
        freadCheck(mask_buffer.data(), 1, (size_t)count, fp, files[shard].c_str());
        for (int64_t i = 0; i < count; i++) {
            if (mask_buffer[i] > 1) {
                fprintf(stderr, "Error: shard '%s' has loss-mask byte %u for token offset %lld (byte offset %lld); "
                                "mask bytes must be 0 or 1\n", files[shard].c_str(), mask_buffer[i],
                        (long long)(offset + i), (long long)(start + i));
                fail_exit();
            }
        }
    }

    // Makes shard_order and sample_order the permutations of the current epoch and shard.
    void update_orders() {
        int64_t num_shards = (int64_t)files.size();
        if (order_epoch != epoch) {
            if (shuffle) {
                seeded_permutation(&shard_order, num_shards, seed, epoch, 0);
            } else {
                shard_order.resize(num_shards);
                for (int64_t i = 0; i < num_shards; i++) shard_order[i] = i;
            }
            order_epoch = epoch;
            order_shard = -1;
        }
        int64_t shard = shard_order[shard_pos];
        if (shuffle && order_shard != shard) {
            seeded_permutation(&sample_order, shard_samples[shard], seed, epoch, shard + 1);
            order_shard = shard;
        }
    }

    void advance() {
        sample_pos++;
        if (sample_pos == shard_samples[shard_order[shard_pos]]) next_shard();
    }

    void next_shard() {
        sample_pos = 0;
        shard_pos++;
        if (shard_pos == (int64_t)files.size()) {
            shard_pos = 0;
            if (eval) {
                finished = true;  // the position stays at the start, ready for reset()
                return;
            }
            epoch++;
        }
        update_orders();
    }
};
