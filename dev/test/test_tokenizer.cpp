// Checks llmc/tokenizer.h against a tokenizer .bin from dev/data/export_tokenizer.py. Run by dev/test/test_data.py.
//
//   test_tokenizer TOKENIZER_BIN [IDS EXPECTED]
//       runs every check; with IDS (raw little-endian uint32 ids) and EXPECTED (the bytes tiktoken decodes them to)
//       also checks that decoding them gives exactly EXPECTED
//   test_tokenizer --load TOKENIZER_BIN
//       only loads the file (the bad-file tests expect a clear error and a non-zero exit)
//   test_tokenizer --print TOKENIZER_BIN ID...
//       prints the ids through tokenizer_print
// Prints one line per check and exits 1 if any failed.
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/tokenizer.h"

static int failures = 0;

static void check(bool ok, const std::string& what) {
    printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) failures++;
}

static std::string token_string(const Tokenizer& tok, int id) {
    size_t len;
    const char* p = tok.decode(id, &len);
    return p ? std::string(p, len) : std::string("<nullptr>");
}

static std::vector<char> read_all(const char* path) {
    FILE* fp = fopenCheck(path, "rb");
    std::vector<char> data((size_t)file_size_bytes(fp));
    if (!data.empty()) freadCheck(data.data(), 1, data.size(), fp, path);
    fcloseCheck(fp);
    return data;
}

// What SafePrinter makes of a sequence of pieces, captured through a temporary file.
static std::string printed(const std::vector<std::string>& pieces) {
    FILE* fp = tmpfile();
    if (fp == nullptr) {
        fprintf(stderr, "Error: tmpfile failed\n");
        fail_exit();
    }
    SafePrinter printer(fp);
    for (const std::string& piece : pieces) printer.put(piece.data(), piece.size());
    printer.finish();
    std::string out((size_t)file_size_bytes(fp), '\0');
    rewind(fp);
    if (!out.empty()) freadCheck(&out[0], 1, out.size(), fp, "printer output");
    fclose(fp);
    return out;
}

static void check_safe_printer() {
    const std::string R = "\xEF\xBF\xBD";  // U+FFFD
    check(printed({"Hello, world\n\tbye"}) == "Hello, world\n\tbye", "printable ASCII, newline and tab pass through");
    check(printed({"caf\xC3", "\xA9!"}) == "caf\xC3\xA9!", "a character split across two pieces is joined");
    check(printed({"\xF0\x9F", "\x98", "\x80"}) == "\xF0\x9F\x98\x80", "a 4-byte emoji split over three pieces");
    check(printed({"ab\xC3"}) == "ab" + R, "an unfinished character at the end becomes U+FFFD");
    check(printed({"\x1B[31mred"}) == R + "[31mred", "an escape sequence cannot reach the terminal");
    check(printed({"a\rb\x7F"}) == "a" + R + "b" + R, "carriage return and DEL are replaced");
    check(printed({"\xC2\x85x"}) == R + "x", "a C1 control (U+0085) is replaced");
    check(printed({"\xC0\xAF"}) == R + R, "an overlong encoding is rejected");
    check(printed({"\xED\xA0\x80"}) == R + R + R, "a UTF-16 surrogate is rejected");
    check(printed({"\xE2\x82x"}) == R + "x", "a broken character does not swallow the next byte");
}

static void check_specials(const Tokenizer& tok) {
    check(tok.vocab_size == 128256, "vocab size is 128256, got " + std::to_string(tok.vocab_size));
    check(tok.bos_id == 128000 && tok.eos_id == 128001 && tok.eot_id == 128009,
          "header ids: bos 128000, eos 128001, eot 128009");
    struct { int id; const char* text; } specials[] = {
        {128000, "<|begin_of_text|>"},        {128001, "<|end_of_text|>"},
        {128002, "<|reserved_special_token_0|>"}, {128005, "<|reserved_special_token_3|>"},
        {128006, "<|start_header_id|>"},      {128007, "<|end_header_id|>"},
        {128008, "<|reserved_special_token_4|>"}, {128009, "<|eot_id|>"},
        {128010, "<|reserved_special_token_5|>"}, {128255, "<|reserved_special_token_250|>"},
    };
    for (auto& s : specials) {
        std::string got = token_string(tok, s.id);
        check(got == s.text, "id " + std::to_string(s.id) + " decodes to " + s.text + " (got " + got + ")");
    }
    check(token_string(tok, 0) == "!", "id 0 decodes to '!'");
    check(token_string(tok, 9906) == "Hello" && token_string(tok, 1917) == " world", "ids 9906 1917 are 'Hello world'");
}

static void check_out_of_range(const Tokenizer& tok) {
    int bad[] = {128256, -1, INT_MAX, INT_MIN};
    for (int id : bad) {
        size_t len = 123;
        check(tok.decode(id, &len) == nullptr && len == 0, "id " + std::to_string(id) + " is rejected (nullptr)");
    }
    int ids[] = {9906, 128256, 1917};
    std::string s = "keep";
    size_t where = 0;
    bool ok = tok.decode_append(ids, 3, &s, &where);
    check(!ok && s == "keep" && where == 1, "decode_append rejects a bad id, reports its index, leaves the output");
}

static void check_against_expected(const Tokenizer& tok, const char* ids_path, const char* expected_path) {
    std::vector<char> raw = read_all(ids_path);
    std::vector<char> expected = read_all(expected_path);
    check(raw.size() % 4 == 0 && !raw.empty(), std::string("ids file holds whole uint32s: ") + ids_path);
    size_t n = raw.size() / 4;
    std::vector<int> ids(n);
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, raw.data() + 4 * i, 4);
        ids[i] = (int)v;
    }
    std::string decoded;
    size_t bad = 0;
    bool ok = tok.decode_append(ids.data(), n, &decoded, &bad);
    check(ok, "all " + std::to_string(n) + " ids are in range" + (ok ? "" : " (first bad at " + std::to_string(bad) + ")"));
    bool same = decoded.size() == expected.size() && memcmp(decoded.data(), expected.data(), decoded.size()) == 0;
    if (!same) {
        size_t i = 0;
        while (i < decoded.size() && i < expected.size() && decoded[i] == expected[i]) i++;
        printf("  first difference at byte %zu (decoded %zu bytes, expected %zu)\n", i, decoded.size(),
               expected.size());
    }
    check(same, "decoding " + std::to_string(n) + " ids gives tiktoken's " + std::to_string(expected.size()) + " bytes");
}

int main(int argc, char** argv) {
    if (argc >= 3 && strcmp(argv[1], "--load") == 0) {
        Tokenizer tok;
        tok.init(argv[2]);
        printf("loaded %s: %d tokens\n", argv[2], tok.vocab_size);
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "--print") == 0) {
        Tokenizer tok;
        tok.init(argv[2]);
        std::vector<int> ids;
        for (int i = 3; i < argc; i++) ids.push_back(atoi(argv[i]));
        tokenizer_print(tok, ids.data(), ids.size(), stdout);
        printf("\n");
        return 0;
    }
    if (argc != 2 && argc != 4) {
        fprintf(stderr, "usage: %s TOKENIZER_BIN [IDS EXPECTED] | --load TOKENIZER_BIN | --print TOKENIZER_BIN ID...\n",
                argv[0]);
        return 2;
    }
    Tokenizer tok;
    tok.init(argv[1]);
    check_safe_printer();
    check_specials(tok);
    check_out_of_range(tok);
    if (argc == 4) check_against_expected(tok, argv[2], argv[3]);
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
