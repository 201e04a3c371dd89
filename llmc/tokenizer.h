// Decodes Llama 3 token ids back to text on the host, to print samples during training. Decoding only: encoding
// text is done in Python (dev/data/llama3_tokenizer.py) when the data is prepared.
//
// File layout (written by dev/data/export_tokenizer.py; all little-endian):
//   header: 16 int32 (64 bytes)
//     [0] magic 20261125   [1] version 1   [2] vocab size V, special tokens included (128256 for Llama 3)
//     [3] <|begin_of_text|> id   [4] <|end_of_text|> id   [5] <|eot_id|> id
//     [6] total bytes of all token strings   [7..15] zero
//   then for each id 0..V-1: uint32 length, then that many bytes
// A token's bytes are raw BPE bytes, which need not be valid UTF-8 on their own (a multi-byte character can be
// split over two tokens), or a special token's name such as "<|eot_id|>".
//
// API:
//   Tokenizer tok; tok.init(path);               // validates the file; on any problem names it and exits
//   const char* p = tok.decode(id, &len);        // the id's bytes, or nullptr when id is not in [0, V)
//   std::string s; tok.decode_append(ids, n, &s) // all ids' bytes appended; false (s untouched) on a bad id
//   SafePrinter out(stdout); out.put(p, len); ...; out.finish();  // prints sample text that cannot harm a terminal
//   tokenizer_print(tok, ids, n, stdout);        // the two above together; a bad id prints as <|bad id N|>
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "utils.h"

constexpr int TOKENIZER_MAGIC = 20261125;
constexpr int TOKENIZER_VERSION = 1;
constexpr int TOKENIZER_HEADER_INTS = 16;

struct Tokenizer {
    int vocab_size = 0;
    int bos_id = -1;  // <|begin_of_text|>
    int eos_id = -1;  // <|end_of_text|>
    int eot_id = -1;  // <|eot_id|>
    std::string bytes;              // every token's bytes, back to back
    std::vector<int64_t> offsets;   // token i is bytes[offsets[i], offsets[i + 1])

    void init(const char* path) {
        FILE* fp = fopenCheck(path, "rb");
        int64_t size = file_size_bytes(fp);
        int32_t h[TOKENIZER_HEADER_INTS];
        if (size < (int64_t)sizeof(h)) {
            fprintf(stderr, "Error: tokenizer '%s' is %lld bytes, shorter than its %zu-byte header (truncated?)\n", path,
                    (long long)size, sizeof(h));
            fail_exit();
        }
        freadCheck(h, sizeof(int32_t), TOKENIZER_HEADER_INTS, fp, "tokenizer header");
        if (h[0] != TOKENIZER_MAGIC) {
            fprintf(stderr, "Error: '%s' is not a tokenizer file from dev/data/export_tokenizer.py: magic %d, "
                            "expected %d\n", path, h[0], TOKENIZER_MAGIC);
            fail_exit();
        }
        if (h[1] != TOKENIZER_VERSION) {
            fprintf(stderr, "Error: tokenizer '%s' has version %d, this build reads version %d\n", path, h[1],
                    TOKENIZER_VERSION);
            fail_exit();
        }
        int V = h[2];
        if (V < 1 || V > (1 << 24)) {
            fprintf(stderr, "Error: tokenizer '%s' has vocab size %d, expected 1..2^24\n", path, V);
            fail_exit();
        }
        for (int slot = 3; slot <= 5; slot++) {
            if (h[slot] < 0 || h[slot] >= V) {
                fprintf(stderr, "Error: tokenizer '%s' header slot %d holds id %d, outside the vocab of %d\n", path,
                        slot, h[slot], V);
                fail_exit();
            }
        }
        // The size check catches a truncated or padded file before we trust any length field.
        int64_t expected = (int64_t)sizeof(h) + 4 * (int64_t)V + (int64_t)(uint32_t)h[6];
        if (h[6] < 0 || size != expected) {
            fprintf(stderr, "Error: tokenizer '%s' is %lld bytes, but its header (V=%d, %d string bytes) implies %lld "
                            "(truncated or corrupt)\n", path, (long long)size, V, h[6], (long long)expected);
            fail_exit();
        }
        bytes.clear();
        bytes.reserve((size_t)h[6]);
        offsets.assign(1, 0);
        offsets.reserve((size_t)V + 1);
        std::vector<char> piece;
        for (int i = 0; i < V; i++) {
            uint32_t len;
            freadCheck(&len, sizeof(len), 1, fp, "tokenizer token length");
            if ((int64_t)bytes.size() + len > (int64_t)h[6]) {
                fprintf(stderr, "Error: tokenizer '%s': token %d (%u bytes) runs past the %d string bytes the header "
                                "declares (corrupt)\n", path, i, len, h[6]);
                fail_exit();
            }
            piece.resize(len);
            if (len > 0) freadCheck(piece.data(), 1, len, fp, "tokenizer token bytes");
            bytes.append(piece.data(), len);
            offsets.push_back((int64_t)bytes.size());
        }
        fcloseCheck(fp);
        vocab_size = V;
        bos_id = h[3];
        eos_id = h[4];
        eot_id = h[5];
    }

    // The bytes of one token (not NUL-terminated) and their count, or nullptr for an id outside [0, vocab_size):
    // the caller decides how to report it.
    const char* decode(int64_t id, size_t* len) const {
        if (id < 0 || id >= vocab_size) {
            *len = 0;
            return nullptr;
        }
        *len = (size_t)(offsets[id + 1] - offsets[id]);
        return bytes.data() + offsets[id];
    }

    // Appends the bytes of ids[0..n) to *out. Returns false, leaving *out as it was, if any id is out of range;
    // *bad_index (if given) then gets the position of the first bad id.
    bool decode_append(const int* ids, size_t n, std::string* out, size_t* bad_index = nullptr) const {
        size_t start = out->size();
        for (size_t i = 0; i < n; i++) {
            size_t len;
            const char* p = decode(ids[i], &len);
            if (p == nullptr) {
                out->resize(start);
                if (bad_index) *bad_index = i;
                return false;
            }
            out->append(p, len);
        }
        return true;
    }
};

// Prints decoded bytes for a human to read. Token boundaries can fall inside a UTF-8 character, so bytes of an
// incomplete character are held until the rest arrives. Whatever is not valid UTF-8, and every control character
// except newline and tab (escape sequences, carriage returns, C1 controls), is printed as U+FFFD instead: a
// half-trained model's output must not be able to drive the terminal.
struct SafePrinter {
    FILE* out;
    unsigned char seq[4];  // the character being assembled
    int have = 0;          // bytes of it seen so far
    int need = 0;          // bytes it will have in all

    explicit SafePrinter(FILE* fp) : out(fp) {}

    void put(const char* data, size_t len) {
        for (size_t i = 0; i < len; i++) put_byte((unsigned char)data[i]);
    }

    // Ends the text: an unfinished character becomes U+FFFD.
    void finish() {
        if (have > 0) replacement();
        have = need = 0;
        fflush(out);
    }

private:
    void replacement() { fputs("\xEF\xBF\xBD", out); }

    void put_byte(unsigned char b) {
        if (have > 0) {
            // continuation bytes are 10xxxxxx; the second byte has tighter bounds for some lead bytes, which rules
            // out overlong forms, UTF-16 surrogates and code points past U+10FFFF
            unsigned char lo = 0x80, hi = 0xBF;
            if (have == 1) {
                if (seq[0] == 0xE0) lo = 0xA0;
                if (seq[0] == 0xED) hi = 0x9F;
                if (seq[0] == 0xF0) lo = 0x90;
                if (seq[0] == 0xF4) hi = 0x8F;
            }
            if (b >= lo && b <= hi) {
                seq[have++] = b;
                if (have == need) emit_sequence();
                return;
            }
            replacement();  // the character broke off; this byte starts afresh
            have = need = 0;
        }
        if (b < 0x80) {
            if (b == '\n' || b == '\t' || (b >= 0x20 && b < 0x7F)) fputc(b, out);
            else replacement();
        } else if (b >= 0xC2 && b <= 0xDF) {
            start(b, 2);
        } else if (b >= 0xE0 && b <= 0xEF) {
            start(b, 3);
        } else if (b >= 0xF0 && b <= 0xF4) {
            start(b, 4);
        } else {
            replacement();  // a stray continuation byte, or a lead byte UTF-8 never uses
        }
    }

    void start(unsigned char b, int n) {
        seq[0] = b;
        have = 1;
        need = n;
    }

    void emit_sequence() {
        // C1 controls U+0080..U+009F are C2 80..C2 9F
        if (need == 2 && seq[0] == 0xC2 && seq[1] < 0xA0) replacement();
        else fwrite(seq, 1, (size_t)need, out);
        have = need = 0;
    }
};

// Prints one token's bytes on its own (a character split across tokens shows as U+FFFD; use a SafePrinter over
// the whole sample to join them).
inline void safe_print_piece(FILE* out, const char* piece, size_t len) {
    SafePrinter p(out);
    p.put(piece, len);
    p.finish();
}

// Prints a sample: the text of ids[0..n), made safe as SafePrinter does; an out-of-range id prints as
// <|bad id N|> rather than stopping a training run over a sample.
inline void tokenizer_print(const Tokenizer& tok, const int* ids, size_t n, FILE* out) {
    SafePrinter printer(out);
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char* p = tok.decode(ids[i], &len);
        if (p == nullptr) {
            printer.finish();
            fprintf(out, "<|bad id %d|>", ids[i]);
            continue;
        }
        printer.put(p, len);
    }
    printer.finish();
}
