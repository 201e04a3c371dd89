// Host-side helpers shared by every program: checked file I/O and allocation.
// Each failure prints what was being done, on which file, and where in the source, then exits with status 1:
// a trainer that silently continues on a short read would train on garbage. Files are written through AtomicFile
// (a temporary file, renamed when complete); a failure anywhere removes the temporary files being written, so the
// previous version of each file is what stays on disk.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fault.h"

// The temporary files of the AtomicFiles being written: fail_exit() removes them.
struct PendingTemp {
    FILE* fp;
    std::string tmp;   // its path
    std::string name;  // the final file's name without the directory, for fault labels
    int writes;        // fwrite calls so far
};
inline std::vector<PendingTemp>& pending_temps() {
    static std::vector<PendingTemp> pending;
    return pending;
}
inline PendingTemp* find_pending_temp(FILE* fp) {
    for (PendingTemp& p : pending_temps())
        if (p.fp == fp) return &p;
    return nullptr;
}

// Called by fail_exit before it exits, when set: a multi-GPU run stops its other ranks there (llmc/multi_gpu.cuh).
inline void (*g_fail_hook)() = nullptr;

[[noreturn]] inline void fail_exit() {
    for (PendingTemp& p : pending_temps()) {
        fclose(p.fp);
        remove(p.tmp.c_str());
    }
    pending_temps().clear();
    fflush(stdout);
    if (g_fail_hook != nullptr) g_fail_hook();
    exit(EXIT_FAILURE);
}

inline bool is_directory(const char* path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

inline FILE* fopen_check(const char* path, const char* mode, const char* file, int line) {
    // fopen reads a directory without complaint on Linux (the first fread fails): say what is wrong instead
    if (is_directory(path)) {
        fprintf(stderr, "Error: '%s' is a directory, expected a file [%s:%d]\n", path, file, line);
        fail_exit();
    }
    FILE* fp = fopen(path, mode);
    if (fp == nullptr) {
        fprintf(stderr, "Error: could not open '%s' (mode %s): %s [%s:%d]\n", path, mode, strerror(errno), file, line);
        fail_exit();
    }
    return fp;
}
#define fopenCheck(path, mode) fopen_check(path, mode, __FILE__, __LINE__)

inline void fread_check(void* ptr, size_t size, size_t count, FILE* fp, const char* what, const char* file, int line) {
    size_t got = fread(ptr, size, count, fp);
    if (got != count) {
        fprintf(stderr, "Error: short read of %s: expected %zu elements of %zu bytes, got %zu%s [%s:%d]\n", what, count,
                size, got, feof(fp) ? " (file truncated)" : "", file, line);
        fail_exit();
    }
}
#define freadCheck(ptr, size, count, fp, what) fread_check(ptr, size, count, fp, what, __FILE__, __LINE__)

inline void fwrite_check(const void* ptr, size_t size, size_t count, FILE* fp, const char* what, const char* file,
                         int line) {
    PendingTemp* temp = find_pending_temp(fp);
    if (fwrite(ptr, size, count, fp) != count) {
        if (temp) {
            fprintf(stderr, "Error: could not write %s to '%s': %s [%s:%d]\n", what, temp->tmp.c_str(),
                    strerror(errno), file, line);
        } else {
            fprintf(stderr, "Error: could not write %s: %s [%s:%d]\n", what, strerror(errno), file, line);
        }
        fail_exit();
    }
    // test hook: die with only the header (the first write) on disk
    if (temp && ++temp->writes == 1 && fault_requested("write " + temp->name)) {
        fflush(fp);
        fault_kill_point("write " + temp->name);
    }
}
#define fwriteCheck(ptr, size, count, fp, what) fwrite_check(ptr, size, count, fp, what, __FILE__, __LINE__)

inline void fclose_check(FILE* fp, const char* file, int line) {
    if (fclose(fp) != 0) {
        fprintf(stderr, "Error: fclose failed: %s [%s:%d]\n", strerror(errno), file, line);
        fail_exit();
    }
}
#define fcloseCheck(fp) fclose_check(fp, __FILE__, __LINE__)

inline void fseek_check(FILE* fp, int64_t offset, int whence, const char* file, int line) {
    if (fseeko(fp, (off_t)offset, whence) != 0) {
        fprintf(stderr, "Error: seek to %lld failed: %s [%s:%d]\n", (long long)offset, strerror(errno), file, line);
        fail_exit();
    }
}
#define fseekCheck(fp, offset, whence) fseek_check(fp, offset, whence, __FILE__, __LINE__)

// Size of an open file in bytes (64-bit: shards and checkpoints pass 2 GiB).
inline int64_t file_size_bytes(FILE* fp) {
    off_t here = ftello(fp);
    fseeko(fp, 0, SEEK_END);
    off_t size = ftello(fp);
    fseeko(fp, here, SEEK_SET);
    return (int64_t)size;
}

inline void* malloc_check(size_t size, const char* file, int line) {
    void* ptr = malloc(size);
    if (ptr == nullptr && size > 0) {
        fprintf(stderr, "Error: malloc of %zu bytes failed [%s:%d]\n", size, file, line);
        fail_exit();
    }
    return ptr;
}
#define mallocCheck(size) malloc_check(size, __FILE__, __LINE__)

// Creates a directory and its missing parents (mkdir -p); returns false with errno set on failure.
inline bool make_dirs(const std::string& path) {
    for (size_t i = 1; i <= path.size(); i++) {
        if (i < path.size() && path[i] != '/') continue;
        std::string prefix = path.substr(0, i);
        if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
    return true;
}

// Makes `path` a directory (creating it and its parents if needed) or exits with a message naming `flag`.
inline void ensure_directory(const std::string& path, const char* flag) {
    if (!make_dirs(path)) {
        fprintf(stderr, "Error: could not create the directory '%s' (%s): %s\n", path.c_str(), flag, strerror(errno));
        fail_exit();
    }
    if (!is_directory(path.c_str())) {
        fprintf(stderr, "Error: '%s' (%s) exists and is not a directory\n", path.c_str(), flag);
        fail_exit();
    }
}

// fsync of the directory holding `path`, so that a rename into it survives a power loss.
inline bool fsync_parent_dir(const std::string& path) {
    size_t slash = path.find_last_of('/');
    std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
    int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (fd < 0) return false;
    int rc = fsync(fd);
    close(fd);
    return rc == 0;
}

// Writes a file atomically: the caller writes to `fp` (with fwriteCheck), then `commit()` flushes, fsyncs and
// renames the temporary file over the final path, and fsyncs the directory. A crash or any failure before the
// rename leaves the previous file intact; a failure removes the temporary file (here, or in fail_exit()).
struct AtomicFile {
    std::string path, tmp;
    FILE* fp = nullptr;
    explicit AtomicFile(const std::string& final_path) : path(final_path), tmp(final_path + ".tmp") {
        if (is_directory(path.c_str())) {
            fprintf(stderr, "Error: cannot write '%s': it is a directory, expected a file\n", path.c_str());
            fail_exit();
        }
        fp = fopenCheck(tmp.c_str(), "wb");
        size_t slash = path.find_last_of('/');
        pending_temps().push_back({fp, tmp, slash == std::string::npos ? path : path.substr(slash + 1), 0});
    }
    AtomicFile(const AtomicFile&) = delete;
    AtomicFile& operator=(const AtomicFile&) = delete;
    void commit() {
        if (fflush(fp) != 0 || fsync(fileno(fp)) != 0) fail(errno, "write");
        fault_kill_point("rename " + pending_name());
        forget();
        int rc = fclose(fp);
        fp = nullptr;
        if (rc != 0) fail(errno, "close");
        if (rename(tmp.c_str(), path.c_str()) != 0) fail(errno, "rename");
        if (!fsync_parent_dir(path)) {
            fprintf(stderr, "Error: could not sync the directory of '%s' after renaming it into place: %s\n",
                    path.c_str(), strerror(errno));
            fail_exit();
        }
    }
    ~AtomicFile() {
        if (fp != nullptr) {  // not committed: drop the partial file, keep the old one
            forget();
            fclose(fp);
            remove(tmp.c_str());
        }
    }

private:
    std::string pending_name() {
        PendingTemp* p = find_pending_temp(fp);
        return p ? p->name : path;
    }
    void forget() {
        std::vector<PendingTemp>& pending = pending_temps();
        for (size_t i = 0; i < pending.size(); i++) {
            if (pending[i].fp == fp) {
                pending.erase(pending.begin() + i);
                break;
            }
        }
    }
    // One message naming the file and the cause; the temporary file goes (fail_exit removes it while registered).
    [[noreturn]] void fail(int err, const char* action) {
        std::string target = strcmp(action, "rename") == 0 ? " to '" + path + "'" : "";
        fprintf(stderr, "Error: could not %s '%s'%s: %s (the previous '%s', if any, is kept)\n", action, tmp.c_str(),
                target.c_str(), strerror(err), path.c_str());
        if (fp == nullptr) remove(tmp.c_str());
        fail_exit();
    }
};

// A text log (log.txt) whose every line is written, flushed and checked: a full disk stops the run with one message
// naming the file, rather than losing lines unnoticed.
struct LogFile {
    std::string path;
    FILE* fp = nullptr;

    void open(const std::string& file_path, bool append) {
        path = file_path;
        fp = fopenCheck(path.c_str(), append ? "a" : "w");
    }
    __attribute__((format(printf, 2, 3))) void line(const char* fmt, ...) {
        if (fp == nullptr) return;
        va_list args;
        va_start(args, fmt);
        int written = vfprintf(fp, fmt, args);
        va_end(args);
        if (written < 0 || fputc('\n', fp) == EOF || fflush(fp) != 0) fail("write to");
    }
    void close() {
        if (fp == nullptr) return;
        int rc = fclose(fp);
        fp = nullptr;
        if (rc != 0) fail("close");
    }

private:
    [[noreturn]] void fail(const char* what) {
        fprintf(stderr, "Error: could not %s the log '%s': %s\n", what, path.c_str(), strerror(errno));
        fail_exit();
    }
};

// Flushes stdout (a step line must reach a redirected stdout before the next step can be killed) and checks it.
// The fflush result alone misses a full disk under line buffering: the write fails inside printf, which drops the
// line and leaves only the stream's error flag, and the fflush after it has nothing left to write. The flag stays
// set, so a write that failed anywhere since the last check is caught too.
inline void flush_stdout_check() {
    if (fflush(stdout) != 0) {
        fprintf(stderr, "Error: could not write to stdout: %s\n", strerror(errno));
        fail_exit();
    }
    if (ferror(stdout)) {
        fprintf(stderr, "Error: could not write to stdout: a write to it failed (a full disk?), lines are missing\n");
        fail_exit();
    }
}
