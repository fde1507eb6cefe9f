/*
 * generate.wasm: text from a `pcp export` directory, through the wasi-nn API.
 *
 * A wasm32-wasip1 command. It reads manifest.json (block_size, vocab_size),
 * tokenizer.json (the character vocabulary) and model.onnx from the model
 * directory, hands the ONNX bytes to the host with wasi-nn `load`, and then,
 * once per generated character, `set_input` (the token window as f32),
 * `compute` and `get_output` (the logits), sampling the next character with
 * the rule of pcp_p2p/export/sampling.py, which this file mirrors exactly:
 * SplitMix64, greedy argmax at temperature <= 0, and otherwise inverse-CDF
 * sampling over exp_det weights (IEEE + - * /, floor and ldexp only, so the
 * same bits come out here as in Python). Keep the two in step.
 *
 *   generate.wasm [--model DIR] [--prompt TEXT] [--tokens N]
 *                 [--temperature T] [--seed S]
 *
 * Defaults: DIR=/model, TEXT="ROMEO:", N=200, T=0.8, S=0. Prints the prompt
 * and its continuation, then a newline, on stdout; on error one line
 * "generate.wasm: error: ..." on stderr and exit status 1.
 *
 * Built by build.sh (clang --target=wasm32-wasi with wasi-libc and lld).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- wasi-nn, the wasi_ephemeral_nn (witx) ABI ------------------------- */

typedef struct { const uint8_t *buf; uint32_t size; } nn_graph_builder;
typedef struct {
    const uint32_t *dims; uint32_t ndims; /* offset 0, 4 */
    uint8_t type;                         /* offset 8: 1 = f32 */
    const uint8_t *data; uint32_t size;   /* offset 12, 16 */
} nn_tensor;

#define NN_IMPORT(name) __attribute__((import_module("wasi_ephemeral_nn"), import_name(name)))
NN_IMPORT("load") uint32_t nn_load(const nn_graph_builder *builders, uint32_t n, uint32_t encoding,
                                   uint32_t target, uint32_t *graph);
NN_IMPORT("init_execution_context") uint32_t nn_init_execution_context(uint32_t graph, uint32_t *ctx);
NN_IMPORT("set_input") uint32_t nn_set_input(uint32_t ctx, uint32_t index, const nn_tensor *tensor);
NN_IMPORT("compute") uint32_t nn_compute(uint32_t ctx);
NN_IMPORT("get_output") uint32_t nn_get_output(uint32_t ctx, uint32_t index, uint8_t *out, uint32_t out_max,
                                               uint32_t *written);

enum { ENCODING_ONNX = 1, TARGET_CPU = 0, TENSOR_F32 = 1 };
static const char *NN_ERRNO[] = {"success", "invalid_argument", "invalid_encoding", "missing_memory", "busy",
                                 "runtime_error", "unsupported_operation", "too_large", "not_found"};

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("generate.wasm: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void nn_check(uint32_t rc, const char *call) {
    if (rc != 0)
        fail("wasi-nn %s failed: %s (errno %u)", call, rc < 9 ? NN_ERRNO[rc] : "unknown", (unsigned)rc);
}

/* ---- the sampler: keep identical to pcp_p2p/export/sampling.py ------------ */

#define LN2_HI 6.93147180369123816490e-01
#define LN2_LO 1.90821492927058770002e-10
#define INV_LN2 1.44269504088896338700e00
#define EXP_FLOOR -700.0
#define TAYLOR_DEGREE 13

static uint64_t rng_state;
static double inv_fact[TAYLOR_DEGREE + 1];

static uint64_t next_u64(void) {
    rng_state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = rng_state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double uniform(void) { return (double)(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

static double exp_det(double x) {
    if (x < EXP_FLOOR) return 0.0;
    double k = floor(x * INV_LN2 + 0.5);
    double r = (x - k * LN2_HI) - k * LN2_LO;
    double p = inv_fact[TAYLOR_DEGREE];
    for (int n = TAYLOR_DEGREE - 1; n >= 0; n--) p = p * r + inv_fact[n];
    return ldexp(p, (int)k);
}

static uint32_t sample_token(const float *row, uint32_t vocab, double temperature, double *weights) {
    for (uint32_t i = 0; i < vocab; i++)
        if (!isfinite(row[i])) fail("the model's logits are not finite (a diverged θ?)");
    double m = row[0];
    uint32_t arg = 0;
    for (uint32_t i = 1; i < vocab; i++)
        if ((double)row[i] > m) { m = row[i]; arg = i; }
    if (temperature <= 0) return arg;
    double total = 0.0;
    for (uint32_t i = 0; i < vocab; i++) {
        weights[i] = exp_det(((double)row[i] - m) / temperature);
        total += weights[i];
    }
    double target = uniform() * total, acc = 0.0;
    for (uint32_t i = 0; i < vocab; i++) {
        acc += weights[i];
        if (target < acc) return i;
    }
    for (uint32_t i = vocab; i-- > 0;)
        if (weights[i] > 0) return i;
    return arg;
}

/* ---- files, UTF-8 and a small JSON reader ------------------------------- */

static uint8_t *read_file(const char *dir, const char *name, size_t *len) {
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path) fail("path too long");
    FILE *f = fopen(path, "rb");
    if (!f) fail("cannot open %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = malloc(cap + 1);
    for (;;) {
        if (!buf) fail("out of memory reading %s", path);
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        cap *= 2;
        buf = realloc(buf, cap + 1);
    }
    if (ferror(f)) fail("cannot read %s", path);
    fclose(f);
    buf[n] = 0; /* JSON text is parsed NUL-terminated */
    *len = n;
    return buf;
}

/* One code point from UTF-8 at *s (advanced); -1 if malformed. */
static int32_t utf8_next(const uint8_t **s, const uint8_t *end) {
    const uint8_t *p = *s;
    uint32_t c = *p++, need, min;
    if (c < 0x80) { *s = p; return (int32_t)c; }
    if ((c & 0xE0) == 0xC0) { need = 1; c &= 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { need = 2; c &= 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { need = 3; c &= 0x07; min = 0x10000; }
    else return -1;
    if ((size_t)(end - p) < need) return -1;
    while (need--) {
        if ((*p & 0xC0) != 0x80) return -1;
        c = (c << 6) | (*p++ & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return -1;
    *s = p;
    return (int32_t)c;
}

/* c as UTF-8 into buf (room for 5), NUL-terminated; returns the length. */
static int utf8_encode(uint32_t c, char *buf) {
    int n;
    if (c < 0x80) { buf[0] = (char)c; n = 1; }
    else if (c < 0x800) { buf[0] = (char)(0xC0 | (c >> 6)); buf[1] = (char)(0x80 | (c & 0x3F)); n = 2; }
    else if (c < 0x10000) {
        buf[0] = (char)(0xE0 | (c >> 12)); buf[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        buf[2] = (char)(0x80 | (c & 0x3F)); n = 3;
    } else {
        buf[0] = (char)(0xF0 | (c >> 18)); buf[1] = (char)(0x80 | ((c >> 12) & 0x3F));
        buf[2] = (char)(0x80 | ((c >> 6) & 0x3F)); buf[3] = (char)(0x80 | (c & 0x3F)); n = 4;
    }
    buf[n] = 0;
    return n;
}

typedef struct { const uint8_t *p, *end, *start; const char *file; } json;

static void jfail(json *j, const char *what) { fail("%s: %s at byte %ld", j->file, what, (long)(j->p - j->start)); }
static void jws(json *j) { while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++; }
static int jpeek(json *j) { jws(j); return j->p < j->end ? *j->p : -1; }
static void jexpect(json *j, uint8_t c) { if (jpeek(j) != c) jfail(j, "unexpected character"); j->p++; }

static uint32_t jhex4(json *j) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        if (j->p >= j->end) jfail(j, "truncated \\u escape");
        uint8_t c = *j->p++;
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else jfail(j, "bad \\u escape");
    }
    return v;
}

/* A JSON string as code points (out may be NULL to skip); returns the count. */
static size_t jstring(json *j, uint32_t *out, size_t max) {
    size_t n = 0;
    jexpect(j, '"');
    for (;;) {
        if (j->p >= j->end) jfail(j, "unterminated string");
        uint32_t c = *j->p;
        if (c == '"') { j->p++; return n; }
        if (c < 0x20) jfail(j, "control character in string");
        if (c == '\\') {
            j->p++;
            if (j->p >= j->end) jfail(j, "truncated escape");
            uint8_t e = *j->p++;
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u':
                c = jhex4(j);
                if (c >= 0xD800 && c <= 0xDBFF) {
                    if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u') jfail(j, "lone surrogate");
                    j->p += 2;
                    uint32_t lo = jhex4(j);
                    if (lo < 0xDC00 || lo > 0xDFFF) jfail(j, "bad surrogate pair");
                    c = 0x10000 + ((c - 0xD800) << 10) + (lo - 0xDC00);
                } else if (c >= 0xDC00 && c <= 0xDFFF) jfail(j, "lone surrogate");
                break;
            default: jfail(j, "bad escape");
            }
        } else {
            int32_t cp = utf8_next(&j->p, j->end);
            if (cp < 0) jfail(j, "invalid UTF-8");
            c = (uint32_t)cp;
        }
        if (out) { if (n >= max) jfail(j, "string too long"); out[n] = c; }
        n++;
    }
}

static void jskip(json *j, int depth) {
    if (depth > 64) jfail(j, "nested too deep");
    int c = jpeek(j);
    if (c == '"') { jstring(j, NULL, 0); return; }
    if (c == '{' || c == '[') {
        uint8_t close = c == '{' ? '}' : ']';
        j->p++;
        if (jpeek(j) == close) { j->p++; return; }
        for (;;) {
            if (c == '{') { jstring(j, NULL, 0); jexpect(j, ':'); }
            jskip(j, depth + 1);
            if (jpeek(j) == ',') { j->p++; continue; }
            jexpect(j, close);
            return;
        }
    }
    /* number, true, false, null */
    const uint8_t *start = j->p;
    while (j->p < j->end && strchr("+-.0123456789eEtruefalsn", *j->p)) j->p++;
    if (j->p == start) jfail(j, "unexpected character");
}

/* Position j at the value of `key` in the object j is at; 0 if absent. */
static int jfind(json *j, const char *key) {
    uint32_t name[64];
    jexpect(j, '{');
    if (jpeek(j) == '}') return 0;
    for (;;) {
        json probe = *j;
        size_t n = jstring(&probe, NULL, 0);
        int match = 0;
        if (n == strlen(key) && n < 64) {
            jstring(j, name, 64);
            match = 1;
            for (size_t i = 0; i < n; i++) match &= name[i] == (uint8_t)key[i];
        } else {
            *j = probe;
        }
        jexpect(j, ':');
        if (match) { jws(j); return 1; }
        jskip(j, 1);
        if (jpeek(j) != ',') return 0;
        j->p++;
    }
}

static long jint(json *j, const char *key) {
    jws(j);
    char *endp;
    errno = 0;
    long v = strtol((const char *)j->p, &endp, 10);
    if (errno || endp == (const char *)j->p || v <= 0 || v > (1L << 24)) fail("%s: %s is not a positive int", j->file, key);
    j->p = (const uint8_t *)endp;
    return v;
}

/* ---- main ---------------------------------------------------------------- */

static uint32_t lookup(const uint32_t *vocab, uint32_t n, uint32_t c) {
    uint32_t lo = 0, hi = n; /* the vocabulary is sorted by code point */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (vocab[mid] < c) lo = mid + 1; else hi = mid;
    }
    if (lo < n && vocab[lo] == c) return lo;
    char buf[5];
    utf8_encode(c, buf);
    if (c < 0x20 || c == 0x7F) fail("character U+%04X is not in the vocabulary", (unsigned)c);
    fail("character '%s' is not in the vocabulary", buf);
    return 0;
}

int main(int argc, char **argv) {
    const char *dir = "/model", *prompt = "ROMEO:";
    long tokens = 200;
    double temperature = 0.8;
    unsigned long long seed = 0;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *endp;
        if (!v) fail("%s needs a value", a);
        errno = 0;
        if (!strcmp(a, "--model")) dir = v;
        else if (!strcmp(a, "--prompt")) prompt = v;
        else if (!strcmp(a, "--tokens")) { tokens = strtol(v, &endp, 10); if (*endp || errno || tokens < 1 || tokens > 100000) fail("--tokens must be 1..100000"); }
        else if (!strcmp(a, "--temperature")) { temperature = strtod(v, &endp); if (*endp || errno || !(temperature == temperature)) fail("bad --temperature"); }
        else if (!strcmp(a, "--seed")) { seed = strtoull(v, &endp, 10); if (*endp || errno || *v == '-') fail("--seed must be 0..2**64-1"); }
        else fail("unknown argument %s (usage: generate.wasm [--model DIR] [--prompt TEXT] [--tokens N] [--temperature T] [--seed S])", a);
    }
    double fact = 1.0;
    for (int n = 0; n <= TAYLOR_DEGREE; n++) { if (n) fact *= n; inv_fact[n] = 1.0 / fact; }
    rng_state = seed;

    size_t len;
    uint8_t *text = read_file(dir, "manifest.json", &len);
    json j = {text, text + len, text, "manifest.json"};
    if (!jfind(&j, "model")) fail("manifest.json has no model config");
    json m = j;
    if (!jfind(&m, "block_size")) fail("manifest.json has no model.block_size");
    uint32_t block = (uint32_t)jint(&m, "block_size");
    m = j;
    if (!jfind(&m, "vocab_size")) fail("manifest.json has no model.vocab_size");
    uint32_t vocab_size = (uint32_t)jint(&m, "vocab_size");
    if ((uint64_t)block * vocab_size * 4 > 0x7FFFFFFFu) fail("manifest.json: block_size x vocab_size is too large");

    text = read_file(dir, "tokenizer.json", &len);
    j = (json){text, text + len, text, "tokenizer.json"};
    json k = j;
    uint32_t kind[8];
    if (!jfind(&k, "kind") || jstring(&k, kind, 8) != 4 || kind[0] != 'c' || kind[1] != 'h' || kind[2] != 'a' || kind[3] != 'r')
        fail("tokenizer.json is not a char tokenizer");
    if (!jfind(&j, "vocab")) fail("tokenizer.json has no vocab");
    uint32_t *vocab = malloc(sizeof(uint32_t) * ((1 << 16) + 1));
    uint32_t nvocab = (uint32_t)jstring(&j, vocab, 1 << 16);
    if (nvocab != vocab_size)
        fail("the tokenizer has %u characters but the model's vocab_size is %u", (unsigned)nvocab, (unsigned)vocab_size);
    for (uint32_t i = 1; i < nvocab; i++)
        if (vocab[i - 1] >= vocab[i]) fail("tokenizer.json: the vocabulary is not sorted");

    size_t model_len;
    uint8_t *model = read_file(dir, "model.onnx", &model_len);
    nn_graph_builder builder = {model, (uint32_t)model_len};
    uint32_t graph, ctx;
    nn_check(nn_load(&builder, 1, ENCODING_ONNX, TARGET_CPU, &graph), "load");
    nn_check(nn_init_execution_context(graph, &ctx), "init_execution_context");

    size_t plen = strlen(prompt);
    uint32_t *ids = malloc(sizeof(uint32_t) * (plen + (size_t)tokens + 1));
    size_t n = 0;
    for (const uint8_t *p = (const uint8_t *)prompt, *end = p + plen; p < end;) {
        int32_t c = utf8_next(&p, end);
        if (c < 0) fail("the prompt is not valid UTF-8");
        ids[n++] = lookup(vocab, nvocab, (uint32_t)c);
    }
    if (n == 0) ids[n++] = 0; /* as pcp generate: an empty prompt starts from token 0 */

    float *window = malloc(sizeof(float) * block);
    float *logits = malloc(sizeof(float) * block * vocab_size);
    double *weights = malloc(sizeof(double) * vocab_size);
    uint32_t dims[2] = {1, block};
    uint32_t want = 4 * block * vocab_size;
    if (!ids || !window || !logits || !weights) fail("out of memory");
    for (long t = 0; t < tokens; t++) {
        size_t start = n > block ? n - block : 0, used = n - start;
        for (uint32_t i = 0; i < block; i++) window[i] = i < used ? (float)ids[start + i] : 0.0f;
        nn_tensor input = {dims, 2, TENSOR_F32, (const uint8_t *)window, 4 * block};
        nn_check(nn_set_input(ctx, 0, &input), "set_input");
        nn_check(nn_compute(ctx), "compute");
        uint32_t written = 0;
        nn_check(nn_get_output(ctx, 0, (uint8_t *)logits, want, &written), "get_output");
        if (written != want) fail("wasi-nn get_output gave %u bytes of logits, expected %u", (unsigned)written, (unsigned)want);
        ids[n++] = sample_token(logits + (used - 1) * vocab_size, vocab_size, temperature, weights);
    }
    char buf[5];
    for (size_t i = 0; i < n; i++) fwrite(buf, 1, (size_t)utf8_encode(vocab[ids[i]], buf), stdout);
    fputc('\n', stdout);
    return fflush(stdout) == 0 ? 0 : 1;
}
