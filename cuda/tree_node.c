/* kvcached._tree_node: the prefix tree's Node (kvcached.core.tree) as a C type.
 *
 * Why: a cache holds up to millions of nodes. As Python objects, every node
 * and its children dict is tracked by the cyclic garbage collector, so each
 * full collection walks all of them: 0.9 s at 1M cached blocks, in the
 * engine's scheduler thread, and young collections during commits cost ~0.25
 * us per prompt block in the chat replay. This type is not GC-tracked (no
 * Py_TPFLAGS_HAVE_GC), and a dict that holds only such nodes stays untracked
 * too, so the collector never sees the tree.
 *
 * The price: the collector cannot free parent <-> child cycles, so the tree
 * breaks them itself (BlockTree.remove empties removed nodes' children,
 * BlockTree.__del__ unlinks every node).
 *
 * Children are not a dict per node: most nodes are links of a chain, with
 * one child, so `children` is NULL (a leaf), that child itself, or a dict
 * hash -> Node only where the tree branches. That saves ~280 bytes per cached
 * block, and the dict allocations that made commits trigger young
 * collections. Python reaches them through child(), link_child(),
 * unlink_child(), child_nodes(), unlink_children() and n_children. The hash
 * memo walks the tree by memo key (memo_child): a branching node also keeps
 * `bykey`, its children by their mkey (set before they are linked).
 *
 * The other attributes are kvcached.core.tree.PyNode's, with the same meaning:
 * plain object slots. PyNode is the fallback when this cannot be built.
 */
#include "tree_node.h"
#include <structmember.h>
static PyObject *default_state; /* Tier.STORAGE, set by set_default_state() */
static Py_ssize_t live_nodes;   /* allocated and not yet freed: leak checks */

#define MEMBER(name, doc) {#name, T_OBJECT_EX, offsetof(Node, name), 0, doc}
static PyMemberDef node_members[] = {
    MEMBER(hash, "block hash (bytes)"),
    MEMBER(parent, "parent Node, None for the root"),
    MEMBER(state, "tier state (kvcached.core.tree.Tier)"),
    MEMBER(gpu, "GPU block id, -1 if none"),
    MEMBER(cpu, "CPU block id, -1 if none"),
    MEMBER(in_storage, "True when the block is in storage"),
    MEMBER(ref, "running requests using the node"),
    MEMBER(last_access, "manager clock of the last use"),
    MEMBER(depth, "blocks from the root"),
    MEMBER(n_gpu_children, "children in state GPU or SWAP_IN"),
    MEMBER(n_cpu_children, "children holding a CPU block"),
    MEMBER(busy, "background tasks reading the node's blocks"),
    MEMBER(input, "the bytes hashed into hash (the memo), or None"),
    {NULL, 0, 0, 0, NULL},
};

/* Node(h, parent, depth) with every other attribute at its default. */
static Node *make_node(PyTypeObject *type, PyObject *h, PyObject *parent, PyObject *depth) {
    if (default_state == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvcached._tree_node: set_default_state() not called");
        return NULL;
    }
    Node *self = (Node *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    live_nodes++;
    PyObject *zero = PyLong_FromLong(0), *minus_one = PyLong_FromLong(-1); /* cached small ints */
    self->hash = Py_NewRef(h);
    self->parent = Py_NewRef(parent);
    self->children = self->bykey = NULL;
    self->state = Py_NewRef(default_state);
    self->gpu = Py_NewRef(minus_one);
    self->cpu = minus_one;
    self->in_storage = Py_NewRef(Py_False);
    self->ref = Py_NewRef(zero);
    self->last_access = Py_NewRef(zero);
    self->depth = Py_NewRef(depth);
    self->n_gpu_children = Py_NewRef(zero);
    self->n_cpu_children = Py_NewRef(zero);
    self->busy = zero;
    self->lru[LRU_GPU].listed = self->lru[LRU_CPU].listed = 0;
    self->input = Py_NewRef(Py_None);
    self->mkey = Py_NewRef(Py_None);
    self->has_mkey = 0;
    return self;
}

static PyObject *node_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"h", "parent", "depth", NULL};
    PyObject *h, *parent, *depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:Node", kwlist, &h, &parent, &depth))
        return NULL;
    return (PyObject *)make_node(type, h, parent, depth);
}

/* Every member but parent and children. */
static void node_clear(Node *self) {
    Py_CLEAR(self->hash);
    Py_CLEAR(self->state);
    Py_CLEAR(self->gpu);
    Py_CLEAR(self->cpu);
    Py_CLEAR(self->in_storage);
    Py_CLEAR(self->ref);
    Py_CLEAR(self->last_access);
    Py_CLEAR(self->depth);
    Py_CLEAR(self->n_gpu_children);
    Py_CLEAR(self->n_cpu_children);
    Py_CLEAR(self->busy);
    Py_CLEAR(self->input);
    Py_CLEAR(self->mkey);
}

/* Dropping a node's last reference frees it; that drops its parent's or
 * its single child's, and so on: a chain dropped at once (a removed
 * subtree, a dropped tree) would recurse as deep as it is long. Nodes are
 * freed from a work stack instead (the collector's trashcan, which bounds
 * this for GC types, does not apply to this one). Only where refcounts are
 * plain: debug and free-threaded builds take the recursive path. */
#define DEALLOC_STACK 64

/* The last reference to `o` is ours: hand it back, or queue a Node for freeing. */
static void release(PyObject *o, Node ***stack, size_t *n, size_t *cap, Node **local) {
    if (o == NULL)
        return;
#if !defined(Py_REF_DEBUG) && !defined(Py_GIL_DISABLED)
    if (Py_IS_TYPE(o, &NodeType) && Py_REFCNT(o) == 1) {
        if (*n == *cap) {
            size_t grown = *cap * 2;
            Node **bigger = PyMem_Malloc(grown * sizeof(Node *));
            if (bigger == NULL) {
                Py_DECREF(o); /* out of memory: recurse instead */
                return;
            }
            memcpy(bigger, *stack, *n * sizeof(Node *));
            if (*stack != local)
                PyMem_Free(*stack);
            *stack = bigger;
            *cap = grown;
        }
        Py_SET_REFCNT(o, 0);
        (*stack)[(*n)++] = (Node *)o;
        return;
    }
#else
    (void)stack, (void)n, (void)cap, (void)local;
#endif
    Py_DECREF(o);
}

static void node_dealloc(PyObject *op) {
    Node *local[DEALLOC_STACK], **stack = local;
    size_t n = 0, cap = DEALLOC_STACK;
    stack[n++] = (Node *)op;
    while (n > 0) {
        Node *self = stack[--n];
        PyObject *parent = self->parent, *children = self->children;
        self->parent = self->children = NULL;
        Py_CLEAR(self->bykey);
        node_clear(self);
        Py_TYPE(self)->tp_free((PyObject *)self);
        live_nodes--;
        release(parent, &stack, &n, &cap, local);
        release(children, &stack, &n, &cap, local); /* a dict frees its nodes itself */
    }
    if (stack != local)
        PyMem_Free(stack);
}

/* ------------------------------------------------------------ children */

/* Whether `child` (a Node) is stored under `h`: its own hash. -1 on error. */
static int keyed_by(PyObject *child, PyObject *h) {
    PyObject *own = ((Node *)child)->hash;
    if (own == h)
        return 1;
    if (own == NULL)
        return 0;
    if (PyBytes_CheckExact(own) && PyBytes_CheckExact(h))
        return PyBytes_GET_SIZE(own) == PyBytes_GET_SIZE(h) &&
               memcmp(PyBytes_AS_STRING(own), PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h)) == 0;
    return PyObject_RichCompareBool(own, h, Py_EQ);
}

/* The child under h (a new reference), None, or NULL with an error. */
static PyObject *child_of(Node *self, PyObject *h) {
    PyObject *c = self->children;
    if (c == NULL)
        Py_RETURN_NONE;
    if (is_node(c)) {
        int eq = keyed_by(c, h);
        if (eq < 0)
            return NULL;
        return Py_NewRef(eq ? c : Py_None);
    }
    PyObject *found = PyDict_GetItemWithError(c, h);
    if (found == NULL && PyErr_Occurred())
        return NULL;
    return Py_NewRef(found ? found : Py_None);
}

static PyObject *node_child(PyObject *op, PyObject *h) { return child_of((Node *)op, h); }

/* A branching node finds its children by memo key too: bykey[child.mkey]. */
static int index_key(Node *self, PyObject *child) {
    PyObject *key = is_node(child) ? ((Node *)child)->mkey : NULL;
    if (key == NULL || key == Py_None)
        return 0;
    if (self->bykey == NULL && (self->bykey = PyDict_New()) == NULL)
        return -1;
    return PyDict_SetItem(self->bykey, key, child);
}

static int unindex_key(Node *self, PyObject *child) {
    PyObject *key = is_node(child) ? ((Node *)child)->mkey : NULL;
    if (key == NULL || key == Py_None || self->bykey == NULL)
        return 0;
    PyObject *there = PyDict_GetItemWithError(self->bykey, key);
    if (there == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return there == child ? PyDict_DelItem(self->bykey, key) : 0;
}

/* The child whose memo key (mkey) is `key` (borrowed), or NULL: none, or an
 * error (-1 in *err). The hash memo's walk (cuda/block_hash.c, chain_memo)
 * asks each block's node for the next one, through the capsule below: a
 * chain link compares the unboxed key, only a branching node makes an int. */
static PyObject *memo_child_raw(PyObject *op, uint64_t key, int *err) {
    Node *self = (Node *)op;
    PyObject *c = self->children;
    *err = 0;
    if (is_node(c))
        return ((Node *)c)->has_mkey && ((Node *)c)->mkey_raw == key ? c : NULL;
    if (c == NULL || self->bykey == NULL)
        return NULL;
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    PyObject *found = k == NULL ? NULL : PyDict_GetItemWithError(self->bykey, k);
    Py_XDECREF(k);
    if (found == NULL && PyErr_Occurred())
        *err = -1;
    return found;
}

/* The same for Python (tests, the invariant check): None when there is none. */
static PyObject *node_memo_child(PyObject *op, PyObject *key) {
    uint64_t k = PyLong_AsUnsignedLongLong(key);
    if (k == (uint64_t)-1 && PyErr_Occurred()) { /* not a memo key: nothing is under it */
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) &&
            !PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int err;
    PyObject *found = memo_child_raw(op, k, &err);
    if (err < 0)
        return NULL;
    return Py_NewRef(found ? found : Py_None);
}

static int link_child(Node *self, PyObject *h, PyObject *child);

static PyObject *node_link_child(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "link_child(h, node) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    if (link_child((Node *)op, args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Store child under h (replacing one stored there); -1 on error. */
static int link_child(Node *self, PyObject *h, PyObject *child) {
    PyObject *c = self->children;
    if (c == NULL && is_node(child)) {
        int eq = keyed_by(child, h);
        if (eq < 0)
            return -1;
        if (eq) { /* the common case: one child, under its own hash */
            self->children = Py_NewRef(child);
            return 0;
        }
    }
    if (c == NULL || is_node(c)) { /* the tree branches here: dicts from now on */
        PyObject *d = PyDict_New();
        if (d == NULL || (c != NULL && (PyDict_SetItem(d, ((Node *)c)->hash, c) < 0 ||
                                        index_key(self, c) < 0))) {
            Py_XDECREF(d);
            return -1;
        }
        Py_XSETREF(self->children, d);
        c = d;
    }
    PyObject *old = PyDict_GetItemWithError(c, h);
    if (old == NULL && PyErr_Occurred())
        return -1;
    Py_XINCREF(old);
    int rc = (old != NULL ? unindex_key(self, old) : 0) < 0 || PyDict_SetItem(c, h, child) < 0 ||
             index_key(self, child) < 0;
    Py_XDECREF(old);
    return rc ? -1 : 0;
}

/* Remove the child under h; -1 with KeyError if there is none. */
int kvc_unlink_child(Node *self, PyObject *h) {
    PyObject *c = self->children;
    if (is_node(c)) {
        int eq = keyed_by(c, h);
        if (eq < 0)
            return -1;
        if (eq) {
            Py_CLEAR(self->children);
            return 0;
        }
    } else if (c != NULL) {
        PyObject *child = PyDict_GetItemWithError(c, h);
        if (child == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, h);
            return -1;
        }
        Py_INCREF(child);
        int rc = unindex_key(self, child) < 0 || PyDict_DelItem(c, h) < 0;
        Py_DECREF(child);
        if (rc)
            return -1;
        if (PyDict_GET_SIZE(c) == 0) {
            Py_CLEAR(self->children);
            Py_CLEAR(self->bykey);
        }
        return 0;
    }
    PyErr_SetObject(PyExc_KeyError, h);
    return -1;
}

static PyObject *node_unlink_child(PyObject *op, PyObject *h) {
    if (kvc_unlink_child((Node *)op, h) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *node_child_nodes(PyObject *op, PyObject *unused) {
    PyObject *c = ((Node *)op)->children;
    if (c == NULL)
        return PyList_New(0);
    if (is_node(c)) {
        PyObject *one = PyList_New(1);
        if (one != NULL)
            PyList_SET_ITEM(one, 0, Py_NewRef(c));
        return one;
    }
    return PyDict_Values(c);
}

static PyObject *node_unlink_children(PyObject *op, PyObject *unused) {
    Py_CLEAR(((Node *)op)->bykey);
    Py_CLEAR(((Node *)op)->children);
    Py_RETURN_NONE;
}

static PyObject *node_n_children(PyObject *op, void *closure) {
    PyObject *c = ((Node *)op)->children;
    return PyLong_FromSsize_t(c == NULL ? 0 : is_node(c) ? 1 : PyDict_GET_SIZE(c));
}

static PyMethodDef node_methods[] = {
    {"child", node_child, METH_O, "The child stored under hash h, or None."},
    {"link_child", (PyCFunction)(void (*)(void))node_link_child, METH_FASTCALL,
     "Store node as the child under hash h (replacing one stored there)."},
    {"unlink_child", node_unlink_child, METH_O,
     "Remove the child under hash h (KeyError if there is none)."},
    {"memo_child", node_memo_child, METH_O,
     "The child whose memo key (mkey) is key, or None (the hash memo's walk)."},
    {"child_nodes", node_child_nodes, METH_NOARGS, "The children, as a new list."},
    {"unlink_children", node_unlink_children, METH_NOARGS, "Drop every child."},
    {NULL, NULL, 0, NULL},
};

static PyObject *node_get_mkey(PyObject *op, void *closure) {
    PyObject *v = ((Node *)op)->mkey;
    if (v == NULL)
        PyErr_SetString(PyExc_AttributeError, "mkey");
    return Py_XNewRef(v);
}

/* None, or an int in [0, 2**64): kept boxed (bykey, Python) and unboxed (the walk). */
static int node_set_mkey(PyObject *op, PyObject *value, void *closure) {
    Node *self = (Node *)op;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "mkey cannot be deleted; set it to None");
        return -1;
    }
    uint64_t raw = 0;
    if (value != Py_None) {
        if (!PyLong_Check(value)) {
            PyErr_Format(PyExc_TypeError, "mkey must be an int or None, got %.100s",
                         Py_TYPE(value)->tp_name);
            return -1;
        }
        raw = PyLong_AsUnsignedLongLong(value);
        if (raw == (uint64_t)-1 && PyErr_Occurred())
            return -1;
    }
    Py_XSETREF(self->mkey, Py_NewRef(value));
    self->mkey_raw = raw;
    self->has_mkey = value != Py_None;
    return 0;
}

/* gpu_key / cpu_key (closure: LRU_GPU / LRU_CPU): the node's live key in
 * that tier's LeafLRU as one int, ``(hi << 64) | lo``, or None. Setting None
 * unlists the node (the caller adjusts the LRU's size, as with PyNode);
 * setting a key lists it under that key (undoing an unlist: the heap still
 * holds the entry). The hot paths use the C fields directly. */
static PyObject *node_get_key(PyObject *op, void *closure) {
    lru_slot *k = &((Node *)op)->lru[(intptr_t)closure];
    if (!k->listed)
        Py_RETURN_NONE;
    PyObject *hi = PyLong_FromUnsignedLongLong(k->hi), *lo = PyLong_FromUnsignedLongLong(k->lo);
    PyObject *shift = PyLong_FromLong(64), *up = NULL, *out = NULL;
    if (hi && lo && shift && (up = PyNumber_Lshift(hi, shift)) != NULL)
        out = PyNumber_Or(up, lo);
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(shift);
    Py_XDECREF(up);
    return out;
}

static int node_set_key(PyObject *op, PyObject *value, void *closure) {
    lru_slot *k = &((Node *)op)->lru[(intptr_t)closure];
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "an LRU key cannot be deleted; set it to None");
        return -1;
    }
    if (value == Py_None) {
        k->listed = 0;
        return 0;
    }
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "an LRU key must be an int or None, got %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    PyObject *shift = PyLong_FromLong(64), *hi_obj = NULL;
    uint64_t lo = PyLong_AsUnsignedLongLongMask(value), hi = (uint64_t)-1;
    if (shift != NULL && (hi_obj = PyNumber_Rshift(value, shift)) != NULL)
        hi = PyLong_AsUnsignedLongLong(hi_obj); /* OverflowError when negative or >= 2**128 */
    Py_XDECREF(shift);
    Py_XDECREF(hi_obj);
    if (hi == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    k->hi = hi;
    k->lo = lo;
    k->listed = 1;
    return 0;
}

static PyGetSetDef node_getset[] = {
    {"gpu_key", node_get_key, node_set_key, "live key in the GPU LRU, or None",
     (void *)(intptr_t)LRU_GPU},
    {"cpu_key", node_get_key, node_set_key, "live key in the CPU LRU, or None",
     (void *)(intptr_t)LRU_CPU},
    {"n_children", node_n_children, NULL, "how many children the node has", NULL},
    {"mkey", node_get_mkey, node_set_mkey, "memo key while in the tree (an int), or None",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* Node(1a2b3c4d GPU gpu=3 cpu=-1 ref=1 t=7 d=2), like PyNode's repr. */
static PyObject *node_repr(PyObject *op) {
    Node *self = (Node *)op;
    PyObject *hex = NULL, *name = NULL, *out = NULL;
    if (!self->hash || !self->state || !self->gpu || !self->cpu || !self->ref ||
        !self->last_access || !self->depth)
        return PyUnicode_FromString("Node(<deleted attributes>)");
    hex = PyObject_CallMethod(self->hash, "hex", NULL);
    if (hex == NULL)
        return NULL;
    PyObject *short_hex = PyUnicode_Substring(hex, 0, 8);
    Py_DECREF(hex);
    if (short_hex == NULL)
        return NULL;
    name = PyObject_GetAttrString(self->state, "name");
    if (name == NULL) {
        PyErr_Clear();
        name = PyObject_Str(self->state);
    }
    if (name != NULL)
        out = PyUnicode_FromFormat("Node(%U %U gpu=%R cpu=%R ref=%R t=%R d=%R)", short_hex, name,
                                   self->gpu, self->cpu, self->ref, self->last_access,
                                   self->depth);
    Py_DECREF(short_hex);
    Py_XDECREF(name);
    return out;
}

PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcached._tree_node.Node",
    .tp_basicsize = sizeof(Node),
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no HAVE_GC: see the file comment; no BASETYPE:
                                       a Python subclass would be tracked again */
    .tp_doc = "One cached block of the prefix tree (kvcached.core.tree); not GC-tracked.",
    .tp_new = node_new,
    .tp_dealloc = node_dealloc,
    .tp_repr = node_repr,
    .tp_members = node_members,
    .tp_methods = node_methods,
    .tp_getset = node_getset,
};

/* --------------------------------------------------------- match_ref */

/* A list with room for `cap` items and none in it yet: a loop fills it with
 * list_push (at most cap items) without the list growing step by step. */
static inline PyObject *list_with_room(Py_ssize_t cap) {
    PyObject *l = PyList_New(cap > 0 ? cap : 0);
    if (l != NULL)
        Py_SET_SIZE(l, 0);
    return l;
}

static inline void list_push(PyObject *l, PyObject *item /* stolen */) {
    PyList_SET_ITEM(l, Py_SIZE(l), item);
    Py_SET_SIZE(l, Py_SIZE(l) + 1);
}

/* node.ref += 1; 1 if it was 0 before, 0 if not, -1 on error. */
static int ref_up(Node *node) {
    long v = kvc_long(node->ref);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *up = PyLong_FromLong(v + 1);
    if (up == NULL)
        return -1;
    Py_SETREF(node->ref, up);
    return v == 0;
}

/* Take node off LRU `which`: remember (node, key) in `unlisted`, unlist it. */
static int unlist(Node *node, int which, PyObject *unlisted) {
    PyObject *key = node_get_key((PyObject *)node, (void *)(intptr_t)which);
    PyObject *pair = key == NULL ? NULL : PyTuple_Pack(2, (PyObject *)node, key);
    Py_XDECREF(key);
    if (pair == NULL || PyList_Append(unlisted, pair) < 0) {
        Py_XDECREF(pair);
        return -1;
    }
    Py_DECREF(pair);
    node->lru[which].listed = 0;
    return 0;
}

/* CacheManager._match_ref's loop over native nodes (the Python loop there is
 * the reference, and runs for PyNode): reference the longest prefix of
 * `hashes[:limit]` whose nodes are in state `gpu`, then of those in state
 * `cpu`. Returns (nodes, n_gpu, idle, gpu_unlisted, cpu_unlisted, gpu_ids):
 * idle counts GPU nodes whose ref was 0; *_unlisted are the (node, key) pairs
 * taken off each LRU; gpu_ids the GPU nodes' block ids, the block table's head. */
static PyObject *match_ref(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !Py_IS_TYPE(args[0], &NodeType) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "match_ref(root: Node, hashes: list, limit, gpu_state, cpu_state)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    PyObject *hashes = args[1], *gpu = args[3], *cpu = args[4];
    limit = Py_MIN(limit, PyList_GET_SIZE(hashes));
    /* at most `limit` nodes and GPU ids: room for all of them up front */
    PyObject *out = list_with_room(limit), *gpu_unlisted = PyList_New(0),
             *cpu_unlisted = PyList_New(0), *gpu_ids = list_with_room(limit);
    Node *node = (Node *)Py_NewRef(args[0]);
    Py_ssize_t i = 0, idle = 0, n_gpu;
    if (!out || !gpu_unlisted || !cpu_unlisted || !gpu_ids)
        goto fail;
    for (; i < limit; i++) {
        PyObject *child = child_of(node, PyList_GET_ITEM(hashes, i));
        if (child == NULL)
            goto fail;
        if (!Py_IS_TYPE(child, &NodeType) || ((Node *)child)->state != gpu) {
            Py_DECREF(child);
            break;
        }
        Py_SETREF(node, (Node *)child);
        if (!node->ref || !node->gpu) {
            PyErr_SetString(PyExc_AttributeError, "match_ref: a node's attribute was deleted");
            goto fail;
        }
        int was_idle = ref_up(node);
        if (was_idle < 0 || (was_idle && node->lru[LRU_GPU].listed &&
                             unlist(node, LRU_GPU, gpu_unlisted) < 0))
            goto fail;
        idle += was_idle;
        list_push(out, Py_NewRef(node));
        list_push(gpu_ids, Py_NewRef(node->gpu));
    }
    n_gpu = PyList_GET_SIZE(out);
    for (; i < limit; i++) {
        PyObject *child = child_of(node, PyList_GET_ITEM(hashes, i));
        if (child == NULL)
            goto fail;
        if (!Py_IS_TYPE(child, &NodeType) || ((Node *)child)->state != cpu) {
            Py_DECREF(child);
            break;
        }
        Py_SETREF(node, (Node *)child);
        if (!node->ref) {
            PyErr_SetString(PyExc_AttributeError, "match_ref: a node's attribute was deleted");
            goto fail;
        }
        if ((node->lru[LRU_CPU].listed && unlist(node, LRU_CPU, cpu_unlisted) < 0) ||
            ref_up(node) < 0)
            goto fail;
        list_push(out, Py_NewRef(node));
    }
    Py_DECREF(node);
    return Py_BuildValue("(NnnNNN)", out, n_gpu, idle, gpu_unlisted, cpu_unlisted, gpu_ids);
fail:
    Py_XDECREF(node);
    Py_XDECREF(out);
    Py_XDECREF(gpu_unlisted);
    Py_XDECREF(cpu_unlisted);
    Py_XDECREF(gpu_ids);
    return NULL;
}

/* --------------------------------------------------------- unref_path */

/* An int attribute's sign: -1, 0 or 1; -2 with an error set. */
static int sign_of(PyObject *v) {
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "unref_path: a node's attribute was deleted");
        return -2;
    }
    long x;
    if (kvc_get(v, &x) < 0)
        return -2;
    return (x > 0) - (x < 0);
}

/* EvictionMixin._unref_path's loop over native nodes (unref_path_py in
 * kvcached/eviction.py is the reference, and runs for PyNode): deepest first,
 * ref -= 1 and last_access = clock on each node. Returns (idle, nodes):
 * how many GPU nodes became unreferenced, and the nodes whose LRU membership
 * may change (for _refresh), deepest first. */
static PyObject *unref_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "unref_path(nodes: list, clock, gpu_state)");
        return NULL;
    }
    PyObject *nodes = args[0], *clock = args[1], *gpu = args[2];
    PyObject *refresh = PyList_New(0);
    if (refresh == NULL)
        return NULL;
    Py_ssize_t idle = 0;
    for (Py_ssize_t i = PyList_GET_SIZE(nodes) - 1; i >= 0; i--) {
        PyObject *item = PyList_GET_ITEM(nodes, i);
        if (!Py_IS_TYPE(item, &NodeType)) {
            PyErr_SetString(PyExc_TypeError, "unref_path: nodes must be native Nodes");
            goto fail;
        }
        Node *n = (Node *)item;
        long ref;
        if (n->ref == NULL) {
            PyErr_SetString(PyExc_AttributeError, "unref_path: a node's ref was deleted");
            goto fail;
        }
        if (kvc_get(n->ref, &ref) < 0)
            goto fail;
        PyObject *down = PyLong_FromLong(ref - 1);
        if (down == NULL)
            goto fail;
        Py_SETREF(n->ref, down);
        Py_XSETREF(n->last_access, Py_NewRef(clock));
        int cpu = sign_of(n->cpu), cpu_kids = sign_of(n->n_cpu_children);
        if (cpu == -2 || cpu_kids == -2)
            goto fail;
        int no_backup = cpu < 0;
        if (ref - 1 != 0) { /* still held: only a backup's CPU LRU key can move */
            int busy = sign_of(n->busy);
            if (busy == -2)
                goto fail;
            if (no_backup || cpu_kids || busy)
                continue;
        } else {
            idle += n->state == gpu;
            int gpu_kids = sign_of(n->n_gpu_children);
            if (gpu_kids == -2)
                goto fail;
            if (gpu_kids && (no_backup || cpu_kids))
                continue; /* an inner node: in no LRU, before or after */
        }
        if (PyList_Append(refresh, (PyObject *)n) < 0)
            goto fail;
    }
    return Py_BuildValue("(nN)", idle, refresh);
fail:
    Py_DECREF(refresh);
    return NULL;
}

/* ---------------------------------------------------------- insert_new */

/* *slot += d for an int slot; -1 on error. */
int kvc_add_to(PyObject **slot, long d) {
    long v = kvc_long(*slot);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromLong(v + d);
    if (nv == NULL)
        return -1;
    Py_SETREF(*slot, nv);
    return 0;
}

/* One new node for block i under parent: state gpu_state, ref 1, GPU block
 * blocks[i], the memo record and key where records is a list; linked, and
 * counted in parent.n_gpu_children. A new reference, or NULL on error. */
static Node *new_gpu_child(Node *parent, PyObject *h, PyObject *block, PyObject *record,
                           PyObject *key, PyObject *gpu_state) {
    long d = kvc_long(parent->depth);
    PyObject *depth = d == -1 && PyErr_Occurred() ? NULL : PyLong_FromLong(d + 1);
    if (depth == NULL)
        return NULL;
    Node *node = make_node(&NodeType, h, (PyObject *)parent, depth);
    Py_DECREF(depth);
    if (node == NULL)
        return NULL;
    Py_SETREF(node->state, Py_NewRef(gpu_state));
    Py_SETREF(node->gpu, Py_NewRef(block));
    Py_SETREF(node->ref, PyLong_FromLong(1)); /* a cached small int: cannot fail */
    if (record != NULL)
        Py_SETREF(node->input, Py_NewRef(record));
    if ((record != NULL && node_set_mkey((PyObject *)node, key, NULL) < 0) ||
        link_child(parent, h, (PyObject *)node) < 0 ||
        kvc_add_to(&parent->n_gpu_children, 1) < 0) {
        Py_DECREF(node);
        return NULL;
    }
    return node;
}

/* CacheManager._insert's common case over native nodes (the Python loop
 * there is the reference, and the path for PyNode and for KV events): from
 * block `start`, while hashes[i] has no child under the current parent, a
 * new node (new_gpu_child) becomes the parent of the next and is appended
 * to `nodes`. The new nodes are referenced and so is their first parent (the
 * request's last node, or the root), so no LRU membership changes. Returns
 * (parent, i): i == stop, or the first block that has a node already, for
 * the Python loop to decide. records and keys are lists, or both None. */
static PyObject *insert_new(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 || !Py_IS_TYPE(args[0], &NodeType) || !PyList_Check(args[1]) ||
        !PyList_Check(args[4]) || !PyList_Check(args[8]) ||
        (args[2] == Py_None) != (args[3] == Py_None) ||
        (args[2] != Py_None && !(PyList_Check(args[2]) && PyList_Check(args[3])))) {
        PyErr_SetString(PyExc_TypeError,
                        "insert_new(parent: Node, hashes: list, records: list | None, "
                        "keys: list | None, blocks: list, start, stop, gpu_state, nodes: list)");
        return NULL;
    }
    PyObject *hashes = args[1], *records = args[2], *keys = args[3], *blocks = args[4],
             *gpu_state = args[7], *nodes = args[8];
    Py_ssize_t i = PyLong_AsSsize_t(args[5]), stop = PyLong_AsSsize_t(args[6]);
    if ((i == -1 || stop == -1) && PyErr_Occurred())
        return NULL;
    if (i < 0 || stop > PyList_GET_SIZE(hashes) || stop > PyList_GET_SIZE(blocks) ||
        (records != Py_None &&
         (stop > PyList_GET_SIZE(records) || stop > PyList_GET_SIZE(keys)))) {
        PyErr_Format(PyExc_IndexError, "insert_new: blocks [%zd, %zd) out of range", i, stop);
        return NULL;
    }
    Node *parent = (Node *)Py_NewRef(args[0]);
    for (; i < stop; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        PyObject *there = child_of(parent, h);
        if (there == NULL)
            goto fail;
        int taken = there != Py_None;
        Py_DECREF(there);
        if (taken)
            break;
        Node *node = new_gpu_child(parent, h, PyList_GET_ITEM(blocks, i),
                                   records == Py_None ? NULL : PyList_GET_ITEM(records, i),
                                   records == Py_None ? NULL : PyList_GET_ITEM(keys, i),
                                   gpu_state);
        if (node == NULL)
            goto fail;
        Py_SETREF(parent, node);
        if (PyList_Append(nodes, (PyObject *)node) < 0)
            goto fail;
    }
    return Py_BuildValue("(Nn)", (PyObject *)parent, i);
fail:
    Py_DECREF(parent);
    return NULL;
}

static PyObject *set_default_state(PyObject *self, PyObject *state) {
    Py_XSETREF(default_state, Py_NewRef(state));
    Py_RETURN_NONE;
}

static PyObject *live(PyObject *self, PyObject *unused) {
    return PyLong_FromSsize_t(live_nodes);
}

static PyMethodDef methods[] = {
    {"live", live, METH_NOARGS, "Nodes allocated and not yet freed (for leak tests)."},
    {"unref_path", (PyCFunction)(void (*)(void))unref_path, METH_FASTCALL,
     "EvictionMixin._unref_path's loop over native nodes (see the C comment)."},
    {"match_ref", (PyCFunction)(void (*)(void))match_ref, METH_FASTCALL,
     "CacheManager._match_ref's loop over native nodes (see the C comment)."},
    {"insert_new", (PyCFunction)(void (*)(void))insert_new, METH_FASTCALL,
     "CacheManager._insert's loop for new blocks over native nodes (see the C comment)."},
    {"set_default_state", set_default_state, METH_O,
     "The state every new Node starts in (kvcached.core.tree sets Tier.STORAGE)."},
    {NULL, NULL, 0, NULL},
};

/* What the memo walk calls (cuda/node_api.h); it reads kvc_node_head in place. */
static kvc_node_api node_api = {KVC_NODE_API_VERSION, sizeof(kvc_node_api), &NodeType,
                                memo_child_raw};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tree_node", "kvcached's prefix-tree node type.", -1, methods,
};

PyMODINIT_FUNC PyInit__tree_node(void) {
    if (PyType_Ready(&NodeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *api = PyCapsule_New(&node_api, KVC_NODE_API_CAPSULE, NULL);
    if (PyModule_AddObjectRef(m, "Node", (PyObject *)&NodeType) < 0 || api == NULL ||
        PyModule_AddObject(m, "node_api", api) < 0 || kvc_add_lru_types(m) < 0 ||
        kvc_add_evict_functions(m) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
