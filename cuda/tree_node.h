/* What the files of kvcached._tree_node share (tree_node.c: the Node type and
 * the module; block_pool.c: BlockPool; leaf_lru.c: LeafLRU; tree_evict.c:
 * eviction's hot loops). One extension, built from all of them: the
 * eviction loop reads nodes, pools and heaps without a Python call. */
#ifndef KVC_TREE_NODE_H
#define KVC_TREE_NODE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "node_api.h"

/* A node's place in one LeafLRU: the live key (last_access, then inverted
 * depth and insertion order: see kvcached.core.tree.lru_key), or not listed. */
typedef struct {
    uint64_t hi, lo;
    int listed;
} lru_slot;

enum { LRU_GPU = 0, LRU_CPU = 1 }; /* Node.lru[]: gpu_key, cpu_key */

typedef struct {
    PyObject_HEAD
    /* What the memo walk and match_ref read of every node they pass come
     * first, so that they share the node's first cache lines; the first
     * four are node_api.h's kvc_node_head. */
    PyObject *children, *hash, *input, *mkey, *state, *ref, *gpu;
    PyObject *parent, *cpu, *in_storage, *last_access, *depth, *n_gpu_children,
        *n_cpu_children, *busy;
    PyObject *bykey; /* where children is a dict: memo key -> child (see memo_child) */
    uint64_t mkey_raw; /* mkey as a C integer when has_mkey: the walk compares it unboxed */
    int has_mkey;
    lru_slot lru[2];
} Node;

/* An int attribute's value as a C long: a compact int (every counter, id and
 * clock in practice) read in place, anything else through PyLong_AsLong.
 * 0, or -1 with an exception set (not an int, or it does not fit). The hot
 * loops read several per node, and the call (and its error test) was a
 * visible part of them. */
static inline int kvc_get(PyObject *o, long *out) {
    if (PyLong_CheckExact(o)) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (long)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 0;
        }
#else
        Py_ssize_t size = Py_SIZE(o);
        if (size >= -1 && size <= 1) {
            *out = size * (long)((PyLongObject *)o)->ob_digit[0];
            return 0;
        }
#endif
    }
    *out = PyLong_AsLong(o);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* kvc_get for callers that test `v == -1 && PyErr_Occurred()` themselves. */
static inline long kvc_long(PyObject *o) {
    long v;
    kvc_get(o, &v);
    return v;
}

_Static_assert(offsetof(Node, children) == offsetof(kvc_node_head, children) &&
                   offsetof(Node, hash) == offsetof(kvc_node_head, hash) &&
                   offsetof(Node, input) == offsetof(kvc_node_head, input) &&
                   offsetof(Node, mkey) == offsetof(kvc_node_head, mkey),
               "Node must start as kvc_node_head (node_api.h)");

extern PyTypeObject NodeType;
static inline int is_node(PyObject *o) { return o != NULL && Py_IS_TYPE(o, &NodeType); }

/* tree_node.c */
int kvc_unlink_child(Node *self, PyObject *h);         /* -1 on error */
int kvc_add_to(PyObject **slot, long d);               /* *slot += d; -1 on error */

/* A LeafLRU: a binary heap of (key, node) with lazy deletion (leaf_lru.c). */
typedef struct {
    uint64_t hi, lo;
    Node *node; /* a strong reference */
} lru_entry;

typedef struct {
    PyObject_HEAD
    int which; /* LRU_GPU or LRU_CPU: the node slot it keys */
    Py_ssize_t size; /* live nodes */
    lru_entry *heap;
    Py_ssize_t len, cap;
    uint64_t seq;
    PyObject *slot; /* "gpu_key" or "cpu_key" */
} LeafLRU;

extern PyTypeObject LeafLRUType;
int kvc_lru_add(LeafLRU *lru, Node *node);              /* -1 on error */
void kvc_lru_discard(LeafLRU *lru, Node *node);
Node *kvc_lru_pop(LeafLRU *lru);                        /* new ref or NULL (empty) */
Node *kvc_lru_push_pop(LeafLRU *lru, Node *node);       /* new ref, NULL: empty or error */

/* BlockPool: one tier's free block ids, a FIFO ring (block_pool.c). */
typedef struct {
    PyObject_HEAD
    PyObject *name;
    Py_ssize_t num_blocks, head, count; /* free ids: ring[head .. head+count) */
    int32_t *ring;
    uint8_t *is_free;
    PyObject **objs; /* objs[b]: the int object handed out for id b */
} BlockPool;

extern PyTypeObject BlockPoolType;
int kvc_pool_free_one(BlockPool *pool, Py_ssize_t b);  /* -1 (ValueError) on a bad id */
Py_ssize_t kvc_pool_take_one(BlockPool *pool);         /* -1 when empty (no error set) */
PyObject *kvc_pool_id(BlockPool *pool, Py_ssize_t b);  /* borrowed: id b's int object */

int kvc_add_lru_types(PyObject *module);
int kvc_add_evict_functions(PyObject *module);

#endif
