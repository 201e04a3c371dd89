// Checks resharding (llmc/shard_layout.h, llmc/reshard.h) and the layer slots on the CPU. Run by
// dev/test/test_multi_gpu_cpu.py.
//
//   test_reshard ranges
//       every pair of layouts (1, 2, 3, 4, 6, 8 GPUs; ZeRO stages 0 to 3) on a small tied and untied model: every
//       element of every reader rank comes from the writer file that holds it, exactly once, in the reader's order;
//       an unchanged layout is one read of the rank's own file; a layout that cannot split the model is refused
//   test_reshard files DIR
//       writes checkpoints' state files in several layouts to DIR and reads them back in every layout through
//       plan_state_load and read_state_array (the trainer's path), then the refusals: a missing rank file, a rank
//       file of another checkpoint, another tokens per step, other master weights, another build's precision
//   test_reshard slots
//       the layer slots (SlotLayout) of stages 2 and 3's gradients and stage 3's gathered weights: each layer's slices
//       fill its slot and the embedding and final norm the rest, each once, at multiples of dim, the lm_head in the
//       embedding's place; and stage 3's path on the host: the ranks' shards as the trainer uploads them, all-gathered
//       group by group into the slots as NCCL would, give each group's weights as the flat model holds them
//   test_reshard read DIR STEP GPUS STAGE RANK OUT
//       what rank RANK of a run on GPUS GPUs with ZeRO stage STAGE reads from the checkpoint at STEP in DIR (its
//       model file gives the config): its optimizer arrays (the master weights if present, m, v) written to OUT
//       as fp32, back to back. The multi-GPU tests compare it with the state files of real runs.
// Checks print one line each; the program exits 1 if any failed.
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/reshard.h"

static int failures = 0;

static void check(bool ok, const std::string& what) {
    printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) failures++;
}

static Llama3Config small_config(bool tied) {
    Llama3Config c;
    c.vocab_size = 264; c.dim = 48; c.n_layers = 2; c.n_heads = 6; c.n_kv_heads = 2; c.ffn_hidden = 96;
    c.max_seq_len = 64; c.tied_embeddings = tied;
    return c;
}

static const int WORLDS[] = {1, 2, 3, 4, 6, 8};

// The layouts the trainer writes: stage 0 on one GPU, any stage on several.
static std::vector<StateLayout> layouts() {
    std::vector<StateLayout> out;
    for (int world : WORLDS)
        for (int stage = 0; stage <= (world > 1 ? 3 : 0); stage++) out.push_back({world, stage});
    return out;
}

static std::string layout_name(StateLayout l) {
    return std::to_string(l.world) + " GPU(s) Z" + std::to_string(l.stage);
}

// The flat indices of the elements rank `rank` holds in layout `l`, in its order.
static std::vector<size_t> held(const Llama3Config& c, StateLayout l, int rank) {
    size_t n = param_layout(c).total;
    std::vector<size_t> out;
    if (!l.sharded()) {
        for (size_t i = 0; i < n; i++) out.push_back(i);
        return out;
    }
    ShardLayout s;
    std::string why;
    make_shard_layout(c, l.world, rank, &s, &why);
    for (const ParamSlice& slice : s.slices)
        for (size_t i = 0; i < s.part(slice); i++) out.push_back(s.owned_offset(slice) + i);
    return out;
}

static void check_ranges() {
    for (bool tied : {false, true}) {
        Llama3Config c = small_config(tied);
        std::string model = tied ? " (tied)" : " (untied)";
        bool all_right = true, unchanged_whole = true, in_order = true;
        for (StateLayout writer : layouts()) {
            std::vector<std::vector<size_t>> files;  // each writer file's elements, as flat indices
            for (int w = 0; w < writer.world; w++) files.push_back(held(c, writer, w));
            for (StateLayout reader : layouts()) {
                for (int r = 0; r < reader.world; r++) {
                    std::vector<StateRange> ranges;
                    std::string err = reshard_ranges(c, writer, reader, r, &ranges);
                    std::vector<size_t> want = held(c, reader, r);
                    std::vector<size_t> got(want.size(), (size_t)-1);
                    std::vector<int> hits(want.size(), 0);
                    size_t last_end = 0;
                    for (const StateRange& range : ranges) {
                        in_order = in_order && range.dst >= last_end;
                        last_end = range.dst + range.count;
                        for (size_t i = 0; i < range.count; i++) {
                            if (range.rank < 0 || range.rank >= writer.world || range.dst + i >= got.size() ||
                                range.src + i >= files[range.rank].size()) {
                                all_right = false;
                                continue;
                            }
                            got[range.dst + i] = files[range.rank][range.src + i];
                            hits[range.dst + i]++;
                        }
                    }
                    bool once = true;
                    for (int h : hits) once = once && h == 1;
                    bool right = err.empty() && got == want && once;
                    if (!right) {
                        printf("     %s -> %s rank %d: %s\n", layout_name(writer).c_str(), layout_name(reader).c_str(),
                               r, err.empty() ? "wrong elements" : err.c_str());
                    }
                    all_right = all_right && right;
                    if (writer == reader) {
                        unchanged_whole = unchanged_whole && ranges.size() == 1 && ranges[0].rank == r &&
                                          ranges[0].src == 0 && ranges[0].dst == 0 && ranges[0].count == want.size();
                    }
                }
            }
        }
        check(all_right, "every layout pair: each reader element comes from the file that holds it, once" + model);
        check(in_order, "the reads go in the reader's element order" + model);
        check(unchanged_whole, "an unchanged layout is one read of the rank's own file, whole" + model);
    }
    Llama3Config c = small_config(false);
    std::vector<StateRange> ranges;
    std::string err = reshard_ranges(c, {5, 1}, {1, 0}, 0, &ranges);
    check(err.find("the checkpoint's layout (5 GPU(s), ZeRO stage 1)") != std::string::npos &&
              err.find("not a multiple of 5") != std::string::npos,
          "a checkpoint layout that cannot split the model: " + err);
    err = reshard_ranges(c, {2, 1}, {5, 2}, 0, &ranges);
    check(err.find("this run's layout (5 GPU(s), ZeRO stage 2)") != std::string::npos &&
              err.find("use -Z 0") != std::string::npos, "a run layout that cannot split the model: " + err);
    check(reshard_ranges(c, {2, 1}, {5, 0}, 3, &ranges).empty(), "stage 0 on 5 GPUs splits nothing: any model");
}

// ---------------------------------------------------------------------------------------------------------------
// Real files

static const uint64_t RUN_ID = 0x1234567890abcdefull;
static const int STEP = 40;
static const int64_t TOKENS_PER_STEP = 4096;

// Element i of array `array` (0 master, 1 m, 2 v) of the whole state: distinct and exact in fp32.
static float state_value(int array, size_t i) { return (float)i + 0.25f * (float)array; }

static StateHeader run_header(const Llama3Config& c, bool has_master, StateLayout l, int rank) {
    StateHeader h;
    h.step = STEP;
    h.is_bf16 = 1;
    h.has_master = has_master;
    h.world_size = l.world;
    h.zero_stage = l.stage;
    h.rank = rank;
    h.num_params = param_layout(c).total;
    h.opt_count = l.sharded() ? h.num_params / l.world : h.num_params;
    h.run_id = RUN_ID;
    h.tokens_per_step = TOKENS_PER_STEP;
    state_config_slots(c, h.config);
    return h;
}

// The state files of a checkpoint in layout `l`, as the trainer writes them: the payload is state_value, the loader
// state says sample 7, the sampler RNG is 99 in rank 0's file and another number in the others'.
static void write_checkpoint(const std::string& dir, const Llama3Config& c, bool has_master, StateLayout l) {
    for (int w = 0; w < l.world; w++) {
        int32_t h[STATE_HEADER_SLOTS];
        state_header_pack(run_header(c, has_master, l, w), h);
        AtomicFile out(state_path(dir, STEP, w));
        fwriteCheck(h, sizeof(int32_t), STATE_HEADER_SLOTS, out.fp, "state header");
        std::vector<size_t> elements = held(c, l, w);
        for (int array = has_master ? 0 : 1; array <= 2; array++) {
            std::vector<float> values;
            for (size_t i : elements) values.push_back(state_value(array, i));
            fwriteCheck(values.data(), sizeof(float), values.size(), out.fp, "state");
        }
        DataLoaderState s;
        memset(&s, 0, sizeof(s));
        s.magic = DATALOADER_STATE_MAGIC;
        s.B = 4;
        s.sample_pos = 7;
        fwriteCheck(&s, sizeof(s), 1, out.fp, "loader state");
        uint64_t rng = w == 0 ? 99 : 1000 + w;
        fwriteCheck(&rng, sizeof(rng), 1, out.fp, "rng");
        out.commit();
    }
}

static void clear_dir(const std::string& dir) {
    std::string cmd = "rm -f '" + dir + "'/state_*.bin";
    if (system(cmd.c_str()) != 0) fprintf(stderr, "could not clear %s\n", dir.c_str());
}

static bool contains(const std::string& text, const std::vector<std::string>& words) {
    for (const std::string& w : words)
        if (text.find(w) == std::string::npos) return false;
    return true;
}

static void check_files(const std::string& dir) {
    Llama3Config c = small_config(false);
    const StateLayout writers[] = {{1, 0}, {2, 0}, {2, 1}, {4, 2}, {3, 1}, {2, 3}};
    const StateLayout readers[] = {{1, 0}, {2, 0}, {2, 2}, {3, 0}, {4, 1}, {8, 1}, {6, 2}, {4, 3}};
    for (bool has_master : {true, false}) {
        for (StateLayout writer : writers) {
            clear_dir(dir);
            write_checkpoint(dir, c, has_master, writer);
            bool right = true, loader_right = true;
            for (StateLayout reader : readers) {
                for (int r = 0; r < reader.world; r++) {
                    StateSource source;
                    std::string err = plan_state_load(dir, c, run_header(c, has_master, reader, r), &source);
                    if (!err.empty()) {
                        printf("     %s\n", err.c_str());
                        right = false;
                        continue;
                    }
                    std::vector<size_t> want = held(c, reader, r);
                    std::vector<float> values(want.size());
                    for (int array = has_master ? 0 : 1; array <= 2; array++) {
                        read_state_array(source, has_master ? array : array - 1, &values);
                        for (size_t i = 0; i < want.size(); i++)
                            right = right && values[i] == state_value(array, want[i]);
                    }
                    FILE* fp = fopenCheck(source.paths[0].c_str(), "rb");
                    fseekCheck(fp, source.loader_offset(), SEEK_SET);
                    DataLoaderState s;
                    uint64_t rng = 0;
                    freadCheck(&s, sizeof(s), 1, fp, "loader state");
                    freadCheck(&rng, sizeof(rng), 1, fp, "rng");
                    fcloseCheck(fp);
                    loader_right = loader_right && s.magic == DATALOADER_STATE_MAGIC && s.sample_pos == 7 && rng == 99;
                }
            }
            std::string what = layout_name(writer) + (has_master ? ", master weights" : ", no master weights");
            check(right, "a checkpoint of " + what + " read in every layout holds the right values");
            check(loader_right, "the loader state and sampler RNG come from rank 0's file (" + what + ")");
        }
    }

    clear_dir(dir);
    write_checkpoint(dir, c, true, {2, 1});
    StateSource source;
    StateHeader one = run_header(c, true, {1, 0}, 0);
    std::string rank1 = state_path(dir, STEP, 1);
    std::string kept = dir + "/kept.bin";
    check(rename(rank1.c_str(), kept.c_str()) == 0, "set aside the rank 1 file");
    std::string err = plan_state_load(dir, c, one, &source);
    check(contains(err, {rank1, "missing", "2 GPU(s) with ZeRO stage 1", "rank 1"}), "a missing rank file: " + err);
    clear_dir(dir);
    write_checkpoint(dir, c, true, {4, 1});
    check(rename(state_path(dir, STEP, 1).c_str(), kept.c_str()) == 0, "keep a 4-GPU checkpoint's rank 1 file");
    clear_dir(dir);
    write_checkpoint(dir, c, true, {2, 1});
    check(rename(kept.c_str(), rank1.c_str()) == 0, "put it in a 2-GPU checkpoint");
    err = plan_state_load(dir, c, one, &source);
    check(contains(err, {rank1, "rank 1 of a run on 4 GPU(s)", "rank 1 of 2 GPU(s)", "not one checkpoint"}),
          "a rank file of another checkpoint: " + err);
    clear_dir(dir);
    write_checkpoint(dir, c, true, {2, 1});
    StateHeader other = one;
    other.tokens_per_step = TOKENS_PER_STEP / 2;
    err = plan_state_load(dir, c, other, &source);
    check(contains(err, {"4096 tokens per step", "this run has 2048", "-g 4096"}), "another tokens per step: " + err);
    other = one;
    other.has_master = 0;
    err = plan_state_load(dir, c, other, &source);
    check(contains(err, {"holds fp32 master weights", "-W 0", "resume with -W 1"}), "other master weights: " + err);
    other = one;
    other.is_bf16 = 0;
    err = plan_state_load(dir, c, other, &source);
    check(contains(err, {"written by the bf16 build, this is the fp32 build", "PRECISION=BF16"}),
          "another build's precision: " + err);
    Llama3Config bigger = c;
    bigger.ffn_hidden = 192;
    other = run_header(bigger, true, {1, 0}, 0);
    err = plan_state_load(dir, bigger, other, &source);
    check(contains(err, {state_path(dir, STEP, 0), "parameter count"}), "another model: " + err);
    clear_dir(dir);
}

// ---------------------------------------------------------------------------------------------------------------
// Slots

static void check_slots() {
    for (bool tied : {false, true}) {
        Llama3Config c = small_config(tied);
        c.n_layers = 3;  // slot 0 holds layers 0 and 2
        std::string model = tied ? " (tied)" : " (untied)";
        ParamLayout layout = param_layout(c);
        SlotLayout slots = make_slot_layout(c);
        ShardLayout whole;
        std::string why;
        make_shard_layout(c, 1, 0, &whole, &why);
        check(slots.size() == 2 * slots.slot_size + slots.head_size &&
                  c.n_layers * slots.slot_size + slots.head_size + layout.sizes[LM_HEAD] == layout.total,
              "two layers, the vocabulary table and the final norm" + model);
        // every element of the buffer covered once by layer l's slices and the embedding's and final norm's
        bool once = true, aligned = true, views = true;
        for (int l = 0; l < c.n_layers; l++) {
            std::vector<int> hits(slots.size(), 0);
            std::vector<int> group = whole.layer_slices[l];
            for (int i : whole.head_slices) {
                if (whole.slices[i].tensor != LM_HEAD) group.push_back(i);
            }
            for (int i : group) {
                const ParamSlice& s = whole.slices[i];
                size_t at = slots.at(s.tensor, s.layer);
                aligned = aligned && at % c.dim == 0;
                for (size_t j = 0; j < s.size && at + j < hits.size(); j++) hits[at + j]++;
                once = once && at + s.size <= slots.size();
            }
            for (size_t j = slots.slot_offset(l + 1); j < slots.slot_offset(l + 1) + slots.slot_size; j++) {
                hits[j]++;  // the other slot, whose layer is not in this group
            }
            for (int h : hits) once = once && h == 1;
            std::vector<float> storage(slots.size());
            ParamTensors<float> p = slot_tensors(storage.data(), slots, l);
            for (int t = 0; t < NUM_PARAM_TENSORS; t++) views = views && p[t] == storage.data() + slots.at(t, l);
        }
        check(once, "each layer's slices fill its slot (l % 2), the embedding and final norm the rest, once" + model);
        check(aligned, "every tensor starts at a multiple of dim elements, as in the flat buffer" + model);
        check(views, "slot_tensors points each tensor where the layout says" + model);
        check(slots.at(LM_HEAD, 0) == slots.at(TOK_EMBEDDING, 0), "the lm_head takes the embedding's place" + model);

        // Stage 3 on the host: element i of the flat model holds i; each rank's shard as upload_fp32 fills it; the
        // groups as Weights gathers them (the embedding and final norm, each layer, an untied lm_head), each as
        // all_gather_slices asks NCCL for it (rank r's part to whole + r * part).
        bool gathered_right = true;
        for (int world : {1, 2, 3, 4, 6}) {
            std::vector<ShardLayout> ranks(world);
            std::vector<std::vector<float>> shard(world);
            for (int r = 0; r < world; r++) {
                make_shard_layout(c, world, r, &ranks[r], &why);
                shard[r].resize(ranks[r].shard_size);
                for (const ParamSlice& s : ranks[r].slices)
                    for (size_t j = 0; j < ranks[r].part(s); j++)
                        shard[r][ranks[r].shard_offset(s) + j] = (float)(ranks[r].owned_offset(s) + j);
            }
            std::vector<std::vector<int>> groups(c.n_layers + 2);
            for (int i : ranks[0].head_slices) {
                groups[ranks[0].slices[i].tensor == LM_HEAD ? c.n_layers + 1 : 0].push_back(i);
            }
            for (int l = 0; l < c.n_layers; l++) groups[l + 1] = ranks[0].layer_slices[l];
            std::vector<float> buffer(slots.size(), -1.0f);
            for (const std::vector<int>& indices : groups) {
                for (int i : indices) {
                    const ParamSlice& s = ranks[0].slices[i];
                    size_t part = ranks[0].part(s), at = slots.at(s.tensor, s.layer);
                    for (int r = 0; r < world; r++) {
                        const float* src = shard[r].data() + ranks[r].shard_offset(s);
                        for (size_t j = 0; j < part; j++) buffer[at + r * part + j] = src[j];
                    }
                }
                for (int i : indices) {
                    const ParamSlice& s = ranks[0].slices[i];
                    size_t at = slots.at(s.tensor, s.layer);
                    for (size_t j = 0; j < s.size; j++) {
                        gathered_right = gathered_right && buffer[at + j] == (float)(s.offset + j);
                    }
                }
            }
        }
        check(gathered_right, "ZeRO-3's shards gathered into the slots give each group's weights" + model);
    }
}

// ---------------------------------------------------------------------------------------------------------------

static int read_command(int argc, char** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s read DIR STEP GPUS STAGE RANK OUT\n", argv[0]);
        return 2;
    }
    std::string dir = argv[2];
    int step = atoi(argv[3]);
    StateLayout reader{atoi(argv[4]), atoi(argv[5])};
    int rank = atoi(argv[6]);
    std::string model = step_path(dir, "model", step);
    FILE* fp = fopenCheck(model.c_str(), "rb");
    Llama3Config c;
    int dtype;
    read_checkpoint_header(fp, model.c_str(), &c, &dtype);
    fcloseCheck(fp);
    StateHeader expected;
    std::string err = read_state_header(state_path(dir, step, 0), &expected);
    if (!err.empty()) {
        fprintf(stderr, "Error: %s\n", err.c_str());
        return 1;
    }
    expected.world_size = reader.world;
    expected.zero_stage = reader.stage;
    expected.rank = rank;
    expected.opt_count = reader.sharded() ? expected.num_params / reader.world : expected.num_params;
    StateSource source;
    err = plan_state_load(dir, c, expected, &source);
    if (!err.empty()) {
        fprintf(stderr, "Error: %s\n", err.c_str());
        return 1;
    }
    AtomicFile out(argv[7]);
    std::vector<float> values(expected.opt_count);
    int arrays = expected.has_master ? 3 : 2;
    for (int array = 0; array < arrays; array++) {
        read_state_array(source, array, &values);
        fwriteCheck(values.data(), sizeof(float), values.size(), out.fp, "optimizer state");
    }
    out.commit();
    printf("%s -> %s rank %d: %zu reads, %d arrays of %llu elements\n", layout_name(source.writer).c_str(),
           layout_name(reader).c_str(), rank, source.ranges.size(), arrays, (unsigned long long)expected.opt_count);
    return 0;
}

int main(int argc, char** argv) {
    std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "read") return read_command(argc, argv);
    if (cmd == "ranges" && argc == 2) {
        check_ranges();
    } else if (cmd == "files" && argc == 3) {
        check_files(argv[2]);
    } else if (cmd == "slots" && argc == 2) {
        check_slots();
    } else {
        fprintf(stderr, "usage: %s ranges | files DIR | slots | read DIR STEP GPUS STAGE RANK OUT (see the file's "
                "top)\n", argv[0]);
        return 2;
    }
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
