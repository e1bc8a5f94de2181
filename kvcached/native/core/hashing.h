/* Chained block hashes and the hash memo's records (hashing.c).
 *
 *   h_i = BLAKE2b-128(h_{i-1} || extra || tokens_i as little-endian int64),
 *   h_{-1} = the namespace hash.
 *
 * The memo: a node remembers the exact input its hash was computed from,
 * less the parent's hash (the parent node stands for it), as a record:
 *
 *   ids || [namespace hash, for a node under the root] || extra || width
 *
 * with the ids narrowed to the narrowest little-endian form they all fit
 * (uint16, uint32 or int64; width says which: 2, 4 or 8), so equal blocks
 * have equal records. When the node the previous block matched has one
 * child (a link of a chain: most blocks of a hit), the block is compared
 * with that child's record; if they are equal the block has the child's
 * hash (equal records, equal hash inputs, equal hashes). Anywhere else (a
 * branch, a new block) the block is hashed. */
#ifndef KVC_HASHING_H
#define KVC_HASHING_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"

/* The record of one block, at out (room: record_room()); returns its length. */
uint32_t make_record(uint8_t *out, const uint8_t *ns, const uint8_t *extra, size_t extra_len,
                     const int64_t *ids, int32_t n);
size_t record_room(size_t extra_len, int32_t block_size);
/* The hash input a record stands for, given the parent's hash (NULL for a
 * record that carries the namespace): parent || extra || ids as int64. */
size_t record_input(uint8_t *out, const uint8_t *parent, const uint8_t *rec, uint32_t len,
                    int32_t block_size, int has_ns);

void hash_block(const uint8_t parent[HASH_LEN], const uint8_t *extra, size_t extra_len,
                const int64_t *ids, int32_t n, uint8_t out[HASH_LEN]);
void hash_bytes(const uint8_t *in, size_t n, uint8_t out[HASH_LEN]);

const char *hash_impl_select(void);
const char *hash_impl_name(void);
int hash_impl_set(const char *name);
int hash_impl_list(const char **names, int max);

#endif /* KVC_HASHING_H */
