// Checks llmc/dataloader.h. Run by dev/test/test_data.py, which writes the shards with dev/data/shards.py.
//
//   test_dataloader check NAME PATTERN SIZES
//       NAME: roundtrip, boundary, shuffle, resume, resize, ranks, eval or all. PATTERN matches shards whose token
//       counts, in name order, are SIZES (comma separated), and whose token i of shard s (0-based) is
//       (s+1)*1000000 + i.
//   test_dataloader bigfile DIR
//       makes a sparse shard of 2.4 GB in DIR and reads a batch from past the 2 GiB mark
//   test_dataloader run PATTERN B T RANK NPROC SHUFFLE SEED VOCAB NBATCHES [--eval] [--save-after K FILE]
//                       [--load FILE]
//       prints NBATCHES batches, one line each: "batch K shard S offset O epoch E counted C: inputs | targets" (C:
//       the targets that are not masked, -1); --eval walks
//       the eval pass to its end instead; --save-after saves the state after K batches; --load restores one first.
//       The bad-input tests run this and expect a clear error and a non-zero exit.
// Checks print one line each; the program exits 1 if any failed.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "llmc/dataloader.h"

static int failures = 0;

static void check(bool ok, const std::string& what) {
    printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) failures++;
}

static const int BIG_VOCAB = 1 << 24;

// The token the test shards hold at position i of shard s.
static int64_t token_value(int64_t shard, int64_t i) { return (shard + 1) * 1000000 + i; }

// A batch as the tests compare them: where it came from and what it holds.
struct Batch {
    int64_t shard, offset, epoch;
    std::vector<int> inputs, targets;
    bool operator==(const Batch& o) const {
        return shard == o.shard && offset == o.offset && inputs == o.inputs && targets == o.targets;
    }
};

static Batch take(DataLoader& loader) {
    int64_t epoch = loader.epoch;  // the epoch the batch belongs to (next_batch may move on to the next)
    if (!loader.next_batch()) {
        fprintf(stderr, "Error: next_batch returned false unexpectedly\n");
        fail_exit();
    }
    return Batch{loader.batch_shard, loader.batch_offset, epoch, loader.inputs, loader.targets};
}

static std::vector<Batch> take_n(DataLoader& loader, int64_t n) {
    std::vector<Batch> out;
    for (int64_t i = 0; i < n; i++) out.push_back(take(loader));
    return out;
}

// Do the batch's inputs and targets hold exactly the tokens at its shard and offset?
static bool contents_match(const Batch& b) {
    for (size_t i = 0; i < b.inputs.size(); i++) {
        if (b.inputs[i] != token_value(b.shard, b.offset + (int64_t)i)) return false;
        if (b.targets[i] != token_value(b.shard, b.offset + (int64_t)i + 1)) return false;
    }
    return true;
}

static bool all_contents_match(const std::vector<Batch>& batches) {
    for (const Batch& b : batches)
        if (!contents_match(b)) return false;
    return true;
}

static std::vector<std::pair<int64_t, int64_t>> positions(const std::vector<Batch>& batches) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const Batch& b : batches) out.push_back({b.shard, b.offset});
    return out;
}

// The (shard, offset) of every sample one epoch should visit, unshuffled order, for rank 0 of P processes.
static std::vector<std::pair<int64_t, int64_t>> epoch_positions(const std::vector<int64_t>& sizes, int B, int T,
                                                                int P) {
    std::vector<std::pair<int64_t, int64_t>> out;
    int64_t sample = (int64_t)P * B * T;
    for (size_t s = 0; s < sizes.size(); s++)
        for (int64_t j = 0; j < (sizes[s] - 1) / sample; j++) out.push_back({(int64_t)s, j * sample});
    return out;
}

static void check_roundtrip(const char* pattern, const std::vector<int64_t>& sizes) {
    DataLoader loader;
    loader.init(pattern, 2, 8, 0, 1, false, 0, BIG_VOCAB);
    check(loader.files.size() == sizes.size(), "pattern matches " + std::to_string(sizes.size()) + " shards");
    bool counts = loader.shard_tokens == sizes;
    check(counts, "the loader reads each shard's token count from its header");
    std::vector<Batch> batches = take_n(loader, loader.num_batches());
    check(all_contents_match(batches), "every token of an epoch of batches is what the Python writer wrote");
    check(positions(batches) == epoch_positions(sizes, 2, 8, 1), "batches come in shard and offset order");
    bool shapes = true;
    for (const Batch& b : batches) shapes = shapes && b.inputs.size() == 16 && b.targets.size() == 16;
    check(shapes, "inputs and targets hold B*T = 16 ids");
}

static void check_boundary(const char* pattern, const std::vector<int64_t>& sizes) {
    int B = 3, T = 5;
    DataLoader loader;
    loader.init(pattern, B, T, 0, 1, false, 0, BIG_VOCAB);
    std::vector<std::pair<int64_t, int64_t>> one = epoch_positions(sizes, B, T, 1);
    std::vector<Batch> batches = take_n(loader, 2 * (int64_t)one.size() + 1);
    std::vector<std::pair<int64_t, int64_t>> expected = one;
    expected.insert(expected.end(), one.begin(), one.end());
    expected.push_back(one[0]);
    check(positions(batches) == expected, "shard after shard, the tail of each too short for a batch skipped, "
                                          "then epoch 1 starts over at shard 0");
    check(all_contents_match(batches), "contents right on both sides of every shard boundary");
    bool epochs = batches[0].epoch == 0 && batches[one.size()].epoch == 1 && batches.back().epoch == 2;
    check(epochs, "the epoch counter moves on when the last shard is used up");
    // the last batch of shard 0 and the first of shard 1 follow each other
    size_t first_of_1 = 0;
    while (batches[first_of_1].shard == 0) first_of_1++;
    check(batches[first_of_1 - 1].offset + B * T <= sizes[0] - 1 && batches[first_of_1].offset == 0,
          "the batch after the last one that fits in shard 0 is shard 1 at offset 0");
}

static void check_shuffle(const char* pattern, const std::vector<int64_t>& sizes) {
    int B = 2, T = 4;
    DataLoader a, b, c;
    a.init(pattern, B, T, 0, 1, true, 1234, BIG_VOCAB);
    b.init(pattern, B, T, 0, 1, true, 1234, BIG_VOCAB);
    c.init(pattern, B, T, 0, 1, true, 99, BIG_VOCAB);
    int64_t n = a.num_batches();
    std::vector<Batch> ea0 = take_n(a, n), ea1 = take_n(a, n), ea2 = take_n(a, n);
    std::vector<Batch> eb0 = take_n(b, n), eb1 = take_n(b, n), eb2 = take_n(b, n);
    std::vector<Batch> ec0 = take_n(c, n);
    check(ea0 == eb0 && ea1 == eb1 && ea2 == eb2, "the same seed gives the same batches, three epochs long");
    std::vector<std::pair<int64_t, int64_t>> all = epoch_positions(sizes, B, T, 1);
    bool coverage = true;
    for (const std::vector<Batch>* e : {&ea0, &ea1, &ea2}) {
        std::vector<std::pair<int64_t, int64_t>> p = positions(*e);
        std::sort(p.begin(), p.end());
        coverage = coverage && p == all;
    }
    check(coverage, "each epoch visits every sample of every shard exactly once");
    check(positions(ea0) != all, "the order is shuffled (differs from the file order)");
    check(positions(ea0) != positions(ea1) && positions(ea1) != positions(ea2), "each epoch has a new order");
    check(positions(ec0) != positions(ea0), "another seed gives another order");
    // the shard order is shuffled too: the first shard visited is not always shard 0 over a few epochs
    std::set<int64_t> first_shards;
    DataLoader d;
    d.init(pattern, B, T, 0, 1, true, 5, BIG_VOCAB);
    for (int e = 0; e < 12; e++) first_shards.insert(take_n(d, n)[0].shard);
    check(first_shards.size() > 1, "the shard order changes between epochs");
    // within an epoch a shard's samples are visited together (one shard open at a time)
    bool grouped = true;
    std::set<int64_t> finished;
    for (size_t i = 1; i < ea0.size(); i++) {
        if (ea0[i].shard != ea0[i - 1].shard) {
            grouped = grouped && finished.count(ea0[i].shard) == 0;
            finished.insert(ea0[i - 1].shard);
        }
    }
    check(grouped, "an epoch finishes one shard before it starts the next");
    check(all_contents_match(ea0) && all_contents_match(ec0), "shuffled batches hold the right tokens");
}

static void check_resume(const char* pattern) {
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        std::string mode = shuffle ? " (shuffled)" : " (in order)";
        int B = 2, T = 4;
        DataLoader a;
        a.init(pattern, B, T, 0, 1, shuffle, 5, BIG_VOCAB);
        int64_t n = a.num_batches();
        take_n(a, n - 3);  // stop 3 batches before the end of epoch 0, so the rest runs into epoch 1
        FILE* fp = tmpfile();
        a.save_state(fp);
        DataLoaderState mem = a.state();
        std::vector<Batch> expected = take_n(a, n + 5);
        // the same settings but another seed: the state's seed must win
        DataLoader b;
        b.init(pattern, B, T, 0, 1, shuffle, 777, BIG_VOCAB);
        take_n(b, 7);  // and a loader that has already moved
        rewind(fp);
        b.load_state(fp, "tmpfile");
        fclose(fp);
        check(take_n(b, n + 5) == expected, "a state saved to a file resumes the identical batches across an epoch "
                                            "boundary" + mode);
        DataLoader c;
        c.init(pattern, B, T, 0, 1, shuffle, 5, BIG_VOCAB);
        c.restore(mem, "memory");
        check(take_n(c, n + 5) == expected, "state()/restore() resume the identical batches" + mode);
        // a state from the middle of epoch 2
        DataLoader d, e;
        d.init(pattern, B, T, 0, 1, shuffle, 11, BIG_VOCAB);
        take_n(d, 2 * n + n / 2);
        DataLoaderState mid = d.state();
        e.init(pattern, B, T, 0, 1, shuffle, 11, BIG_VOCAB);
        e.restore(mid, "memory");
        check(mid.epoch == 2 && take_n(e, n) == take_n(d, n), "resuming mid-shard in epoch 2" + mode);
        // restoring over a loader that stands at the same position with another seed replaces its permutations
        DataLoader f, g;
        f.init(pattern, B, T, 0, 1, shuffle, 5, BIG_VOCAB);
        g.init(pattern, B, T, 0, 1, shuffle, 6, BIG_VOCAB);
        take_n(f, 2);
        take_n(g, 2);
        g.restore(f.state(), "memory");
        check(take_n(g, n) == take_n(f, n), "restoring over a loader at the same position, other seed" + mode);
    }
}

// A state restored into a loader of another sample size (processes x B x T: a run resumed on another number of
// GPUs). The tests' shard 1 has 1537 tokens: 96 samples of 16 tokens, 192 of 8.
static void check_resize(const char* pattern) {
    int B = 2, T = 4, BT = B * T;
    // two processes (samples of 16 tokens), then one process with the same B: samples of 8, the same tokens in order
    DataLoader r0, r1, one;
    r0.init(pattern, B, T, 0, 2, false, 0, BIG_VOCAB);
    r1.init(pattern, B, T, 1, 2, false, 0, BIG_VOCAB);
    int64_t to_shard_1 = r0.shard_samples[0];
    take_n(r0, to_shard_1 + 10);
    take_n(r1, to_shard_1 + 10);
    DataLoaderState two = r0.state();
    one.init(pattern, B, T, 0, 1, false, 0, BIG_VOCAB);
    one.restore(two, "memory");
    bool same = true;
    for (int i = 0; i < 20; i++) {
        Batch a = take(r0), b = take(r1), c = take(one), d = take(one);
        same = same && c == a && d == b;
    }
    check(same, "2 processes -> 1 with the same B, in order: the same batches, each sample in two");
    // and back: samples of 8 -> 16; an even position continues exactly, an odd one at the next whole sample
    DataLoader back;
    back.init(pattern, B, T, 0, 2, false, 0, BIG_VOCAB);
    back.restore(one.state(), "memory");
    Batch next = take(back), expected = take(r0);
    take(r1);
    check(next == expected, "1 process -> 2 in order, at an even sample: the same tokens follow");
    take(one);
    back.restore(one.state(), "memory");
    Batch later = take(back);
    check(later.shard == 1 && later.offset == expected.offset + 2 * BT,
          "1 process -> 2 at an odd sample: on at the next sample of 16 (8 tokens skipped)");
    // the same sample size split otherwise (2 x B 2 -> 1 x B 4): the same samples, the same tokens
    DataLoader wide;
    wide.init(pattern, 2 * B, T, 0, 1, false, 0, BIG_VOCAB);
    wide.restore(r0.state(), "memory");
    Batch w = take(wide), a = take(r0), b = take(r1);
    std::vector<int> joined = a.inputs;
    joined.insert(joined.end(), b.inputs.begin(), b.inputs.end());
    check(w.shard == a.shard && w.offset == a.offset && w.inputs == joined,
          "the same sample size over fewer processes: the same samples");
    // shuffled: the same epoch and shard, the position carried over in tokens; past the shard's end, the next shard
    DataLoader s1, s2;
    s1.init(pattern, B, T, 0, 1, true, 7, BIG_VOCAB);
    int64_t first = s1.shard_order[0];
    take_n(s1, s1.shard_samples[first] - 1);
    DataLoaderState last = s1.state();  // at the last sample of the first shard
    s2.init(pattern, B, T, 0, 2, true, 7, BIG_VOCAB);
    s2.restore(last, "memory");
    check(s2.epoch == 0 && s2.shard_pos == 1 && s2.sample_pos == 0,
          "shuffled, 1 -> 2 processes at the first shard's last sample: on at the start of the next shard");
    last.sample_pos = 10;
    s2.restore(last, "memory");
    check(s2.epoch == 0 && s2.shard_pos == 0 && s2.sample_pos == 5,
          "shuffled, at sample 10 of 8 tokens: sample 5 of 16");
    check(all_contents_match(take_n(s2, 200)), "the batches after it hold the right tokens");
}

static void check_ranks(const char* pattern, const std::vector<int64_t>& sizes) {
    int B = 2, T = 4, BT = B * T;
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        std::string mode = shuffle ? " (shuffled)" : " (in order)";
        int P = 3;
        std::vector<DataLoader> loaders(P);
        for (int r = 0; r < P; r++) loaders[r].init(pattern, B, T, r, P, shuffle, 42, BIG_VOCAB);
        int64_t n = loaders[0].num_batches();
        bool same_sample = true, contents = true;
        std::vector<std::pair<int64_t, int64_t>> starts;
        std::set<std::pair<int64_t, int64_t>> tokens_seen;
        bool disjoint = true;
        for (int64_t i = 0; i < n; i++) {
            std::vector<Batch> step;
            for (int r = 0; r < P; r++) step.push_back(take(loaders[r]));
            for (int r = 0; r < P; r++) {
                same_sample = same_sample && step[r].shard == step[0].shard &&
                              step[r].offset == step[0].offset + (int64_t)r * BT;
                contents = contents && contents_match(step[r]);
                for (int j = 0; j < BT; j++)  // the input positions: targets overlap the next rank's inputs by one
                    disjoint = disjoint && tokens_seen.insert({step[r].shard, step[r].offset + j}).second;
            }
            starts.push_back({step[0].shard, step[0].offset});
        }
        check(same_sample, "3 ranks read the same sample at each step, rank r at offset r*B*T" + mode);
        check(disjoint, "the ranks' inputs never overlap over an epoch" + mode);
        check(contents, "every rank's batches hold the right tokens" + mode);
        std::sort(starts.begin(), starts.end());
        check(starts == epoch_positions(sizes, B, T, P), "together the ranks cover every sample of an epoch" + mode);
    }
}

static void check_eval(const char* pattern, const std::vector<int64_t>& sizes) {
    int B = 2, T = 8;
    DataLoader loader;
    loader.init_eval(pattern, B, T, 0, 1, BIG_VOCAB);
    std::vector<Batch> pass;
    while (loader.next_batch())
        pass.push_back(Batch{loader.batch_shard, loader.batch_offset, 0, loader.inputs, loader.targets});
    check((int64_t)pass.size() == loader.num_batches(), "the eval pass yields num_batches() = " +
                                                            std::to_string(loader.num_batches()) + " batches");
    check(positions(pass) == epoch_positions(sizes, B, T, 1), "the eval pass walks the shards in order, once");
    check(all_contents_match(pass), "eval batches hold the right tokens");
    check(loader.done() && !loader.next_batch() && loader.done(), "after the pass: done() and next_batch() false");
    loader.reset();
    check(!loader.done() && take(loader) == pass[0], "reset() starts the pass over");
    // two ranks split each eval sample, and both finish after the same number of batches
    DataLoader r0, r1;
    r0.init_eval(pattern, B, T, 0, 2, BIG_VOCAB);
    r1.init_eval(pattern, B, T, 1, 2, BIG_VOCAB);
    int64_t n0 = 0, n1 = 0;
    bool split = true;
    while (r0.next_batch()) {
        n0++;
        if (r1.next_batch()) n1++;
        split = split && r1.batch_offset == r0.batch_offset + B * T && r1.batch_shard == r0.batch_shard;
    }
    if (r1.next_batch()) n1++;
    check(n0 == n1 && n0 == r0.num_batches() && split, "two eval ranks take turns on the same samples and finish "
                                                       "together");
}

static void check_bigfile(const char* dir) {
    // A sparse file: only the header and the tokens we read are written, the rest is a hole that reads as zeros.
    std::string path = std::string(dir) + "/big_shard.bin";
    const int64_t N = 600000000;  // 2.4 GB: byte offsets past 2^31 would overflow a 32-bit long or int
    int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    if (fd < 0) {
        check(false, "create " + path);
        return;
    }
    int32_t header[SHARD_HEADER_INTS] = {SHARD_MAGIC, SHARD_VERSION, (int32_t)N};
    bool wrote = pwrite(fd, header, sizeof(header), 0) == (ssize_t)sizeof(header) &&
                 ftruncate(fd, SHARD_HEADER_BYTES + 4 * N) == 0;
    int B = 4, T = 8, BT = B * T;
    int64_t last_sample = (N - 1) / BT - 1;
    int64_t offset = last_sample * BT;
    std::vector<uint32_t> tail(BT + 1);
    for (int i = 0; i <= BT; i++) tail[i] = (uint32_t)((offset + i) % 10000000);
    wrote = wrote && pwrite(fd, tail.data(), 4 * tail.size(), SHARD_HEADER_BYTES + 4 * offset) ==
                         (ssize_t)(4 * tail.size());
    close(fd);
    check(wrote, "wrote a sparse " + std::to_string(SHARD_HEADER_BYTES + 4 * N) + "-byte shard");
    DataLoader loader;
    loader.init(path.c_str(), B, T, 0, 1, false, 0, BIG_VOCAB);
    check(loader.shard_tokens[0] == N, "its 600M-token header and size are accepted");
    Batch first = take(loader);
    check(first.offset == 0 && first.inputs[0] == 0, "the first batch reads the hole (zeros)");
    DataLoaderState s = loader.state();
    s.sample_pos = last_sample;
    loader.restore(s, "test");
    Batch last = take(loader);
    bool ok = last.offset == offset;
    for (int i = 0; i < BT; i++) ok = ok && last.inputs[i] == (int)tail[i] && last.targets[i] == (int)tail[i + 1];
    check(ok && SHARD_HEADER_BYTES + 4 * offset > (int64_t)1 << 31,
          "the last batch, at byte " + std::to_string(SHARD_HEADER_BYTES + 4 * offset) + " (> 2 GiB), reads right");
    check(loader.epoch == 1 && take(loader).offset == 0, "after it the loader wraps to the start");
    remove(path.c_str());
}

static std::vector<int64_t> parse_sizes(const char* s) {
    std::vector<int64_t> out;
    for (const char* p = s; *p;) {
        out.push_back(strtoll(p, nullptr, 10));
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    return out;
}

static void print_batch(const DataLoader& loader, int64_t k, int64_t epoch) {
    long long counted = std::count_if(loader.targets.begin(), loader.targets.end(), [](int t) { return t >= 0; });
    printf("batch %lld shard %lld offset %lld epoch %lld counted %lld:", (long long)k, (long long)loader.batch_shard,
           (long long)loader.batch_offset, (long long)epoch, counted);
    for (int x : loader.inputs) printf(" %d", x);
    printf(" |");
    for (int x : loader.targets) printf(" %d", x);
    printf("\n");
}

static int run(int argc, char** argv) {
    if (argc < 11) {
        fprintf(stderr, "usage: %s run PATTERN B T RANK NPROC SHUFFLE SEED VOCAB NBATCHES [--eval] "
                        "[--save-after K FILE] [--load FILE]\n", argv[0]);
        return 2;
    }
    const char* pattern = argv[2];
    int B = atoi(argv[3]), T = atoi(argv[4]), rank = atoi(argv[5]), nproc = atoi(argv[6]);
    bool shuffle = atoi(argv[7]) != 0;
    uint64_t seed = strtoull(argv[8], nullptr, 10);
    int vocab = atoi(argv[9]);
    int64_t nbatches = atoll(argv[10]);
    bool eval = false;
    int64_t save_after = -1;
    const char* save_path = nullptr;
    const char* load_path = nullptr;
    for (int i = 11; i < argc; i++) {
        if (strcmp(argv[i], "--eval") == 0) {
            eval = true;
        } else if (strcmp(argv[i], "--save-after") == 0 && i + 2 < argc) {
            save_after = atoll(argv[i + 1]);
            save_path = argv[i + 2];
            i += 2;
        } else if (strcmp(argv[i], "--load") == 0 && i + 1 < argc) {
            load_path = argv[++i];
        } else {
            fprintf(stderr, "unknown argument '%s'\n", argv[i]);
            return 2;
        }
    }
    DataLoader loader;
    if (eval) loader.init_eval(pattern, B, T, rank, nproc, vocab);
    else loader.init(pattern, B, T, rank, nproc, shuffle, seed, vocab);
    if (load_path) {
        FILE* fp = fopenCheck(load_path, "rb");
        loader.load_state(fp, load_path);
        fcloseCheck(fp);
    }
    int64_t k = 0;
    for (; eval || k < nbatches; k++) {
        if (k == save_after) {
            FILE* fp = fopenCheck(save_path, "wb");
            loader.save_state(fp);
            fcloseCheck(fp);
        }
        int64_t epoch = loader.epoch;
        if (!loader.next_batch()) break;
        print_batch(loader, k, epoch);
    }
    if (eval) printf("eval done after %lld batches\n", (long long)k);
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 2 && strcmp(argv[1], "run") == 0) return run(argc, argv);
    if (argc == 3 && strcmp(argv[1], "bigfile") == 0) {
        check_bigfile(argv[2]);
    } else if (argc == 5 && strcmp(argv[1], "check") == 0) {
        std::string name = argv[2];
        const char* pattern = argv[3];
        std::vector<int64_t> sizes = parse_sizes(argv[4]);
        bool all = name == "all", known = false;
        if (all || name == "roundtrip") { check_roundtrip(pattern, sizes); known = true; }
        if (all || name == "boundary") { check_boundary(pattern, sizes); known = true; }
        if (all || name == "shuffle") { check_shuffle(pattern, sizes); known = true; }
        if (all || name == "resume") { check_resume(pattern); known = true; }
        if (all || name == "ranks") { check_ranks(pattern, sizes); known = true; }
        if (all || name == "resize") { check_resize(pattern); known = true; }
        if (all || name == "eval") { check_eval(pattern, sizes); known = true; }
        if (!known) {
            fprintf(stderr, "unknown check '%s'\n", name.c_str());
            return 2;
        }
    } else {
        fprintf(stderr, "usage: %s check NAME PATTERN SIZES | bigfile DIR | run PATTERN ... (see the file's top)\n",
                argv[0]);
        return 2;
    }
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
