/* Chained block hashes and memo records; see hashing.h. No Python here: the
 * binding reads the engine's tokens once into an int64 buffer. */
#include "hashing.h"

#include "blake2b.h"

size_t record_room(size_t extra_len, int32_t block_size) {
    return HASH_LEN + extra_len + 8 * (size_t)block_size + 1;
}

uint32_t make_record(uint8_t *out, const uint8_t *ns, const uint8_t *extra, size_t extra_len,
                     const int64_t *ids, int32_t n) {
    uint8_t *p = out;
    if (ns != NULL) {
        memcpy(p, ns, HASH_LEN);
        p += HASH_LEN;
    }
    memcpy(p, extra, extra_len);
    p += extra_len;
    uint64_t wide = 0; /* any id outside [0, 2^16) or [0, 2^32) sets a high bit */
    for (int32_t i = 0; i < n; i++) wide |= (uint64_t)ids[i];
    int width = wide >> 32 ? 8 : wide >> 16 ? 4 : 2;
    for (int32_t i = 0; i < n; i++) {
        if (width == 2) {
            store16_le(p + 2 * i, (uint32_t)ids[i]);
        } else if (width == 4) {
            store32_le(p + 4 * i, (uint32_t)ids[i]);
        } else {
            store64_le(p + 8 * i, (uint64_t)ids[i]);
        }
    }
    p += (size_t)width * (size_t)n;
    *p++ = (uint8_t)width;
    return (uint32_t)(p - out);
}

static inline uint64_t mix(uint64_t a, uint64_t w) {
    a = (a ^ w) * 0x9E3779B97F4A7C15ULL;
    return a ^ (a >> 29);
}

/* Four independent lanes, so the multiplies overlap instead of chaining. */
uint64_t record_key(const uint8_t *p, uint32_t n) {
    uint64_t a = 0x243F6A8885A308D3ULL, b = 0x13198A2E03707344ULL;
    uint64_t c = 0xA4093822299F31D0ULL, d = 0x082EFA98EC4E6C89ULL;
    uint32_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a = mix(a, load64_le(p + i));
        b = mix(b, load64_le(p + i + 8));
        c = mix(c, load64_le(p + i + 16));
        d = mix(d, load64_le(p + i + 24));
    }
    for (; i + 8 <= n; i += 8) a = mix(a, load64_le(p + i));
    if (i < n) {
        uint8_t tail[8] = {0};
        memcpy(tail, p + i, n - i);
        b = mix(b, load64_le(tail));
    }
    uint64_t k = a ^ rotr64(b, 17) ^ rotr64(c, 31) ^ rotr64(d, 47) ^ n;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

size_t record_input(uint8_t *out, const uint8_t *parent, const uint8_t *rec, uint32_t len,
                    int32_t block_size, int has_ns) {
    int width = rec[len - 1];
    size_t ids_len = (size_t)width * (size_t)block_size;
    size_t head = len - 1 - ids_len; /* [ns] || extra */
    uint8_t *p = out;
    if (!has_ns) {
        memcpy(p, parent, HASH_LEN);
        p += HASH_LEN;
    }
    memcpy(p, rec, head);
    p += head;
    const uint8_t *ids = rec + head;
    for (int32_t i = 0; i < block_size; i++, p += 8) {
        uint64_t v = width == 2   ? load16_le(ids + 2 * i)
                     : width == 4 ? load32_le(ids + 4 * i)
                                  : load64_le(ids + 8 * i);
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
