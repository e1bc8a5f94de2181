/* kvcached._tree_node: the prefix tree's Node (kvcached.tree) as a C type.
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
 * The attributes are kvcached.tree.PyNode's, with the same meaning: plain
 * object slots. PyNode is the fallback when this cannot be built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *hash, *parent, *children, *state, *gpu, *cpu, *in_storage, *ref, *last_access,
        *depth, *n_gpu_children, *n_cpu_children, *busy, *gpu_key, *cpu_key, *input, *mkey;
} Node;

static PyTypeObject NodeType;
static PyObject *default_state; /* Tier.STORAGE, set by set_default_state() */
static Py_ssize_t live_nodes;   /* allocated and not yet freed: leak checks */

#define MEMBER(name, doc) {#name, T_OBJECT_EX, offsetof(Node, name), 0, doc}
static PyMemberDef node_members[] = {
    MEMBER(hash, "block hash (bytes)"),
    MEMBER(parent, "parent Node, None for the root"),
    MEMBER(children, "dict: child hash -> Node"),
    MEMBER(state, "tier state (kvcached.tree.Tier)"),
    MEMBER(gpu, "GPU block id, -1 if none"),
    MEMBER(cpu, "CPU block id, -1 if none"),
    MEMBER(in_storage, "True when the block is in storage"),
    MEMBER(ref, "running requests using the node"),
    MEMBER(last_access, "manager clock of the last use"),
    MEMBER(depth, "blocks from the root"),
    MEMBER(n_gpu_children, "children in state GPU or SWAP_IN"),
    MEMBER(n_cpu_children, "children holding a CPU block"),
    MEMBER(busy, "background tasks reading the node's blocks"),
    MEMBER(gpu_key, "live key in the GPU LRU, or None"),
    MEMBER(cpu_key, "live key in the CPU LRU, or None"),
    MEMBER(input, "the bytes hashed into hash (the memo), or None"),
    MEMBER(mkey, "memo key while in the tree, or None"),
    {NULL, 0, 0, 0, NULL},
};

static PyObject *node_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"h", "parent", "depth", NULL};
    PyObject *h, *parent, *depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:Node", kwlist, &h, &parent, &depth))
        return NULL;
    if (default_state == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvcached._tree_node: set_default_state() not called");
        return NULL;
    }
    PyObject *children = PyDict_New();
    if (children == NULL)
        return NULL;
    Node *self = (Node *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(children);
        return NULL;
    }
    live_nodes++;
    PyObject *zero = PyLong_FromLong(0), *minus_one = PyLong_FromLong(-1); /* cached small ints */
    self->hash = Py_NewRef(h);
    self->parent = Py_NewRef(parent);
    self->children = children;
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
    self->gpu_key = Py_NewRef(Py_None);
    self->cpu_key = Py_NewRef(Py_None);
    self->input = Py_NewRef(Py_None);
    self->mkey = Py_NewRef(Py_None);
    return (PyObject *)self;
}

/* Every member but parent. */
static void node_clear(Node *self) {
    Py_CLEAR(self->hash);
    Py_CLEAR(self->children);
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
    Py_CLEAR(self->gpu_key);
    Py_CLEAR(self->cpu_key);
    Py_CLEAR(self->input);
    Py_CLEAR(self->mkey);
}

static void node_dealloc(PyObject *op) {
    Node *self = (Node *)op;
    for (;;) {
        PyObject *parent = self->parent;
        self->parent = NULL;
        node_clear(self);
        Py_TYPE(self)->tp_free((PyObject *)self);
        live_nodes--;
#if !defined(Py_REF_DEBUG) && !defined(Py_GIL_DISABLED) /* plain refcounts only */
        /* Dropping the last reference to the parent would free it from inside
         * this call, and its parent from inside that one: a chain dropped at
         * once (a pruned memo) would recurse as deep as it is long. Free such
         * a parent in this loop instead (the collector's trashcan, which
         * bounds this for GC types, does not apply to this one). */
        if (parent != NULL && Py_IS_TYPE(parent, &NodeType) && Py_REFCNT(parent) == 1) {
            Py_SET_REFCNT(parent, 0);
            self = (Node *)parent;
            continue;
        }
#endif
        Py_XDECREF(parent);
        return;
    }
}

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

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcached._tree_node.Node",
    .tp_basicsize = sizeof(Node),
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no HAVE_GC: see the file comment; no BASETYPE:
                                       a Python subclass would be tracked again */
    .tp_doc = "One cached block of the prefix tree (kvcached.tree); not GC-tracked.",
    .tp_new = node_new,
    .tp_dealloc = node_dealloc,
    .tp_repr = node_repr,
    .tp_members = node_members,
};

static PyObject *set_default_state(PyObject *self, PyObject *state) {
    Py_XSETREF(default_state, Py_NewRef(state));
    Py_RETURN_NONE;
}

static PyObject *live(PyObject *self, PyObject *unused) {
    return PyLong_FromSsize_t(live_nodes);
}

static PyMethodDef methods[] = {
    {"live", live, METH_NOARGS, "Nodes allocated and not yet freed (for leak tests)."},
    {"set_default_state", set_default_state, METH_O,
     "The state every new Node starts in (kvcached.tree sets Tier.STORAGE)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tree_node", "kvcached's prefix-tree node type.", -1, methods,
};

PyMODINIT_FUNC PyInit__tree_node(void) {
    if (PyType_Ready(&NodeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Node", (PyObject *)&NodeType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
