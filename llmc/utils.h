// Host-side helpers shared by every program: checked file I/O and allocation.
// Each failure prints what was being done, on which file, and where in the source, then exits with status 1:
// a trainer that silently continues on a short read would train on garbage.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

// Called by fail_exit before it exits, when set: a multi-GPU run stops its other ranks there (llmc/multi_gpu.cuh).
inline void (*g_fail_hook)() = nullptr;

[[noreturn]] inline void fail_exit() {
    fflush(stdout);
    if (g_fail_hook != nullptr) g_fail_hook();
    exit(EXIT_FAILURE);
}

inline FILE* fopen_check(const char* path, const char* mode, const char* file, int line) {
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
    if (fwrite(ptr, size, count, fp) != count) {
        fprintf(stderr, "Error: short write of %s: %s [%s:%d]\n", what, strerror(errno), file, line);
        fail_exit();
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
#include <sys/stat.h>
inline bool make_dirs(const std::string& path) {
    for (size_t i = 1; i <= path.size(); i++) {
        if (i < path.size() && path[i] != '/') continue;
        std::string prefix = path.substr(0, i);
        if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
    return true;
}

// Writes a file atomically: the caller writes to `tmp_path()`, then `commit()` flushes, fsyncs and renames it over
// the final path, so a crash mid-write leaves the previous file intact.
#include <unistd.h>
struct AtomicFile {
    std::string path, tmp;
    FILE* fp = nullptr;
    explicit AtomicFile(const std::string& final_path) : path(final_path), tmp(final_path + ".tmp") {
        fp = fopenCheck(tmp.c_str(), "wb");
    }
    void commit() {
        if (fflush(fp) != 0 || fsync(fileno(fp)) != 0) {
            fprintf(stderr, "Error: could not flush '%s': %s\n", tmp.c_str(), strerror(errno));
            fail_exit();
        }
        fcloseCheck(fp);
        fp = nullptr;
        if (rename(tmp.c_str(), path.c_str()) != 0) {
            fprintf(stderr, "Error: could not rename '%s' to '%s': %s\n", tmp.c_str(), path.c_str(), strerror(errno));
            fail_exit();
        }
    }
    ~AtomicFile() {
        if (fp != nullptr) {  // not committed: drop the partial file, keep the old one
            fclose(fp);
            remove(tmp.c_str());
        }
    }
};
