/*
 * kvcached chained block hashes, native: the hot path of kvcached.core.hashing.
 *
 *   h_i = BLAKE2b-128(h_{i-1} || extra || tokens_i as little-endian int64)
 *
 * for every full block i in [start, stop), h_{start-1} = parent. Results are
 * byte-identical to hashlib.blake2b(..., digest_size=16) over the same bytes
 * (kvcached.core.hashing._block_hashes_py is the reference; the tests compare).
 *
 * BLAKE2b (RFC 7693) is implemented here: unkeyed, 16-byte digest, the
 * message fed incrementally through one 128-byte block buffer, so no copy of
 * the prompt is ever made. Tokens are read straight from the list/tuple items
 * into that buffer, or compressed in place from a C-contiguous int64 buffer
 * (a numpy array). The compress function has a portable C version and, on
 * x86-64, AVX2 and AVX-512VL versions picked at import by what the CPU runs;
 * all give the same bytes (the tests run each against the reference).
 *
 * Module: kvcached._block_hash (loaded from the build cache by
 * kvcached/hashing.py with ExtensionFileLoader; PyInit__block_hash).
 *
 *   chain(parent: bytes, tokens, block_size: int, extra: bytes,
 *         start: int, stop: int) -> list[bytes]
 *   chain_memo(parent, tokens, block_size, extra, start, stop, memo)
 *       -> (hashes, records, keys)  chain() reusing the hashes of blocks the
 *                                   memo (a tree node, or {key: node}) holds
 *   memo_key(record: bytes) -> int  the memo key of one block's record
 *   set_node_api(capsule)     read kvcached._tree_node's nodes directly
 *   native_steps() -> int     walk steps that did (for tests)
 *   set_gather(on) -> bool    chain links' ids compared with AVX2 gathers or not
 *   impl() -> str             the compress in use: "avx512", "avx2", "portable"
 *   impls() -> tuple[str]     the ones this CPU runs, best first
 *   set_impl(name) -> str     switch (tests, benchmarks); returns the previous
 *
 * A block's memo record is its hash input with the token ids narrowed to
 * the narrowest little-endian form all of them fit: parent ‖ extra ‖ ids as
 * uint16 ‖ 0x02, as uint32 ‖ 0x04, or as int64 ‖ 0x08. Equal records, equal
 * hash inputs, equal hashes: a hit compares records exactly.
 *
 * Errors: OverflowError for an int outside int64, TypeError for an item that
 * is not an int (a float, a numpy scalar, None) or a buffer that is not
 * C-contiguous int64, ValueError when [start, stop) is not within the full
 * blocks of tokens. The Python wrapper clips stop and reruns the reference
 * path on TypeError, so odd items keep the reference's numpy conversion
 * semantics exactly (floats truncate, None raises numpy's TypeError).
 *
 * Build: cc -O3 -shared -fPIC -Wall -Werror -I<python include> block_hash.c
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "node_api.h"

#define DIGEST 16
#define BLOCKBYTES 128

/* ------------------------------------------------------------------ BLAKE2b */

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64_le(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
#endif
}

static inline void store64_le(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 8);
#else
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
#endif
}

/* The 32-bit pair too: GCC did not merge the byte loop into one store, and
 * the token loop spent a third of its time assembling bytes. */
static inline uint32_t load32_le(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#else
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
#endif
}

static inline uint32_t load16_le(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
#else
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
#endif
}

static inline void store16_le(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline void store32_le(uint8_t *p, uint32_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 4);
#else
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
#endif
}

#define G(r, i, a, b, c, d)                        \
    do {                                           \
        a = a + b + m[SIGMA[r][2 * (i)]];          \
        d = rotr64(d ^ a, 32);                     \
        c = c + d;                                 \
        b = rotr64(b ^ c, 24);                     \
        a = a + b + m[SIGMA[r][2 * (i) + 1]];      \
        d = rotr64(d ^ a, 16);                     \
        c = c + d;                                 \
        b = rotr64(b ^ c, 63);                     \
    } while (0)

#define ROUND(r)                                   \
    do {                                           \
        G(r, 0, v[0], v[4], v[8], v[12]);          \
        G(r, 1, v[1], v[5], v[9], v[13]);          \
        G(r, 2, v[2], v[6], v[10], v[14]);         \
        G(r, 3, v[3], v[7], v[11], v[15]);         \
        G(r, 4, v[0], v[5], v[10], v[15]);         \
        G(r, 5, v[1], v[6], v[11], v[12]);         \
        G(r, 6, v[2], v[7], v[8], v[13]);          \
        G(r, 7, v[3], v[4], v[9], v[14]);          \
    } while (0)

/* F: compress one 128-byte block into h; t = bytes hashed so far including
 * this block (messages here are far below 2^64 bytes, so t's high word is 0).
 * Three implementations with identical results; `compress` points at the
 * fastest one this CPU runs (picked at module init, see select_impl). */
typedef void (*compress_fn)(uint64_t h[8], const uint8_t block[BLOCKBYTES], uint64_t t, int last);

static void compress_portable(uint64_t h[8], const uint8_t block[BLOCKBYTES], uint64_t t,
                              int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;
    if (last) v[14] = ~v[14];
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86_SIMD 1
#include <immintrin.h>

/* Row-vectorised BLAKE2b: the 4x4 state v as four 256-bit rows a, b, c, d
 * (v0..3, v4..7, v8..11, v12..15), so one vector op runs G on all four
 * columns. Hashing is a chain, so this is about latency, not throughput:
 * a G step is 12 dependent 1-cycle ops. For the diagonal step, lane j must
 * hold the diagonal through b_j; the usual code rotates b, c and d, but b is
 * the last row a step produces, so its 3-cycle lane permute would sit on the
 * critical path. We rotate a, c and d instead (all finished earlier, so their
 * permutes overlap the tail of the step) and keep b in place. Lanes 0..3
 * then run diagonal G numbers 7, 4, 5, 6 (the one through v4..v7), and
 * DIAG_WORDS feeds their message words in that lane order. */
#define ROW_PREV _MM_SHUFFLE(2, 1, 0, 3) /* lane j <- lane j-1 (mod 4) */
#define ROW_NEXT _MM_SHUFFLE(0, 3, 2, 1) /* lane j <- lane j+1 */
#define ROW_HALF _MM_SHUFFLE(1, 0, 3, 2) /* lane j <- lane j+2 */

/* Message word indices of one half step: lanes j = 0..3 take word
 * SIGMA[r][2*g_j + k], g_j = j (columns) or 7, 4, 5, 6 (diagonals). */
#define COL_WORDS(r, k) SIGMA[r][0 + (k)], SIGMA[r][2 + (k)], SIGMA[r][4 + (k)], SIGMA[r][6 + (k)]
#define DIAG_WORDS(r, k) SIGMA[r][14 + (k)], SIGMA[r][8 + (k)], SIGMA[r][10 + (k)], SIGMA[r][12 + (k)]

/* One G half on four lanes: a += b + m; d = (d ^ a) >>> R1; c += d;
 * b = (b ^ c) >>> R2. a + m goes first, since m is ready long before b;
 * gcc would reassociate it to (b + m) + a, one more add after b on the
 * critical path (+4 cycles a round, measured 10% slower), so the empty asm
 * hides a + m from it. */
#define HALF_G(ROR, R1, R2, mv)                                        \
    do {                                                               \
        __m256i am = _mm256_add_epi64(a, mv);                          \
        __asm__("" : "+x"(am));                                        \
        a = _mm256_add_epi64(am, b);                                   \
        d = ROR(_mm256_xor_si256(d, a), R1);                           \
        c = _mm256_add_epi64(c, d);                                    \
        b = ROR(_mm256_xor_si256(b, c), R2);                           \
    } while (0)

#define STEP(ROR, x, y)                                                \
    do {                                                               \
        HALF_G(ROR, 32, 24, x);                                        \
        HALF_G(ROR, 16, 63, y);                                        \
    } while (0)

/* One round: column step, rotate a/c/d to the diagonals, diagonal step,
 * rotate back. MSG(i0, i1, i2, i3) yields message words i0..i3 as a vector;
 * WITH expands the index list before MSG sees it. */
#define WITH(f, ...) f(__VA_ARGS__)
#define SIMD_ROUND(ROR, MSG, r)                                        \
    do {                                                               \
        STEP(ROR, WITH(MSG, COL_WORDS(r, 0)), WITH(MSG, COL_WORDS(r, 1))); \
        a = _mm256_permute4x64_epi64(a, ROW_PREV);                     \
        c = _mm256_permute4x64_epi64(c, ROW_NEXT);                     \
        d = _mm256_permute4x64_epi64(d, ROW_HALF);                     \
        STEP(ROR, WITH(MSG, DIAG_WORDS(r, 0)), WITH(MSG, DIAG_WORDS(r, 1))); \
        a = _mm256_permute4x64_epi64(a, ROW_NEXT);                     \
        c = _mm256_permute4x64_epi64(c, ROW_PREV);                     \
        d = _mm256_permute4x64_epi64(d, ROW_HALF);                     \
    } while (0)

#define SIMD_ROUNDS(ROR, MSG)                                          \
    do {                                                               \
        SIMD_ROUND(ROR, MSG, 0);                                       \
        SIMD_ROUND(ROR, MSG, 1);                                       \
        SIMD_ROUND(ROR, MSG, 2);                                       \
        SIMD_ROUND(ROR, MSG, 3);                                       \
        SIMD_ROUND(ROR, MSG, 4);                                       \
        SIMD_ROUND(ROR, MSG, 5);                                       \
        SIMD_ROUND(ROR, MSG, 6);                                       \
        SIMD_ROUND(ROR, MSG, 7);                                       \
        SIMD_ROUND(ROR, MSG, 8);                                       \
        SIMD_ROUND(ROR, MSG, 9);                                       \
        SIMD_ROUND(ROR, MSG, 10);                                      \
        SIMD_ROUND(ROR, MSG, 11);                                      \
    } while (0)

/* Rows at the start of a compression: h, then IV with t and the final flag
 * folded into row d (v12 ^= t, v14 = ~v14). Shared by both SIMD paths. */
#define SIMD_INIT()                                                          \
    __m256i a = _mm256_loadu_si256((const __m256i *)h);                      \
    __m256i b = _mm256_loadu_si256((const __m256i *)(h + 4));                \
    __m256i c = _mm256_loadu_si256((const __m256i *)IV);                     \
    __m256i d = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(IV + 4)), \
                                 _mm256_setr_epi64x((long long)t, 0, last ? -1 : 0, 0))

/* h ^= v[0..7] ^ v[8..15] */
#define SIMD_FINISH()                                                                        \
    do {                                                                                     \
        _mm256_storeu_si256((__m256i *)h, _mm256_xor_si256(_mm256_loadu_si256((__m256i *)h), \
                                                           _mm256_xor_si256(a, c)));         \
        _mm256_storeu_si256((__m256i *)(h + 4),                                              \
                            _mm256_xor_si256(_mm256_loadu_si256((__m256i *)(h + 4)),         \
                                             _mm256_xor_si256(b, d)));                       \
    } while (0)

/* AVX2 has no 64-bit rotate: 32, 24 and 16 are byte moves within each word
 * (one shuffle), 63 is (x >> 63) | (x + x). */
static inline __attribute__((always_inline, target("avx2"))) __m256i ror_avx2(__m256i x, int n) {
    const __m256i r24 = _mm256_setr_epi8(3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10,
                                         3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10);
    const __m256i r16 = _mm256_setr_epi8(2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9,
                                         2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9);
    switch (n) {
    case 32: return _mm256_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1));
    case 24: return _mm256_shuffle_epi8(x, r24);
    case 16: return _mm256_shuffle_epi8(x, r16);
    default: return _mm256_or_si256(_mm256_srli_epi64(x, 63), _mm256_add_epi64(x, x)); /* 63 */
    }
}

/* AVX2 message vectors: four scalar loads per vector (indices are constants). */
#define MSG_AVX2(i0, i1, i2, i3)                                                     \
    _mm256_setr_epi64x((long long)m[i0], (long long)m[i1], (long long)m[i2], (long long)m[i3])

static __attribute__((target("avx2"))) void compress_avx2(uint64_t h[8],
                                                          const uint8_t block[BLOCKBYTES],
                                                          uint64_t t, int last) {
    uint64_t m[16];
    memcpy(m, block, sizeof m); /* x86 is little-endian */
    SIMD_INIT();
    SIMD_ROUNDS(ror_avx2, MSG_AVX2);
    SIMD_FINISH();
}

/* AVX-512VL on 256-bit registers only: a real 64-bit rotate (vprorq), and
 * message vectors from two 2-source permutes (vpermt2q over words 0..7 and
 * 8..15) and a blend. No 512-bit registers: while 512-bit ops are in flight,
 * Intel cores run vector ops on two ports instead of three (measured: the
 * one-vpermt2q-over-zmm version was 15% slower). */
#define ROR_AVX512(x, n) _mm256_ror_epi64(x, n)
#define HIGH8(i0, i1, i2, i3) \
    (__mmask8)((i0) >> 3 | ((i1) >> 3) << 1 | ((i2) >> 3) << 2 | ((i3) >> 3) << 3)
#define MSG_AVX512(i0, i1, i2, i3)                                                        \
    _mm256_mask_blend_epi64(                                                              \
        HIGH8(i0, i1, i2, i3),                                                            \
        _mm256_permutex2var_epi64(m0, _mm256_setr_epi64x((i0) & 7, (i1) & 7, (i2) & 7,   \
                                                         (i3) & 7), m1),                  \
        _mm256_permutex2var_epi64(m2, _mm256_setr_epi64x((i0) & 7, (i1) & 7, (i2) & 7,   \
                                                         (i3) & 7), m3))

static __attribute__((target("avx512f,avx512vl"))) void compress_avx512(
    uint64_t h[8], const uint8_t block[BLOCKBYTES], uint64_t t, int last) {
    const __m256i m0 = _mm256_loadu_si256((const __m256i *)block); /* words 0..3 */
    const __m256i m1 = _mm256_loadu_si256((const __m256i *)(block + 32));
    const __m256i m2 = _mm256_loadu_si256((const __m256i *)(block + 64));
    const __m256i m3 = _mm256_loadu_si256((const __m256i *)(block + 96));
    SIMD_INIT();
    SIMD_ROUNDS(ROR_AVX512, MSG_AVX512);
    SIMD_FINISH();
}
#endif /* x86-64 SIMD */

/* The compress implementations this build has, best first; entry 0 of the
 * ones the CPU supports is used unless set_impl picks another. */
typedef struct {
    const char *name;
    compress_fn fn;
    int (*supported)(void);
} impl_entry;

static int always(void) { return 1; }
#ifdef HAVE_X86_SIMD
/* __builtin_cpu_supports also checks that the OS saves the wider registers. */
static int has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}
static int has_avx2(void) { return __builtin_cpu_supports("avx2"); }
#endif

static const impl_entry IMPLS[] = {
#ifdef HAVE_X86_SIMD
    {"avx512", compress_avx512, has_avx512},
    {"avx2", compress_avx2, has_avx2},
#endif
    {"portable", compress_portable, always},
};
#define N_IMPLS ((int)(sizeof IMPLS / sizeof IMPLS[0]))

static const impl_entry *current_impl = &IMPLS[N_IMPLS - 1]; /* portable until init */
static compress_fn compress = compress_portable;

typedef struct {
    uint64_t h[8];
    uint64_t t;    /* bytes compressed so far */
    size_t len;    /* bytes waiting in buf, 0..128 */
    uint8_t buf[BLOCKBYTES];
} b2b_state;

static inline void b2b_init(b2b_state *s) {
    memcpy(s->h, IV, sizeof s->h);
    /* parameter block: digest length 16, key length 0, fanout 1, depth 1 */
    s->h[0] ^= 0x01010000ULL ^ DIGEST;
    s->t = 0;
    s->len = 0;
}

static inline void b2b_compress(b2b_state *s, const uint8_t *block) {
    s->t += BLOCKBYTES;
    compress(s->h, block, s->t, 0);
}

/* Copies of less than a block into buf, 8 bytes at a time: gcc would inline a
 * variable-length memcpy here as `rep movs`, whose start-up costs more than
 * the copy itself. */
static inline void copy_small(uint8_t *dst, const uint8_t *src, size_t n) {
    for (; n >= 8; n -= 8, dst += 8, src += 8) memcpy(dst, src, 8);
    for (; n > 0; n--) *dst++ = *src++;
}

/* A block is compressed only once more input follows it: the last block must
 * go through b2b_final with the final flag, even when it is full. Full blocks
 * in the input are compressed in place, without a copy into buf. */
static inline void b2b_update(b2b_state *s, const uint8_t *in, size_t n) {
    size_t fill = BLOCKBYTES - s->len;
    if (n > fill) {
        copy_small(s->buf + s->len, in, fill);
        b2b_compress(s, s->buf);
        s->len = 0;
        in += fill;
        n -= fill;
        for (; n > BLOCKBYTES; in += BLOCKBYTES, n -= BLOCKBYTES) b2b_compress(s, in);
    }
    copy_small(s->buf + s->len, in, n);
    s->len += n;
}

/* Room in buf for whole 8-byte tokens, compressing a full buffer first
 * (callers have more input to follow it); 0 when the next token straddles
 * two blocks, which happens only when the prefix is not a multiple of 8 bytes. */
static inline size_t b2b_token_room(b2b_state *s) {
    if (s->len == BLOCKBYTES) {
        b2b_compress(s, s->buf);
        s->len = 0;
    }
    return (BLOCKBYTES - s->len) / 8;
}

static inline void b2b_final(b2b_state *s, uint8_t out[DIGEST]) {
    s->t += s->len;
    memset(s->buf + s->len, 0, BLOCKBYTES - s->len);
    compress(s->h, s->buf, s->t, 1);
    store64_le(out, s->h[0]);
    store64_le(out + 8, s->h[1]);
}

/* ---------------------------------------------------------------- tokens */

/* Fast read of an int that fits in two digits (every realistic token id):
 * 1 if *out was set, 0 to take the general path. */
static inline __attribute__((always_inline)) int small_long(PyObject *o, int64_t *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 1;
    }
    return 0;
#else
    const digit *d = ((PyLongObject *)o)->ob_digit;
    Py_ssize_t size = Py_SIZE(o);
    if (size == 1) { /* most tokens: 0 < id < 2^30; no jump table on this path */
        *out = (int64_t)d[0];
        return 1;
    }
    switch (size) {
    case 0: *out = 0; return 1;
    case -1: *out = -(int64_t)d[0]; return 1;
    case 2: *out = (int64_t)d[0] | (int64_t)d[1] << PyLong_SHIFT; return 1;
    case -2: *out = -((int64_t)d[0] | (int64_t)d[1] << PyLong_SHIFT); return 1;
    default: return 0;
    }
#endif
}

/* Token i of a list/tuple as int64, general case; -1 with an exception set.
 * A big int is range-checked (OverflowError outside int64, as numpy raises);
 * anything that is not an int is a TypeError. No Python code runs here, so
 * the sequence cannot change under the loop; the size check is belt and braces. */
static int token_slow(PyObject *seq, int is_list, Py_ssize_t i, int64_t *out) {
    Py_ssize_t size = is_list ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
    if (i >= size) {
        PyErr_SetString(PyExc_RuntimeError, "token list changed size while being hashed");
        return -1;
    }
    PyObject *item = is_list ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "token %zd is a %.100s, not an int", i,
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow) {
        PyErr_Format(PyExc_OverflowError,
                     "Python int too large to convert to C long (token %zd is outside int64)", i);
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* Tokens [lo, hi) of a list/tuple into the hash, read straight from the
 * item array into the block buffer (the position is a local: keeping it in
 * s->len made every token wait on a store-to-load round trip). No Python
 * code runs while hashing, so the sequence cannot change under the loop
 * (the size check is belt and braces). Exact small ints take the inline
 * path; the rest (bools, big ints, errors) go through token_slow, which
 * re-reads item i itself. -1 with an exception set. */
static int update_from_items(b2b_state *s, PyObject *seq, int is_list, Py_ssize_t lo,
                             Py_ssize_t hi) {
    if (hi > Py_SIZE(seq)) {
        PyErr_SetString(PyExc_RuntimeError, "token list changed size while being hashed");
        return -1;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = lo; i < hi;) {
        size_t n = b2b_token_room(s);
        if (n > (size_t)(hi - i)) n = (size_t)(hi - i);
        if (n == 0) n = 1; /* a straddling token goes through b2b_update */
        uint8_t straddling[8];
        uint8_t *out = s->len <= BLOCKBYTES - 8 ? s->buf + s->len : straddling;
        for (size_t k = 0; k < n; k++, i++) {
            PyObject *item = items[i];
            int64_t v;
            if (!(Py_IS_TYPE(item, &PyLong_Type) && small_long(item, &v)) &&
                token_slow(seq, is_list, i, &v) < 0)
                return -1;
            store64_le(out + 8 * k, (uint64_t)v);
        }
        if (out == straddling) {
            b2b_update(s, straddling, 8);
        } else {
            s->len += 8 * n;
        }
    }
    return 0;
}

/* Tokens [lo, hi) of a C-contiguous int64 array into the hash. */
static void update_from_array(b2b_state *s, const int64_t *arr, Py_ssize_t lo, Py_ssize_t hi) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    b2b_update(s, (const uint8_t *)(arr + lo), (size_t)(hi - lo) * 8);
#else
    for (Py_ssize_t i = lo; i < hi; i++) {
        uint8_t bytes[8];
        store64_le(bytes, (uint64_t)arr[i]);
        b2b_update(s, bytes, 8);
    }
#endif
}

static PyObject *chain_impl(const uint8_t *parent, Py_ssize_t parent_len, PyObject *seq,
                            const int64_t *arr, Py_ssize_t block_size, const uint8_t *extra,
                            Py_ssize_t extra_len, Py_ssize_t start, Py_ssize_t stop) {
    int is_list = seq != NULL && PyList_Check(seq);
    PyObject *out = PyList_New(stop - start);
    if (out == NULL) return NULL;
    uint8_t digest[DIGEST];
    b2b_state s;
    for (Py_ssize_t b = start; b < stop; b++) {
        b2b_init(&s);
        if (b == start) {
            b2b_update(&s, parent, (size_t)parent_len);
        } else {
            b2b_update(&s, digest, DIGEST);
        }
        b2b_update(&s, extra, (size_t)extra_len);
        Py_ssize_t lo = b * block_size, hi = lo + block_size;
        if (arr != NULL) {
            update_from_array(&s, arr, lo, hi);
        } else if (update_from_items(&s, seq, is_list, lo, hi) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        b2b_final(&s, digest);
        PyObject *h = PyBytes_FromStringAndSize((const char *)digest, DIGEST);
        if (h == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b - start, h);
    }
    return out;
}

/* ---------------------------------------------------------- hash memo */

/* A prompt's blocks are mostly blocks the tree already holds, and a cached
 * node remembers the exact bytes it was hashed from (its "input":
 * h_{i-1} || extra || tokens_i). chain_memo finds a candidate node for each
 * block's input and, when the node's input is byte-for-byte the same, takes
 * the node's hash instead of running BLAKE2b: equal inputs have equal hashes,
 * so the result is exactly chain()'s. The candidate comes from walking the
 * tree (memo: the node the chain starts under; each block asks the previous
 * block's node for its child under the block's key, node.memo_child(key),
 * and the first miss leaves the tree for good), or from a flat dict
 * {key: node}. The key is a fast 61-bit mix of the input; it only picks the
 * candidate (a collision, accidental or crafted, is a miss and costs one
 * BLAKE2b). Keys live in this process only. */

static PyObject *str_input, *str_hash, *str_memo_child; /* interned names */

static inline uint64_t memo_mix(uint64_t a, uint64_t w) {
    a = (a ^ w) * 0x9E3779B97F4A7C15ULL;
    return a ^ (a >> 29);
}

static inline uint64_t fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    return k ^ (k >> 33);
}

/* Four independent lanes: the multiplies overlap instead of chaining. */
static uint64_t memo_key_of(const uint8_t *p, size_t n) {
    uint64_t a = 0x243F6A8885A308D3ULL, b = 0x13198A2E03707344ULL;
    uint64_t c = 0xA4093822299F31D0ULL, d = 0x082EFA98EC4E6C89ULL;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, 32);
        a = memo_mix(a, w[0]);
        b = memo_mix(b, w[1]);
        c = memo_mix(c, w[2]);
        d = memo_mix(d, w[3]);
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        a = memo_mix(a, w);
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, n - i);
        b = memo_mix(b, w);
    }
    uint64_t k = a ^ rotr64(b, 17) ^ rotr64(c, 31) ^ rotr64(d, 47) ^ (uint64_t)n;
    return fmix64(k) & ((1ULL << 61) - 1); /* a small int: Python hashes it as itself */
}

/* Tokens [lo, hi) as little-endian int64 into out. -1 with an exception set. */
static int tokens_to_bytes(uint8_t *out, PyObject *seq, int is_list, const int64_t *arr,
                           Py_ssize_t lo, Py_ssize_t hi) {
    if (arr != NULL) {
        for (Py_ssize_t i = lo; i < hi; i++) store64_le(out + 8 * (i - lo), (uint64_t)arr[i]);
        return 0;
    }
    if (hi > Py_SIZE(seq)) {
        PyErr_SetString(PyExc_RuntimeError, "token list changed size while being hashed");
        return -1;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = lo; i < hi; i++) {
        int64_t v;
        if (!(Py_IS_TYPE(items[i], &PyLong_Type) && small_long(items[i], &v)) &&
            token_slow(seq, is_list, i, &v) < 0)
            return -1;
        store64_le(out + 8 * (i - lo), (uint64_t)v);
    }
    return 0;
}

/* A block's tokens [lo, hi) as its memo record's token part, at out: as
 * little-endian uint16 when every id fits (vocabularies up to 64K), else
 * uint32 when every id fits (every real vocabulary), else int64 (the hash
 * input's own form), then one byte saying which (2, 4 or 8). The form is a
 * function of the ids, so equal blocks have equal records. Returns the bytes
 * written, -1 with an exception set. Remembered inputs are most of the
 * memo's memory, and reading them a good part of a hit's cost. */
static Py_ssize_t tokens_to_record(uint8_t *out, PyObject *seq, int is_list, const int64_t *arr,
                                   Py_ssize_t lo, Py_ssize_t hi) {
    Py_ssize_t n = hi - lo;
    uint64_t wide = 0; /* any id outside [0, 2^32) sets a high bit */
    if (arr != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v = (uint64_t)arr[lo + i];
            wide |= v;
            store32_le(out + 4 * i, (uint32_t)v);
        }
    } else {
        if (hi > Py_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "token list changed size while being hashed");
            return -1;
        }
        PyObject *const *items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t v;
            if (!(Py_IS_TYPE(items[lo + i], &PyLong_Type) && small_long(items[lo + i], &v)) &&
                token_slow(seq, is_list, lo + i, &v) < 0)
                return -1;
            wide |= (uint64_t)v;
            store32_le(out + 4 * i, (uint32_t)v);
        }
    }
    if (wide >> 32) { /* rare: keep the int64 form */
        if (tokens_to_bytes(out, seq, is_list, arr, lo, hi) < 0) return -1;
        out[8 * n] = 8;
        return 8 * n + 1;
    }
    if (wide >> 16) {
        out[4 * n] = 4;
        return 4 * n + 1;
    }
    /* narrow in place: entry i moves from 4i to 2i, never over one not yet read */
    for (Py_ssize_t i = 0; i < n; i++) store16_le(out + 2 * i, load32_le(out + 4 * i));
    out[2 * n] = 2;
    return 2 * n + 1;
}

/* n tokens of a record's token part `tok` (tokens_to_record's output, ids
 * `width` bytes wide) as the hash input's int64s, at out. */
static void record_tokens_to_input(uint8_t *out, const uint8_t *tok, Py_ssize_t n, int width) {
    if (width == 2) {
        for (Py_ssize_t i = 0; i < n; i++) store64_le(out + 8 * i, load16_le(tok + 2 * i));
    } else if (width == 4) {
        for (Py_ssize_t i = 0; i < n; i++) store64_le(out + 8 * i, load32_le(tok + 4 * i));
    } else {
        memcpy(out, tok, (size_t)(8 * n));
    }
}

static const kvc_node_api *node_api; /* NULL until set_node_api */
static unsigned long long native_steps; /* walk steps that read a node through node_api */

static inline int is_native_node(PyObject *o) {
    return node_api != NULL && Py_IS_TYPE(o, node_api->type);
}

/* A native node's fields, read in place (borrowed; NULL where unset). */
static inline PyObject *node_only_child(PyObject *n) {
    PyObject *c = ((kvc_node_head *)n)->children;
    return c != NULL && Py_IS_TYPE(c, node_api->type) ? c : NULL;
}
static inline PyObject *node_input(PyObject *n) { return ((kvc_node_head *)n)->input; }
static inline PyObject *node_hash(PyObject *n) { return ((kvc_node_head *)n)->hash; }
static inline PyObject *node_mkey(PyObject *n) { return ((kvc_node_head *)n)->mkey; }

/* The memo key of a block input (parent hash ‖ extra ‖ tokens): of what
 * follows the parent hash. The walk already stands on the parent, so the
 * block's own bytes pick the child, and a block's key comes from its own
 * record whenever the walk needs it (lazy_key). */
static uint64_t input_key(const uint8_t *in, size_t n) {
    return n >= DIGEST ? memo_key_of(in + DIGEST, n - DIGEST) : memo_key_of(in, n);
}

/* A block's memo key, computed when first needed: a chain link of the tree
 * (a node with one child) is checked against its only child's record
 * without it, and most hits are chain links. */
typedef struct {
    const uint8_t *rec;
    Py_ssize_t len;
    uint64_t key;
    int known;
} lazy_key;

static uint64_t key_of(lazy_key *k) {
    if (!k->known) {
        k->key = memo_key_of(k->rec, (size_t)k->len);
        k->known = 1;
    }
    return k->key;
}

/* The candidate node for the block (a new reference, or NULL: none, or an
 * error): from a flat dict memo, or a child of the walk position `pos` (a
 * tree node; NULL once the walk left the tree): the only child, or the one
 * under the block's key. *key_obj is the key as an int, made here when a
 * Python lookup needs it. */
static PyObject *memo_candidate(PyObject *memo, PyObject *pos, lazy_key *key,
                                PyObject **key_obj) {
    if (pos != NULL && is_native_node(pos)) {
        int err; /* on an error (a branching node's index) the exception is set */
        native_steps++;
        PyObject *only = node_only_child(pos);
        return Py_XNewRef(only != NULL ? only : node_api->memo_child(pos, key_of(key), &err));
    }
    if (!PyDict_Check(memo) && pos == NULL)
        return NULL;
    if (*key_obj == NULL && (*key_obj = PyLong_FromUnsignedLongLong(key_of(key))) == NULL)
        return NULL;
    if (PyDict_Check(memo))
        return Py_XNewRef(PyDict_GetItemWithError(memo, *key_obj));
    PyObject *node = PyObject_CallMethodOneArg(pos, str_memo_child, *key_obj);
    if (node == Py_None)
        Py_CLEAR(node);
    return node;
}

/* A node's input, hash and memo key as new references (NULL where absent). */
static void node_fields(PyObject *node, PyObject **input, PyObject **hash, PyObject **mkey) {
    if (is_native_node(node)) {
        *input = Py_XNewRef(node_input(node));
        *hash = Py_XNewRef(node_hash(node));
        *mkey = Py_XNewRef(node_mkey(node));
        return;
    }
    *input = PyObject_GetAttr(node, str_input);
    *hash = *input == NULL ? NULL : PyObject_GetAttr(node, str_hash);
    *mkey = NULL; /* a Python node's key is not trusted to be the int: make our own */
}

/* Whether `in` is the bytes prev[0:prev_len] ‖ rec[0:rec_len]. */
static int same_input(PyObject *in, const uint8_t *prev, Py_ssize_t prev_len,
                      const uint8_t *rec, Py_ssize_t rec_len) {
    if (in == NULL || !PyBytes_Check(in) || PyBytes_GET_SIZE(in) != prev_len + rec_len)
        return 0;
    const char *p = PyBytes_AS_STRING(in);
    return memcmp(p, prev, (size_t)prev_len) == 0 &&
           memcmp(p + prev_len, rec, (size_t)rec_len) == 0;
}

/* Block i's hash, input and key from the memo: 1 and the three appended at i
 * (new references taken), 0 on a miss, -1 on an error. On a hit in tree
 * mode, *pos moves to the node (the next block is one of its children). */
static int memo_hit(PyObject *memo, PyObject **pos, lazy_key *key, const uint8_t *prev,
                    Py_ssize_t prev_len, const uint8_t *rec, Py_ssize_t rec_len,
                    PyObject *out[3], Py_ssize_t i) {
    PyObject *key_obj = NULL, *in = NULL, *h = NULL, *mkey = NULL;
    PyObject *node = memo_candidate(memo, *pos, key, &key_obj);
    int found = 0;
    if (node != NULL) {
        node_fields(node, &in, &h, &mkey);
        /* The record decides: equal records, equal inputs, equal hashes. */
        found = same_input(in, prev, prev_len, rec, rec_len) && h != NULL &&
                PyBytes_Check(h) && PyBytes_GET_SIZE(h) == DIGEST;
    }
    if (found && (mkey == NULL || !PyLong_CheckExact(mkey))) { /* a node without a key */
        Py_XSETREF(mkey, key_obj != NULL ? Py_NewRef(key_obj)
                                         : PyLong_FromUnsignedLongLong(key_of(key)));
        found = mkey != NULL;
    }
    Py_XDECREF(key_obj);
    if (found) {
        PyList_SET_ITEM(out[0], i, h);
        PyList_SET_ITEM(out[1], i, in);
        PyList_SET_ITEM(out[2], i, mkey);
        if (*pos != NULL)
            Py_SETREF(*pos, node);
        else
            Py_DECREF(node);
        return 1;
    }
    Py_XDECREF(in);
    Py_XDECREF(h);
    Py_XDECREF(mkey);
    Py_XDECREF(node);
    return PyErr_Occurred() ? -1 : 0;
}

/* Block i hashed: its record (prev ‖ rec, as the memo remembers it), BLAKE2b
 * of its hash input (prev ‖ extra ‖ tokens as int64; `wide` is scratch for
 * the tokens) and its key. */
static int hash_block(uint64_t key, const uint8_t *prev, Py_ssize_t prev_len, const uint8_t *rec,
                      Py_ssize_t rec_len, Py_ssize_t extra_len, Py_ssize_t block_size,
                      uint8_t *wide, PyObject *out[3], Py_ssize_t i) {
    PyObject *in = PyBytes_FromStringAndSize(NULL, prev_len + rec_len);
    if (in == NULL) return -1;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(in);
    memcpy(p, prev, (size_t)prev_len);
    memcpy(p + prev_len, rec, (size_t)rec_len);
    record_tokens_to_input(wide, rec + extra_len, block_size, rec[rec_len - 1]);
    uint8_t digest[DIGEST];
    b2b_state s;
    b2b_init(&s);
    b2b_update(&s, p, (size_t)(prev_len + extra_len));
    b2b_update(&s, wide, (size_t)(8 * block_size));
    b2b_final(&s, digest);
    PyObject *h = PyBytes_FromStringAndSize((const char *)digest, DIGEST);
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    if (h == NULL || k == NULL) {
        Py_DECREF(in);
        Py_XDECREF(h);
        Py_XDECREF(k);
        return -1;
    }
    PyList_SET_ITEM(out[0], i, h);
    PyList_SET_ITEM(out[1], i, in);
    PyList_SET_ITEM(out[2], i, k);
    return 0;
}

/* chain_memo's working memory (a block's record and the scratch input; the
 * size depends on block_size), kept between calls rather than allocated per
 * call. The GIL is held throughout, so one buffer serves every thread; a
 * nested call (none is known) gets its own. */
static uint8_t *scratch;
static size_t scratch_cap;
static int scratch_busy;

static uint8_t *scratch_take(size_t n) {
    if (scratch_busy)
        return PyMem_Malloc(n ? n : 1);
    if (n > scratch_cap) {
        size_t cap = n > 2 * scratch_cap ? n : 2 * scratch_cap;
        uint8_t *grown = PyMem_Realloc(scratch, cap);
        if (grown == NULL)
            return NULL;
        scratch = grown;
        scratch_cap = cap;
    }
    scratch_busy = 1;
    return scratch;
}

static void scratch_give(uint8_t *p) {
    if (p == scratch)
        scratch_busy = 0;
    else
        PyMem_Free(p);
}

/* Whether the ints items[0..bs) are exactly the record's ids `tok` (`width`
 * bytes each: 2 or 4). An id that does not fit the width makes the xor
 * nonzero, so equal here means equal records. (Prefetching the token objects
 * 64 ahead here was 7% slower: docs/benchmarks.md.) */
static inline __attribute__((always_inline)) int ids_match(PyObject *const *items,
                                                           const uint8_t *tok, Py_ssize_t bs,
                                                           int width) {
    uint64_t diff = 0;
    for (Py_ssize_t i = 0; i < bs; i++) {
        int64_t v;
        if (!Py_IS_TYPE(items[i], &PyLong_Type) || !small_long(items[i], &v))
            return 0;
        diff |= (uint64_t)v ^ (width == 2 ? load16_le(tok + 2 * i) : load32_le(tok + 4 * i));
    }
    return diff == 0;
}

#if defined(HAVE_X86_SIMD) && PY_VERSION_HEX < 0x030C0000
/* ids_match four tokens at a time with AVX2 gathers (Python 3.11's int
 * layout): the scalar loop spends ~4 cycles per token on three dependent
 * loads from the token object (type, size, first digit) and their tests.
 * Sizes and digits are gathered only once all four types are exactly int
 * (an int always has a digit allocated, whatever its size). A group that is
 * not four one-digit ints equal to the record's ids goes to the scalar test,
 * which decides exactly. Measured (docs/benchmarks.md): a walk over 196
 * cached blocks 2.3 -> 1.7 ns per token; the 8-wide AVX-512 version was
 * slower than this one (2.2). */
static int gather_ids; /* at import: the CPU runs AVX2; set_gather for tests */

static __attribute__((target("avx2"), noinline)) int ids_match_gather(PyObject *const *items,
                                                                     const uint8_t *tok,
                                                                     Py_ssize_t bs, int width) {
    const __m256i int_type = _mm256_set1_epi64x((long long)(uintptr_t)&PyLong_Type);
    const __m256i one = _mm256_set1_epi64x(1);
    /* the field offsets as gather bases: the lanes hold the object addresses */
    const long long *at_type = (const long long *)offsetof(PyObject, ob_type);
    const long long *at_size = (const long long *)offsetof(PyVarObject, ob_size);
    const int *at_digit = (const int *)offsetof(PyLongObject, ob_digit);
    Py_ssize_t i = 0;
    for (; i + 4 <= bs; i += 4) {
        __m256i objs = _mm256_loadu_si256((const __m256i *)(items + i));
        __m256i type = _mm256_i64gather_epi64(at_type, objs, 1);
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi64(type, int_type)) == -1) {
            __m256i size = _mm256_i64gather_epi64(at_size, objs, 1);
            __m128i digit = _mm256_i64gather_epi32(at_digit, objs, 1);
            __m128i want =
                width == 2 ? _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(tok + 2 * i)))
                           : _mm_loadu_si128((const __m128i *)(tok + 4 * i));
            if (_mm256_movemask_epi8(_mm256_cmpeq_epi64(size, one)) == -1 &&
                _mm_movemask_epi8(_mm_cmpeq_epi32(digit, want)) == 0xFFFF)
                continue;
        }
        if (!(width == 2 ? ids_match(items + i, tok + 2 * i, 4, 2)
                         : ids_match(items + i, tok + 4 * i, 4, 4)))
            return 0;
    }
    return width == 2 ? ids_match(items + i, tok + 2 * i, bs - i, 2)
                      : ids_match(items + i, tok + 4 * i, bs - i, 4);
}
#define HAVE_GATHER_IDS 1
#endif

/* Whether block [lo, lo + bs) under parent hash `prev` (DIGEST bytes) and
 * `extra` is exactly node c's record, read straight from the token objects:
 * a hit at a chain link then needs no record of its own. The record of a
 * block whose ids all fit in uint16 (uint32) is prev ‖ extra ‖ the ids as
 * uint16 (uint32) ‖ 2 (4), so equal ids mean equal records. 0 on anything
 * unusual (an id that needs int64, a token that is not a plain int, a list
 * that shrank): the general path then decides, and words any error. */
static int link_matches(PyObject *c, const uint8_t *prev, const uint8_t *extra,
                        Py_ssize_t extra_len, PyObject *seq, const int64_t *arr, Py_ssize_t lo,
                        Py_ssize_t bs) {
    PyObject *in = node_input(c);
    if (in == NULL || !PyBytes_CheckExact(in))
        return 0;
    Py_ssize_t size = PyBytes_GET_SIZE(in), head = DIGEST + extra_len;
    int width = size == head + 2 * bs + 1 ? 2 : size == head + 4 * bs + 1 ? 4 : 0;
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(in), *tok = p + head;
    if (width == 0 || p[size - 1] != width || memcmp(p, prev, DIGEST) != 0 ||
        memcmp(p + DIGEST, extra, (size_t)extra_len) != 0)
        return 0;
    if (arr != NULL) {
        uint64_t diff = 0;
        for (Py_ssize_t i = 0; i < bs; i++)
            diff |= (uint64_t)arr[lo + i] ^
                    (width == 2 ? load16_le(tok + 2 * i) : load32_le(tok + 4 * i));
        return diff == 0;
    }
    if (lo + bs > Py_SIZE(seq))
        return 0;
    PyObject *const *items = PySequence_Fast_ITEMS(seq) + lo;
#ifdef HAVE_GATHER_IDS
    if (gather_ids)
        return ids_match_gather(items, tok, bs, width);
#endif
    return width == 2 ? ids_match(items, tok, bs, 2) : ids_match(items, tok, bs, 4);
}

/* After a hit at chain link c: ask the cache for what the next blocks will
 * read, so their misses overlap this block's token reads instead of
 * stalling the walk one after another. Two blocks ahead: the node there
 * (its head prefetched one block ago) gives its record, hash and key
 * objects, and its child's head is fetched for the step after (depth 2 vs
 * 1, in-process replays: a few percent at most, within this machine's
 * noise; docs/benchmarks.md). `record_reach`: the bytes of c's record
 * object, the likely size of the next ones (a tree's records mostly share a
 * width). Only hints: nothing is read but nodes already in the tree. */
static void prefetch_ahead(PyObject *c, Py_ssize_t record_reach) {
    PyObject *n1 = node_only_child(c);
    if (n1 == NULL)
        return;
    PyObject *n2 = node_only_child(n1);
    if (n2 == NULL)
        return;
    const char *in = (const char *)node_input(n2);
    if (in != NULL) /* a prefetch past its end is harmless */
        for (int off = 0; off < record_reach; off += 64)
            __builtin_prefetch(in + off);
    __builtin_prefetch(node_hash(n2));
    __builtin_prefetch(node_mkey(n2));
    PyObject *n3 = node_only_child(n2);
    if (n3 != NULL)
        for (int off = 0; off < 128; off += 64)
            __builtin_prefetch((const char *)n3 + off);
}

/* Block i at a chain link of the tree (pos has one child): 1 and the child's
 * hash, record and key appended at i when the block is that child, 0 when
 * not (or it cannot tell: the general path decides), -1 on an error. */
static int link_hit(PyObject **pos, const uint8_t *prev, const uint8_t *extra,
                    Py_ssize_t extra_len, PyObject *seq, const int64_t *arr, Py_ssize_t lo,
                    Py_ssize_t bs, PyObject *out[3], Py_ssize_t i) {
    PyObject *c = node_only_child(*pos);
    if (c == NULL)
        return 0;
    native_steps++;
    PyObject *h = node_hash(c), *mkey = node_mkey(c);
    if (h == NULL || !PyBytes_Check(h) || PyBytes_GET_SIZE(h) != DIGEST || mkey == NULL ||
        !PyLong_CheckExact(mkey) || !link_matches(c, prev, extra, extra_len, seq, arr, lo, bs))
        return 0;
    PyList_SET_ITEM(out[0], i, Py_NewRef(h));
    PyList_SET_ITEM(out[1], i, Py_NewRef(node_input(c)));
    PyList_SET_ITEM(out[2], i, Py_NewRef(mkey));
    Py_SETREF(*pos, Py_NewRef(c));
    prefetch_ahead(c, sizeof(PyBytesObject) + PyBytes_GET_SIZE(node_input(c)));
    return 1;
}

/* One pass over the blocks. At a chain link of the tree (most hits) a block
 * is compared with the only child's record straight from its token objects;
 * any other block gets its record (extra ‖ tokens ‖ width, see
 * tokens_to_record) and is looked up: the child under its key where the
 * tree branches, or the flat memo's entry. After the first miss in the
 * tree, BLAKE2b for every later block. */
static PyObject *chain_memo_impl(const uint8_t *parent, Py_ssize_t parent_len, PyObject *seq,
                                 const int64_t *arr, Py_ssize_t block_size,
                                 const uint8_t *extra, Py_ssize_t extra_len, Py_ssize_t start,
                                 Py_ssize_t stop, PyObject *memo) {
    int is_list = seq != NULL && PyList_Check(seq);
    Py_ssize_t n = stop - start, stride = extra_len + 8 * block_size + 1;
    /* tree mode: the walk position (None: no memo; a dict: flat, no position) */
    PyObject *pos = PyDict_Check(memo) || memo == Py_None ? NULL : Py_NewRef(memo);
    int use_memo = memo != Py_None;
    /* one block's record, then the scratch input */
    uint8_t *rec = scratch_take((size_t)(stride + parent_len + stride)), *wide = rec + stride;
    PyObject *out[3] = {PyList_New(n), PyList_New(n), PyList_New(n)};
    if (rec == NULL || !out[0] || !out[1] || !out[2]) {
        if (rec == NULL) PyErr_NoMemory();
        goto fail;
    }
    const uint8_t *prev = parent;
    Py_ssize_t prev_len = parent_len;
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_ssize_t lo = (start + b) * block_size;
        int found = use_memo && pos != NULL && prev_len == DIGEST && is_native_node(pos)
                        ? link_hit(&pos, prev, extra, extra_len, seq, arr, lo, block_size, out, b)
                        : 0;
        if (found < 0) goto fail;
        if (!found) {
            memcpy(rec, extra, (size_t)extra_len);
            Py_ssize_t got = tokens_to_record(rec + extra_len, seq, is_list, arr, lo,
                                              lo + block_size);
            if (got < 0) goto fail;
            Py_ssize_t rec_len = extra_len + got;
            lazy_key key = {rec, rec_len, 0, 0};
            if (prev_len != DIGEST) { /* an odd parent (block 0 only): key the whole record */
                memcpy(wide, prev, (size_t)prev_len);
                memcpy(wide + prev_len, rec, (size_t)rec_len);
                key.key = input_key(wide, (size_t)(prev_len + rec_len));
                key.known = 1;
            }
            found = use_memo ? memo_hit(memo, &pos, &key, prev, prev_len, rec, rec_len, out, b)
                             : 0;
            if (found < 0) goto fail;
            if (!found) {
                if (!PyDict_Check(memo)) use_memo = 0; /* off the tree: no later block is */
                if (hash_block(key_of(&key), prev, prev_len, rec, rec_len, extra_len,
                               block_size, wide, out, b) < 0)
                    goto fail;
            }
        }
        prev = (const uint8_t *)PyBytes_AS_STRING(PyList_GET_ITEM(out[0], b));
        prev_len = DIGEST;
    }
    Py_XDECREF(pos);
    scratch_give(rec);
    PyObject *result = PyTuple_Pack(3, out[0], out[1], out[2]);
    for (int i = 0; i < 3; i++) Py_DECREF(out[i]);
    return result;
fail:
    Py_XDECREF(pos);
    scratch_give(rec);
    for (int i = 0; i < 3; i++) Py_XDECREF(out[i]);
    return NULL;
}

/* Accept int64 buffers: itemsize 8 and a signed 64-bit integer format. */
static int is_int64_format(const Py_buffer *view) {
    if (view->itemsize != 8) return 0;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=') f++;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    else if (*f == '<') f++;
#endif
    return (f[0] == 'q' || f[0] == 'l') && f[1] == '\0';
}

static Py_ssize_t index_arg(PyObject *o, const char *name) {
    Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name, Py_TYPE(o)->tp_name);
    }
    return v;
}

/* The arguments chain() and chain_memo() share, checked. */
typedef struct {
    PyObject *parent, *tokens, *extra;
    Py_ssize_t block_size, start, stop;
    int is_seq;
    Py_buffer view; /* held when !is_seq: release with release_args */
} chain_args;

static void release_args(chain_args *a);

/* 0 with *a filled (and a buffer view held for array tokens), 1 when the range
 * is empty, -1 with an exception set. */
static int parse_chain_args(PyObject *const *args, chain_args *a) {
    a->parent = args[0];
    a->tokens = args[1];
    a->extra = args[3];
    a->is_seq = 1;
    if (!PyBytes_Check(a->parent)) {
        PyErr_Format(PyExc_TypeError, "parent must be bytes, got %.100s",
                     Py_TYPE(a->parent)->tp_name);
        return -1;
    }
    if (!PyBytes_Check(a->extra)) {
        PyErr_Format(PyExc_TypeError, "extra must be bytes, got %.100s",
                     Py_TYPE(a->extra)->tp_name);
        return -1;
    }
    a->block_size = index_arg(args[2], "block_size");
    if (a->block_size == -1 && PyErr_Occurred()) return -1;
    a->start = index_arg(args[4], "start");
    if (a->start == -1 && PyErr_Occurred()) return -1;
    a->stop = index_arg(args[5], "stop");
    if (a->stop == -1 && PyErr_Occurred()) return -1;
    if (a->block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", a->block_size);
        return -1;
    }
    PyObject *tokens = a->tokens;
    Py_ssize_t n_tokens;
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        n_tokens = PyList_Check(tokens) ? PyList_GET_SIZE(tokens) : PyTuple_GET_SIZE(tokens);
    } else {
        if (PyObject_GetBuffer(tokens, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Format(PyExc_TypeError,
                         "tokens must be a list, a tuple or a C-contiguous int64 buffer, "
                         "got %.100s", Py_TYPE(tokens)->tp_name);
            return -1;
        }
        a->is_seq = 0;
        if (!is_int64_format(&a->view)) {
            PyErr_Format(PyExc_TypeError, "token buffer must hold int64 items, got format '%s' "
                         "with itemsize %zd", a->view.format ? a->view.format : "B",
                         a->view.itemsize);
            PyBuffer_Release(&a->view);
            a->is_seq = 1;
            return -1;
        }
        n_tokens = a->view.len / 8;
    }
    Py_ssize_t full = n_tokens / a->block_size;
    if (a->start < 0 || a->stop > full) {
        PyErr_Format(PyExc_ValueError,
                     "blocks [%zd, %zd) are not within the %zd full blocks of %zd tokens",
                     a->start, a->stop, full, n_tokens);
        release_args(a);
        return -1;
    }
    return a->stop <= a->start;
}

static void release_args(chain_args *a) {
    if (!a->is_seq) {
        PyBuffer_Release(&a->view);
        a->is_seq = 1;
    }
}

#define ARG_BYTES(o) (const uint8_t *)PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o)
#define ARG_TOKENS(a) (a).is_seq ? (a).tokens : NULL, \
                      (a).is_seq ? NULL : (const int64_t *)(a).view.buf

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError,
                     "chain(parent, tokens, block_size, extra, start, stop) takes 6 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    chain_args a;
    int rc = parse_chain_args(args, &a);
    if (rc != 0) return rc < 0 ? NULL : PyList_New(0);
    PyObject *result = chain_impl(ARG_BYTES(a.parent), ARG_TOKENS(a), a.block_size,
                                  ARG_BYTES(a.extra), a.start, a.stop);
    release_args(&a);
    return result;
}

static PyObject *chain_memo(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError,
                     "chain_memo(parent, tokens, block_size, extra, start, stop, memo) takes 7 "
                     "arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *memo = args[6];
    if (!PyDict_Check(memo) && memo != Py_None) {
        if (!PyObject_HasAttr(memo, str_memo_child)) {
            PyErr_Format(PyExc_TypeError,
                         "memo must be a dict, None or a tree node (with memo_child), got %.100s",
                         Py_TYPE(memo)->tp_name);
            return NULL;
        }
    }
    chain_args a;
    int rc = parse_chain_args(args, &a);
    if (rc < 0) return NULL;
    if (rc > 0) return Py_BuildValue("([][][])");
    PyObject *result = chain_memo_impl(ARG_BYTES(a.parent), ARG_TOKENS(a), a.block_size,
                                       ARG_BYTES(a.extra), a.start, a.stop, args[6]);
    release_args(&a);
    return result;
}

static PyObject *memo_key(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyBytes_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "memo_key takes bytes, got %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(
        input_key((const uint8_t *)PyBytes_AS_STRING(arg), (size_t)PyBytes_GET_SIZE(arg)));
}

/* ------------------------------------------------------- impl selection */

static PyObject *walk_native_steps(PyObject *self, PyObject *unused) {
    (void)self;
    return PyLong_FromUnsignedLongLong(native_steps);
}

/* set_node_api(capsule): read kvcached._tree_node's nodes directly in the walk. */
static PyObject *set_node_api(PyObject *self, PyObject *capsule) {
    (void)self;
    const kvc_node_api *api = PyCapsule_GetPointer(capsule, KVC_NODE_API_CAPSULE);
    if (api == NULL) return NULL;
    if (api->version != KVC_NODE_API_VERSION || api->size != sizeof(kvc_node_api)) {
        PyErr_Format(PyExc_ValueError, "node_api version %u size %u, expected %u and %zu",
                     api->version, api->size, KVC_NODE_API_VERSION, sizeof(kvc_node_api));
        return NULL;
    }
    node_api = api;
    Py_RETURN_NONE;
}

static const impl_entry *find_impl(const char *name) {
    for (int i = 0; i < N_IMPLS; i++) {
        if (IMPLS[i].supported() && (name == NULL || strcmp(IMPLS[i].name, name) == 0))
            return &IMPLS[i];
    }
    return NULL;
}

static void use_impl(const impl_entry *e) {
    current_impl = e;
    compress = e->fn;
}

static PyObject *impl(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(current_impl->name);
}

static PyObject *impls(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *out = PyTuple_New(0);
    for (int i = 0; out != NULL && i < N_IMPLS; i++) {
        if (!IMPLS[i].supported()) continue;
        PyObject *name = PyUnicode_FromString(IMPLS[i].name);
        if (name == NULL || _PyTuple_Resize(&out, PyTuple_GET_SIZE(out) + 1) < 0) {
            Py_XDECREF(name);
            Py_XDECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, PyTuple_GET_SIZE(out) - 1, name);
    }
    return out;
}

/* For tests and benchmarks: every impl gives the same bytes, only speed differs. */
static PyObject *set_impl(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (name == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "impl name must be a str, got %.100s",
                         Py_TYPE(arg)->tp_name);
        return NULL;
    }
    const impl_entry *e = find_impl(name);
    if (e == NULL) {
        PyErr_Format(PyExc_ValueError, "block hash impl '%s' is unknown or unsupported by this "
                     "CPU", name);
        return NULL;
    }
    PyObject *previous = PyUnicode_FromString(current_impl->name);
    if (previous != NULL) use_impl(e);
    return previous;
}

/* For tests and benchmarks: with or without gathers, a link compares the same. */
static PyObject *set_gather(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
#ifdef HAVE_GATHER_IDS
    int before = gather_ids;
    if (on && !has_avx2()) {
        PyErr_SetString(PyExc_ValueError, "this CPU has no AVX2: token gathers are unavailable");
        return NULL;
    }
    gather_ids = on;
    return PyBool_FromLong(before);
#else
    if (on) {
        PyErr_SetString(PyExc_ValueError, "this build has no token gathers (AVX2 on x86-64 "
                        "under Python 3.11 only)");
        return NULL;
    }
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(parent, tokens, block_size, extra, start, stop) -> list[bytes]\n\n"
     "BLAKE2b-128 chained hashes of full blocks start..stop-1 of tokens."},
    {"chain_memo", (PyCFunction)(void (*)(void))chain_memo, METH_FASTCALL,
     "chain_memo(parent, tokens, block_size, extra, start, stop, memo) -> (hashes, inputs, "
     "keys)\n\nchain(), taking the hash of any block whose input bytes a memo entry "
     "(memo[key].input) holds: memo[key].hash. inputs[i] are the bytes block i was hashed "
     "from, keys[i] their memo key."},
    {"memo_key", memo_key, METH_O, "memo_key(input: bytes) -> int: the memo key of a block "
     "input (of what follows its 16-byte parent hash; process-local)."},
    {"native_steps", walk_native_steps, METH_NOARGS, "native_steps() -> int: walk steps "
     "so far that read a native node directly (tests: the capsule is in use)."},
    {"set_node_api", set_node_api, METH_O, "set_node_api(kvcached._tree_node.node_api): read "
     "native tree nodes directly in chain_memo's walk (the capsule is kept by its module)."},
    {"impl", impl, METH_NOARGS, "impl() -> str: the BLAKE2b compress in use "
     "('avx512', 'avx2' or 'portable')."},
    {"impls", impls, METH_NOARGS, "impls() -> tuple[str, ...]: the ones this CPU runs, best "
     "first (the first is picked at import)."},
    {"set_gather", set_gather, METH_O, "set_gather(on: bool) -> bool: compare chain links' "
     "token ids with AVX2 gathers (on by default where the CPU and Python allow) or one by "
     "one; returns the previous setting. For tests and benchmarks."},
    {"set_impl", set_impl, METH_O, "set_impl(name) -> str: use impl name from now on (process "
     "wide); returns the previous one. For tests and benchmarks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_block_hash", "Native chained block hashes for kvcached.core.hashing.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__block_hash(void) {
#ifdef HAVE_X86_SIMD
    __builtin_cpu_init();
#endif
    use_impl(find_impl(NULL)); /* the best supported; portable always is */
#ifdef HAVE_GATHER_IDS
    gather_ids = has_avx2();
#endif
    str_input = PyUnicode_InternFromString("input");
    str_hash = PyUnicode_InternFromString("hash");
    str_memo_child = PyUnicode_InternFromString("memo_child");
    if (str_input == NULL || str_hash == NULL || str_memo_child == NULL) return NULL;
    return PyModule_Create(&module);
}
