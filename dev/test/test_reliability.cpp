// Command-line access to the trainer's host-side reliability helpers, for dev/test/test_reliability.py (CPU only):
// checked and atomic writes and the stdout check (llmc/utils.h), checkpoint writing (llmc/checkpoint.h), the flag
// arithmetic (llmc/flag_checks.h), the non-finite guard (llmc/nonfinite.h) and run directories (llmc/run_dir.h).
//
//   test_reliability atomic PATH NBYTES           write NBYTES bytes 'x' to PATH through AtomicFile
//   test_reliability log PATH NLINES              write NLINES lines to PATH through LogFile
//   test_reliability stdout NLINES                print NLINES lines to stdout, line-buffered as the trainer's, each
//                                                 followed by flush_stdout_check
//   test_reliability resave IN OUT [nan|inf T]    load checkpoint IN, optionally poison tensor T's first element,
//                                                 save it to OUT (fp32)
//   test_reliability batch B T G RANKS HEADS      plan_batch: "grad_accum A tokens_per_step S" or the error
//   test_reliability steps X BATCHES ACCUM START WARMUP   plan_steps: "max_steps M" or the error
//   test_reliability clip NORM MAX                clip_scale, printed with %.9g
//   test_reliability guard LIMIT LOSS:NORM ...    one line per step: "apply", "skip" or "stop"
//   test_reliability fresh DIR FORCE              check_fresh_run_dir: "ok" or the error
//   test_reliability run-steps DIR                the steps of the run named in DIR/run.txt
//   test_reliability retain DIR KEEP              remove_old_checkpoints for the run named in DIR/run.txt
// Exits 1 with the error on stderr when the helper reports one (or exits itself).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../llmc/checkpoint.h"
#include "../../llmc/flag_checks.h"
#include "../../llmc/nonfinite.h"
#include "../../llmc/run_dir.h"
#include "../../llmc/utils.h"

static int report(const std::string& err) {
    if (err.empty()) return 0;
    fprintf(stderr, "Error: %s\n", err.c_str());
    return 1;
}

static long long arg(char** argv, int i) { return strtoll(argv[i], nullptr, 10); }

int main(int argc, char** argv) {
    std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "atomic" && argc == 4) {
        std::string data((size_t)arg(argv, 3), 'x');
        AtomicFile out(argv[2]);
        fwriteCheck(data.data(), 1, data.size(), out.fp, "test data");
        out.commit();
        printf("committed %zu bytes\n", data.size());
        return 0;
    }
    if (cmd == "log" && argc == 4) {
        LogFile log;
        log.open(argv[2], false);
        for (long long i = 0; i < arg(argv, 3); i++) log.line("line %lld of a test log", i);
        log.close();
        printf("wrote %lld lines\n", arg(argv, 3));
        return 0;
    }
    if (cmd == "stdout" && argc == 3) {
        setvbuf(stdout, nullptr, _IOLBF, 0);
        for (long long i = 0; i < arg(argv, 2); i++) {
            printf("step %lld of a test run\n", i);
            flush_stdout_check();
        }
        return 0;
    }
    if (cmd == "resave" && (argc == 4 || argc == 6)) {
        Llama3Config c;
        std::vector<float> params = load_checkpoint_fp32(argv[2], &c);
        if (argc == 6) {
            ParamLayout layout = param_layout(c);
            size_t offset = 0;
            for (int t = 0; t < NUM_PARAM_TENSORS && strcmp(layout.names[t], argv[5]) != 0; t++) offset += layout.sizes[t];
            params[offset] = strcmp(argv[4], "nan") == 0 ? NAN : INFINITY;
        }
        save_checkpoint_fp32(argv[3], c, params.data(), DTYPE_FP32);
        printf("saved %s\n", argv[3]);
        return 0;
    }
    if (cmd == "batch" && argc == 7) {
        BatchPlan plan;
        std::string err = plan_batch(arg(argv, 2), arg(argv, 3), arg(argv, 4), (int)arg(argv, 5), (int)arg(argv, 6),
                                     &plan);
        if (err.empty()) printf("grad_accum %d tokens_per_step %lld\n", plan.grad_accum, (long long)plan.tokens_per_step);
        return report(err);
    }
    if (cmd == "steps" && argc == 7) {
        int max_steps = -1;
        std::string err = plan_steps(arg(argv, 2), arg(argv, 3), (int)arg(argv, 4), arg(argv, 5), arg(argv, 6),
                                     &max_steps);
        if (err.empty()) printf("max_steps %d\n", max_steps);
        return report(err);
    }
    if (cmd == "clip" && argc == 4) {
        printf("%.9g\n", clip_scale(strtof(argv[2], nullptr), strtof(argv[3], nullptr)));
        return 0;
    }
    if (cmd == "guard" && argc >= 3) {
        NonFiniteGuard guard;
        guard.limit = (int)arg(argv, 2);
        for (int i = 3; i < argc; i++) {
            const char* colon = strchr(argv[i], ':');
            float loss = strtof(argv[i], nullptr), norm = colon ? strtof(colon + 1, nullptr) : 0.0f;
            bool apply = guard.accept(loss, norm);
            printf("%s\n", guard.exhausted() ? "stop" : (apply ? "apply" : "skip"));
            if (guard.exhausted()) return 1;
        }
        return 0;
    }
    if (cmd == "fresh" && argc == 4) {
        std::string err = check_fresh_run_dir(argv[2], arg(argv, 3) != 0);
        if (err.empty()) printf("ok\n");
        return report(err);
    }
    if ((cmd == "run-steps" || cmd == "retain") && argc >= 3) {
        RunInfo run;
        std::string err = read_run_file(argv[2], &run);
        if (!err.empty()) return report(err);
        if (cmd == "retain" && argc == 4) remove_old_checkpoints(argv[2], run.id, (int)arg(argv, 3));
        std::vector<int> steps = run_state_steps(argv[2], run.id, &err);
        if (!err.empty()) return report(err);
        printf("run %016llx steps", (unsigned long long)run.id);
        for (int s : steps) printf(" %d", s);
        printf("\n");
        return 0;
    }
    fprintf(stderr, "usage: see the comment at the top of dev/test/test_reliability.cpp\n");
    return 2;
}
