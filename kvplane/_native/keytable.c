/*
 * The offload host index's prefix-hash table: int64 key -> block id, open addressing with linear probing.
 *
 * The table is two int64 arrays the caller owns (numpy): keys and vals, of a power-of-two capacity; a slot is
 * empty where vals is -1 (a key may be any int64, a block id is never negative). The caller sizes it to at
 * least twice the blocks that can be keyed at once (one key per block), so it never fills and never grows.
 * Deletion shifts later entries of the probe run back (no tombstones), so lookups stay short however many
 * keys come and go. Every call works on a whole request's hashes in one C pass: where Python's dict costs a
 * few cold cache misses per block (hash, entry, key object), a probe here touches one 16-byte slot.
 *
 * get(keys, vals, hashes, out):                         out[i] = the block keyed by hashes[i], or -1
 * cache(keys, vals, key_of, hashed, ids, hashes, out):  key block ids[i] by hashes[i], in order, exactly as
 *     one call per block would: a hash another block holds is left alone (out[i] = whether that block is
 *     ids[i]); a block keyed before under another hash loses that key; key_of / hashed (int64 / uint8 per
 *     block) are kept up to date.
 * forget(keys, vals, key_of, hashed, ids):             drop the keys of blocks ids (each keyed) and unmark them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    int64_t *keys, *vals;
    uint64_t mask;
    int shift;
} table_t;

static inline uint64_t slot_of(const table_t *t, int64_t key) {
    return ((uint64_t)key * 0x9E3779B97F4A7C15ull) >> t->shift; /* Fibonacci hashing: small keys spread too */
}

static int64_t find(const table_t *t, int64_t key) {
    for (uint64_t i = slot_of(t, key);; i = (i + 1) & t->mask) {
        if (t->vals[i] < 0) return -1;
        if (t->keys[i] == key) return (int64_t)i;
    }
}

static void insert(table_t *t, int64_t key, int64_t val) { /* key absent; the table never fills */
    uint64_t i = slot_of(t, key);
    while (t->vals[i] >= 0) i = (i + 1) & t->mask;
    t->keys[i] = key;
    t->vals[i] = val;
}

static void erase(table_t *t, uint64_t hole) { /* backward-shift deletion for linear probing */
    uint64_t j = hole;
    for (;;) {
        j = (j + 1) & t->mask;
        if (t->vals[j] < 0) break;
        uint64_t home = slot_of(t, t->keys[j]);
        /* entry j may move into the hole unless its home lies cyclically in (hole, j] */
        int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            t->keys[hole] = t->keys[j];
            t->vals[hole] = t->vals[j];
            hole = j;
        }
    }
    t->vals[hole] = -1;
}

static int get_buffer(PyObject *obj, Py_buffer *view, const char *name, int flags, Py_ssize_t itemsize) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "keytable: %s must be a contiguous array of %zd-byte items", name, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Parse the arrays of one call: names[i] is argument i, writable[i] whether it is written, size[i] its item
 * bytes; the first two are always the table. Returns the number of buffers acquired (all on success). */
static int parse(PyObject *args, int n, const char **names, const int *writable, const Py_ssize_t *size,
                 Py_buffer *v, table_t *t) {
    if (PyTuple_GET_SIZE(args) != n) {
        PyErr_Format(PyExc_TypeError, "keytable: expected %d arrays, got %zd", n, PyTuple_GET_SIZE(args));
        return 0;
    }
    int got = 0;
    for (; got < n; got++) {
        if (get_buffer(PyTuple_GET_ITEM(args, got), &v[got], names[got], writable[got] ? PyBUF_WRITABLE : 0,
                       size[got]) != 0)
            return got;
    }
    Py_ssize_t cap = v[0].len / 8;
    if (cap < 2 || (cap & (cap - 1)) || v[1].len != v[0].len) {
        PyErr_SetString(PyExc_ValueError, "keytable: keys and vals must be equal int64 arrays of a power-of-two size");
        return got;
    }
    t->keys = v[0].buf;
    t->vals = v[1].buf;
    t->mask = (uint64_t)cap - 1;
    t->shift = 64 - __builtin_ctzll((unsigned long long)cap);
    return got;
}

static void release(Py_buffer *v, int got) {
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
}

static PyObject *kt_get(PyObject *self, PyObject *args) {
    static const char *names[] = {"keys", "vals", "hashes", "out"};
    static const int writable[] = {0, 0, 0, 1};
    static const Py_ssize_t size[] = {8, 8, 8, 8};
    Py_buffer v[4];
    table_t t;
    int got = parse(args, 4, names, writable, size, v, &t);
    if (got < 4 || PyErr_Occurred()) goto fail;
    Py_ssize_t n = v[2].len / 8;
    if (v[3].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "keytable.get: out must be as long as hashes");
        goto fail;
    }
    const int64_t *h = v[2].buf;
    int64_t *out = v[3].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = find(&t, h[i]);
        out[i] = s < 0 ? -1 : t.vals[s];
    }
    release(v, got);
    Py_RETURN_NONE;
fail:
    release(v, got);
    return NULL;
}

static PyObject *kt_cache(PyObject *self, PyObject *args) {
    static const char *names[] = {"keys", "vals", "key_of", "hashed", "ids", "hashes", "out"};
    static const int writable[] = {1, 1, 1, 1, 0, 0, 1};
    static const Py_ssize_t size[] = {8, 8, 8, 1, 8, 8, 1};
    Py_buffer v[7];
    table_t t;
    int got = parse(args, 7, names, writable, size, v, &t);
    if (got < 7 || PyErr_Occurred()) goto fail;
    Py_ssize_t blocks = v[2].len / 8, n = v[4].len / 8;
    if (v[3].len != blocks || v[5].len / 8 != n || v[6].len != n) {
        PyErr_SetString(PyExc_ValueError, "keytable.cache: key_of/hashed per block, ids/hashes/out per item");
        goto fail;
    }
    int64_t *key_of = v[2].buf;
    uint8_t *hashed = v[3].buf, *out = v[6].buf;
    const int64_t *ids = v[4].buf, *h = v[5].buf;
    for (Py_ssize_t i = 0; i < n; i++) { /* the caller checked every id against the pool */
        int64_t b = ids[i];
        if (b < 0 || b >= blocks) {
            PyErr_Format(PyExc_ValueError, "keytable.cache: block id %lld is out of range", (long long)b);
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i], s = find(&t, h[i]);
        if (s >= 0) {
            out[i] = t.vals[s] == b;
            continue;
        }
        if (hashed[b]) {
            int64_t old = find(&t, key_of[b]);
            if (old >= 0) erase(&t, (uint64_t)old);
        }
        key_of[b] = h[i];
        hashed[b] = 1;
        insert(&t, h[i], b);
        out[i] = 1;
    }
    release(v, got);
    Py_RETURN_NONE;
fail:
    release(v, got);
    return NULL;
}

static PyObject *kt_forget(PyObject *self, PyObject *args) {
    static const char *names[] = {"keys", "vals", "key_of", "hashed", "ids"};
    static const int writable[] = {1, 1, 0, 1, 0};
    static const Py_ssize_t size[] = {8, 8, 8, 1, 8};
    Py_buffer v[5];
    table_t t;
    int got = parse(args, 5, names, writable, size, v, &t);
    if (got < 5 || PyErr_Occurred()) goto fail;
    Py_ssize_t blocks = v[2].len / 8, n = v[4].len / 8;
    if (v[3].len != blocks) {
        PyErr_SetString(PyExc_ValueError, "keytable.forget: key_of and hashed must have one item per block");
        goto fail;
    }
    const int64_t *key_of = v[2].buf, *ids = v[4].buf;
    uint8_t *hashed = v[3].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (b < 0 || b >= blocks) {
            PyErr_Format(PyExc_ValueError, "keytable.forget: block id %lld is out of range", (long long)b);
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (!hashed[b]) continue;
        int64_t s = find(&t, key_of[b]);
        if (s >= 0 && t.vals[s] == b) erase(&t, (uint64_t)s);
        hashed[b] = 0;
    }
    release(v, got);
    Py_RETURN_NONE;
fail:
    release(v, got);
    return NULL;
}

static PyMethodDef methods[] = {
    {"get", kt_get, METH_VARARGS, "get(keys, vals, hashes, out): the block keyed by each hash, -1 where none"},
    {"cache", kt_cache, METH_VARARGS, "cache(keys, vals, key_of, hashed, ids, hashes, out): key blocks in order"},
    {"forget", kt_forget, METH_VARARGS, "forget(keys, vals, key_of, hashed, ids): drop the keys of blocks"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keytable", "int64 prefix-hash table", -1, methods};

PyMODINIT_FUNC PyInit__keytable(void) { return PyModule_Create(&module); }
