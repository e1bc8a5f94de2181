/* What kvcached._tree_node exports, as a capsule, to kvcached._block_hash's
 * memo walk: native nodes are read directly, without a Python call per
 * block. Both extensions include this header, and its text is part of both
 * builds' cache keys; version and size still guard builds loaded separately. */
#ifndef KVC_NODE_API_H
#define KVC_NODE_API_H

#include <Python.h>
#include <stdint.h>

#define KVC_NODE_API_VERSION 3
#define KVC_NODE_API_CAPSULE "kvcached._tree_node.node_api"

/* The head of a native node: the fields the walk reads at every block, read
 * in place (a call per field was ~8% of the walk). tree_node.h's Node starts
 * with these fields, in this order, and asserts it. */
typedef struct {
    PyObject_HEAD
    PyObject *children; /* the only child (a node), a dict of them, or NULL */
    PyObject *hash, *input, *mkey;
} kvc_node_head;

typedef struct {
    unsigned version, size;
    PyTypeObject *type;
    /* The child keyed `key` (borrowed), or NULL: none, or an error (*err). */
    PyObject *(*memo_child)(PyObject *node, uint64_t key, int *err);
} kvc_node_api;

#endif
