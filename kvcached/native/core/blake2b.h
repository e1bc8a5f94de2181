/* BLAKE2b-128 (RFC 7693), unkeyed, for the chained block hashes of
 * kvcached.core: h_i = BLAKE2b-128(h_{i-1} || extra || tokens_i as LE int64).
 *
 * The message is fed incrementally through one 128-byte buffer, so a
 * prompt is never copied. The compress function has a portable C version
 * and, on x86-64, AVX2 and AVX-512VL versions; b2b_select() picks the best
 * one the CPU runs (all give the same bytes: the tests compare each with
 * hashlib). Included by hashing.c only. */
#ifndef KVC_BLAKE2B_H
#define KVC_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

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


/* Pick the best compress this CPU runs; returns its name. */
static const char *b2b_select(void) {
    for (int i = 0; i < N_IMPLS; i++) {
        if (IMPLS[i].supported()) {
            current_impl = &IMPLS[i];
            compress = IMPLS[i].fn;
            break;
        }
    }
    return current_impl->name;
}

/* Use compress `name` if this CPU runs it: 0, or -1 (unknown or unsupported). */
static int b2b_set_impl(const char *name) {
    for (int i = 0; i < N_IMPLS; i++) {
        if (strcmp(IMPLS[i].name, name) == 0 && IMPLS[i].supported()) {
            current_impl = &IMPLS[i];
            compress = IMPLS[i].fn;
            return 0;
        }
    }
    return -1;
}

/* One-shot digest of n bytes. */
static inline void b2b_digest(const uint8_t *in, size_t n, uint8_t out[DIGEST]) {
    b2b_state s;
    b2b_init(&s);
    b2b_update(&s, in, n);
    b2b_final(&s, out);
}

#endif /* KVC_BLAKE2B_H */
