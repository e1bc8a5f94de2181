/* What kvcached._tree_node exports, as a capsule, to kvcached._block_hash's
 * memo walk: native nodes are read directly, without a Python call per
 * block. Both extensions include this header, and its text is part of both
 * builds' cache keys; version and size still guard builds loaded separately. */
#ifndef KVC_NODE_API_H
#define KVC_NODE_API_H

#include <Python.h>
#include <stdint.h>

#define KVC_NODE_API_VERSION 2
#define KVC_NODE_API_CAPSULE "kvcached._tree_node.node_api"

typedef struct {
    unsigned version, size;
    PyTypeObject *type;
    /* All borrowed references, or NULL. */
    PyObject *(*memo_child)(PyObject *node, uint64_t key, int *err); /* the child keyed key */
    PyObject *(*only_child)(PyObject *node); /* the child where there is exactly one */
    PyObject *(*input)(PyObject *node);
    PyObject *(*hash)(PyObject *node);
    PyObject *(*mkey)(PyObject *node);
} kvc_node_api;

#endif
