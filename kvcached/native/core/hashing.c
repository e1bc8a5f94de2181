/* Chained block hashes and memo records; see hashing.h. No Python here: the
 * binding reads the engine's tokens once into an int64 buffer. */
#include "hashing.h"

#include "blake2b.h"

size_t record_room(size_t extra_len, int32_t block_size) {
    return HASH_LEN + extra_len + 8 * (size_t)block_size + 1;
}

/* The narrowing loops are kept apart per width so that they vectorise (a
 * chain link's compare builds the block's record and compares bytes); on
 * x86-64 each is also built for AVX2 and AVX-512, picked at load time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

VECTOR_CLONES static uint64_t or_all(const int64_t *ids, int32_t n) {
    uint64_t wide = 0;
    for (int32_t i = 0; i < n; i++) wide |= (uint64_t)ids[i];
    return wide;
}

VECTOR_CLONES static void narrow16(uint16_t *p, const int64_t *ids, int32_t n) {
    for (int32_t i = 0; i < n; i++) p[i] = (uint16_t)ids[i];
}

VECTOR_CLONES static void narrow32(uint32_t *p, const int64_t *ids, int32_t n) {
    for (int32_t i = 0; i < n; i++) p[i] = (uint32_t)ids[i];
}

/* Record layout: ids || [namespace] || extra || width. The ids come first, so
 * they start where the buffer does (malloc'd: aligned) and the narrowing
 * stores are aligned. */
uint32_t make_record(uint8_t *out, const uint8_t *ns, const uint8_t *extra, size_t extra_len,
                     const int64_t *ids, int32_t n) {
    uint64_t wide = or_all(ids, n); /* an id outside [0, 2^16) or [0, 2^32) sets a high bit */
    int width = wide >> 32 ? 8 : wide >> 16 ? 4 : 2;
    uint8_t *p = out;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (width == 2) {
        narrow16((uint16_t *)p, ids, n);
    } else if (width == 4) {
        narrow32((uint32_t *)p, ids, n);
    } else {
        memcpy(p, ids, (size_t)n * 8);
    }
#else
    for (int32_t i = 0; i < n; i++) {
        if (width == 2) {
            store16_le(p + 2 * i, (uint32_t)ids[i]);
        } else if (width == 4) {
            store32_le(p + 4 * i, (uint32_t)ids[i]);
        } else {
            store64_le(p + 8 * i, (uint64_t)ids[i]);
        }
    }
#endif
    p += (size_t)width * (size_t)n;
    if (ns != NULL) {
        memcpy(p, ns, HASH_LEN);
        p += HASH_LEN;
    }
    memcpy(p, extra, extra_len);
    p += extra_len;
    *p++ = (uint8_t)width;
    return (uint32_t)(p - out);
}

size_t record_input(uint8_t *out, const uint8_t *parent, const uint8_t *rec, uint32_t len,
                    int32_t block_size, int has_ns) {
    int width = rec[len - 1];
    size_t ids_len = (size_t)width * (size_t)block_size;
    size_t head = len - 1 - ids_len; /* [ns] || extra, after the ids */
    uint8_t *p = out;
    if (!has_ns) {
        memcpy(p, parent, HASH_LEN);
        p += HASH_LEN;
    }
    memcpy(p, rec + ids_len, head);
    p += head;
    for (int32_t i = 0; i < block_size; i++, p += 8) {
        uint64_t v = width == 2   ? load16_le(rec + 2 * i)
                     : width == 4 ? load32_le(rec + 4 * i)
                                  : load64_le(rec + 8 * i);
        store64_le(p, v);
    }
    return (size_t)(p - out);
}

void hash_block(const uint8_t parent[HASH_LEN], const uint8_t *extra, size_t extra_len,
                const int64_t *ids, int32_t n, uint8_t out[HASH_LEN]) {
    b2b_state s;
    b2b_init(&s);
    b2b_update(&s, parent, HASH_LEN);
    b2b_update(&s, extra, extra_len);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    b2b_update(&s, (const uint8_t *)ids, (size_t)n * 8);
#else
    for (int32_t i = 0; i < n; i++) {
        uint8_t le[8];
        store64_le(le, (uint64_t)ids[i]);
        b2b_update(&s, le, 8);
    }
#endif
    b2b_final(&s, out);
}

void hash_bytes(const uint8_t *in, size_t n, uint8_t out[HASH_LEN]) { b2b_digest(in, n, out); }

const char *hash_impl_select(void) { return b2b_select(); }
const char *hash_impl_name(void) { return current_impl->name; }
int hash_impl_set(const char *name) { return b2b_set_impl(name); }

int hash_impl_list(const char **names, int max) {
    int n = 0;
    for (int i = 0; i < N_IMPLS && n < max; i++) {
        if (IMPLS[i].supported()) names[n++] = IMPLS[i].name;
    }
    return n;
}
