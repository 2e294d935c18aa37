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
 * get(keys, vals, hashes, out) -> (hits, first miss):   out[i] = the block keyed by hashes[i], or -1
 * from_list(hashes, out):                               a list of ints into an int64 array (no numpy pass)
 * span(ids) -> (min, max):                              the offload planner's range check, without numpy
 * cache(keys, vals, key_of, hashed, refs, ids, hashes, out) -> (error kind, at): key block ids[i] by
 *     hashes[i], in order, exactly as one call per block would: a hash another block holds is left alone
 *     (out[i] = whether that block is ids[i]); a block keyed before under another hash loses that key;
 *     key_of / hashed (int64 / uint8 per block) are kept up to date. (1, i): ids[i] is out of range; (3, b):
 *     block b is not referenced; then nothing changed.
 * forget(keys, vals, key_of, hashed, ids):             drop the keys of blocks ids (each keyed) and unmark them.
 *
 * Below the table, the pool around it (``KeyedPool``'s refcounts, free ring and LRU ring, described there):
 * unref, ref, allocate, oldest and evict, one C pass per call over the request's block ids.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

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
    Py_ssize_t hits = 0, first_miss = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = find(&t, h[i]);
        out[i] = s < 0 ? -1 : t.vals[s];
        if (s >= 0) hits++;
        else if (first_miss == n) first_miss = i;
    }
    release(v, got);
    return Py_BuildValue("(nn)", hits, first_miss);
fail:
    release(v, got);
    return NULL;
}

/* from_list(hashes, out): out[i] = hashes[i] for a list of ints; OverflowError names none (the caller does). */
static PyObject *kt_from_list(PyObject *self, PyObject *args) {
    PyObject *list, *obj;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &list, &obj)) return NULL;
    Py_buffer v;
    if (get_buffer(obj, &v, "out", PyBUF_WRITABLE, 8) != 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (v.len / 8 != n) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "keytable.from_list: out must be as long as the list");
        return NULL;
    }
    int64_t *out = v.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(list)) { /* an item's __index__ shrank the list: its items are gone */
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_RuntimeError, "keytable.from_list: the list changed size while it was read");
            return NULL;
        }
        PyObject *item = PyList_GET_ITEM(list, i);
        Py_INCREF(item); /* __index__ may drop the list's reference to it */
        /* not PyLong_AsLongLong: on Python 3.11 it converts an int of more than one digit (any hash above 2**30)
         * byte by byte through _PyLong_AsByteArray, about 30 ns each, where this one shifts its digits in */
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(item, &overflow);
        Py_DECREF(item);
        if (overflow) {
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_OverflowError, "keytable.from_list: an item does not fit in int64");
            return NULL;
        }
        if (x == -1 && PyErr_Occurred()) {
            PyBuffer_Release(&v);
            return NULL;
        }
        out[i] = (int64_t)x;
    }
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* span(ids) -> (min, max) of a non-empty int64 array: a range check without numpy's reduction machinery, whose
 * code costs tens of microseconds to bring back into caches after a pause. */
static PyObject *kt_span(PyObject *self, PyObject *arg) {
    Py_buffer v;
    if (get_buffer(arg, &v, "ids", 0, 8) != 0) return NULL;
    Py_ssize_t n = v.len / 8;
    if (n == 0) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "keytable.span: ids is empty");
        return NULL;
    }
    const int64_t *ids = v.buf;
    int64_t lo = ids[0], hi = ids[0];
    for (Py_ssize_t i = 1; i < n; i++) {
        if (ids[i] < lo) lo = ids[i];
        if (ids[i] > hi) hi = ids[i];
    }
    PyBuffer_Release(&v);
    return Py_BuildValue("(LL)", (long long)lo, (long long)hi);
}

static PyObject *kt_cache(PyObject *self, PyObject *args) {
    static const char *names[] = {"keys", "vals", "key_of", "hashed", "refs", "ids", "hashes", "out"};
    static const int writable[] = {1, 1, 1, 1, 0, 0, 0, 1};
    static const Py_ssize_t size[] = {8, 8, 8, 1, 8, 8, 8, 1};
    Py_buffer v[8];
    table_t t;
    PyObject *res = NULL;
    int got = parse(args, 8, names, writable, size, v, &t);
    if (got < 8 || PyErr_Occurred()) goto done;
    Py_ssize_t blocks = v[2].len / 8, n = v[5].len / 8;
    if (v[3].len != blocks || v[4].len / 8 != blocks || v[6].len / 8 != n || v[7].len != n) {
        PyErr_SetString(PyExc_ValueError, "keytable.cache: key_of/hashed/refs per block, ids/hashes/out per item");
        goto done;
    }
    int64_t *key_of = v[2].buf;
    const int64_t *refs = v[4].buf, *ids = v[5].buf, *h = v[6].buf;
    uint8_t *hashed = v[3].buf, *out = v[7].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= blocks) { res = Py_BuildValue("(in)", 1, i); goto done; }
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* only a block being filled (referenced) can be keyed */
        if (refs[ids[i]] == 0) { res = Py_BuildValue("(iL)", 3, (long long)ids[i]); goto done; }
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
    res = Py_BuildValue("(in)", 0, (Py_ssize_t)-1);
done:
    release(v, got);
    return res;
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


/* ---- the pool around the table: refcounts, a free ring and a lazily-deleted LRU ring -----------------------
 * State (numpy arrays the caller owns): keys, vals (the table), key_of, hashed (per block), refs (int64 per
 * block), ticket (int64 per block: its LRU position while cached and unreferenced, else -1), free_ring and
 * lru_ring (int64, power-of-two sizes: free >= blocks, lru >= 2 x blocks) and meta (int64: free head, free
 * tail, lru head, lru tail, live lru entries; positions only grow, slot = position & (size - 1)). An LRU entry
 * at position p is live while ticket[its block] == p; stale ones are skipped and dropped by compaction. Every
 * call validates first and changes nothing when it returns an error (kind, block id); (0, -1) is success. */
enum { F_HEAD, F_TAIL, L_HEAD, L_TAIL, L_LIVE };
enum { OK = 0, E_RANGE = 1, E_OVER = 2, E_FREE = 3 };
#define NSTATE 9

typedef struct {
    table_t t;
    int64_t *key_of, *refs, *ticket, *free_ring, *lru_ring, *meta;
    uint8_t *hashed;
    int64_t blocks;
    uint64_t fmask, lmask;
} pool_t;

static int parse_pool(PyObject *args, int extra, const char **extra_names, const int *extra_writable,
                      Py_buffer *v, pool_t *p) {
    static const char *names[NSTATE] = {"keys", "vals", "key_of", "hashed", "refs", "ticket", "free_ring",
                                        "lru_ring", "meta"};
    const char *all_names[NSTATE + 2];
    int writable[NSTATE + 2];
    Py_ssize_t size[NSTATE + 2];
    for (int i = 0; i < NSTATE; i++) { all_names[i] = names[i]; writable[i] = 1; size[i] = i == 3 ? 1 : 8; }
    for (int i = 0; i < extra; i++) {
        all_names[NSTATE + i] = extra_names[i];
        writable[NSTATE + i] = extra_writable[i];
        size[NSTATE + i] = 8;
    }
    int got = parse(args, NSTATE + extra, all_names, writable, size, v, &p->t);
    if (got < NSTATE + extra || PyErr_Occurred()) return got;
    p->key_of = v[2].buf; p->hashed = v[3].buf; p->refs = v[4].buf; p->ticket = v[5].buf;
    p->free_ring = v[6].buf; p->lru_ring = v[7].buf; p->meta = v[8].buf;
    p->blocks = v[2].len / 8;
    Py_ssize_t fcap = v[6].len / 8, lcap = v[7].len / 8;
    if (v[3].len != p->blocks || v[4].len / 8 != p->blocks || v[5].len / 8 != p->blocks || v[8].len / 8 < 5
        || fcap < p->blocks || (fcap & (fcap - 1)) || lcap < 2 * p->blocks || (lcap & (lcap - 1))) {
        PyErr_SetString(PyExc_ValueError, "keytable pool: state arrays disagree in size");
        return got;
    }
    p->fmask = (uint64_t)fcap - 1;
    p->lmask = (uint64_t)lcap - 1;
    return got;
}

/* The start of a pool call whose one argument after the state is the int64 array NAME (WRITABLE 1: an output):
 * declares v, p, got and res, and goes to done when the arguments do not parse. */
#define POOL_CALL(NAME, WRITABLE)                                     \
    static const char *names[] = {NAME};                              \
    static const int writable[] = {WRITABLE};                         \
    Py_buffer v[NSTATE + 1];                                          \
    pool_t p;                                                         \
    int got = parse_pool(args, 1, names, writable, v, &p);            \
    PyObject *res = NULL;                                             \
    if (got < NSTATE + 1 || PyErr_Occurred()) goto done

/* After POOL_CALL("ids", 0): the ids and their count, or (E_RANGE, i) for the first id outside the pool. */
#define CHECKED_IDS                                                   \
    const int64_t *ids = v[NSTATE].buf;                               \
    Py_ssize_t n = v[NSTATE].len / 8;                                 \
    int64_t bad = range_error(&p, ids, n);                            \
    if (bad >= 0) { res = result(E_RANGE, bad); goto done; }

static PyObject *result(int kind, int64_t block) { return Py_BuildValue("(iL)", kind, (long long)block); }

static int64_t range_error(const pool_t *p, const int64_t *ids, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= p->blocks) return i;
    return -1;
}

static void forget_key(pool_t *p, int64_t b) {
    if (!p->hashed[b]) return;
    int64_t s = find(&p->t, p->key_of[b]);
    if (s >= 0 && p->t.vals[s] == b) erase(&p->t, (uint64_t)s);
    p->hashed[b] = 0;
}

static void compact_lru(pool_t *p) {
    int64_t *m = p->meta, out = m[L_HEAD];
    for (int64_t pos = m[L_HEAD]; pos < m[L_TAIL]; pos++) {
        int64_t b = p->lru_ring[pos & p->lmask];
        if (p->ticket[b] == pos) {
            p->lru_ring[out & p->lmask] = b;
            p->ticket[b] = out++;
        }
    }
    m[L_TAIL] = out;
}

static void lru_push(pool_t *p, int64_t b) {
    int64_t *m = p->meta;
    if ((uint64_t)(m[L_TAIL] - m[L_HEAD]) > p->lmask) compact_lru(p); /* full: live entries <= blocks fit */
    p->lru_ring[m[L_TAIL] & p->lmask] = b;
    p->ticket[b] = m[L_TAIL]++;
    m[L_LIVE]++;
}

static void lru_leave(pool_t *p, int64_t b) {
    p->ticket[b] = -1;
    p->meta[L_LIVE]--;
}

static void free_push(pool_t *p, int64_t b) { p->free_ring[p->meta[F_TAIL]++ & p->fmask] = b; }

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* unref(state..., ids): one reference less each; blocks reaching 0 go, in block id order, to the LRU (keyed)
 * or the free ring. (E_RANGE, i) for an unknown id at index i, (E_OVER, b) when b is released more times than
 * it is referenced. */
static PyObject *kt_unref(PyObject *self, PyObject *args) {
    int64_t *released = NULL;
    POOL_CALL("ids", 0);
    CHECKED_IDS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (--p.refs[ids[i]] < 0) {
            int64_t b = ids[i];
            for (Py_ssize_t j = 0; j <= i; j++) p.refs[ids[j]]++;
            res = result(E_OVER, b);
            goto done;
        }
    }
    released = n > 0 ? malloc(sizeof(int64_t) * (size_t)n) : NULL;
    if (n > 0 && released == NULL) { PyErr_NoMemory(); goto done; }
    Py_ssize_t k = 0;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p.refs[ids[i]] == 0) {
            if (k && ids[i] <= released[k - 1]) sorted = 0;
            released[k++] = ids[i];
        }
    }
    if (!sorted) qsort(released, (size_t)k, sizeof(int64_t), cmp_i64);
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t b = released[i];
        if (i && b == released[i - 1]) continue; /* repeated in ids: released once */
        if (p.hashed[b]) lru_push(&p, b); else free_push(&p, b);
    }
    res = result(OK, -1);
done:
    free(released);
    release(v, got);
    return res;
}

/* ref(state..., ids): one reference more each; a cached block leaves the LRU. (E_FREE, b): the smallest id
 * that is neither referenced nor cached. */
static PyObject *kt_ref(PyObject *self, PyObject *args) {
    POOL_CALL("ids", 0);
    CHECKED_IDS
    int64_t worst = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (p.refs[b] == 0 && p.ticket[b] < 0 && (worst < 0 || b < worst)) worst = b;
    }
    if (worst >= 0) { res = result(E_FREE, worst); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (p.refs[b]++ == 0) lru_leave(&p, b);
    }
    res = result(OK, -1);
done:
    release(v, got);
    return res;
}

/* allocate(state..., out): len(out) blocks with refcount 1, free ones first, then the oldest cached ones
 * (their keys dropped). The caller checked that enough are free or evictable. */
static PyObject *kt_allocate(PyObject *self, PyObject *args) {
    POOL_CALL("out", 1);
    int64_t *out = v[NSTATE].buf, *m = p.meta;
    Py_ssize_t n = v[NSTATE].len / 8, k = 0;
    if (n > (m[F_TAIL] - m[F_HEAD]) + m[L_LIVE]) {
        PyErr_SetString(PyExc_ValueError, "keytable.allocate: more blocks than free or evictable");
        goto done;
    }
    while (k < n && m[F_HEAD] < m[F_TAIL]) out[k++] = p.free_ring[m[F_HEAD]++ & p.fmask];
    while (k < n) {
        int64_t pos = m[L_HEAD]++, b = p.lru_ring[pos & p.lmask];
        if (p.ticket[b] != pos) continue; /* stale */
        lru_leave(&p, b);
        forget_key(&p, b);
        out[k++] = b;
    }
    for (Py_ssize_t i = 0; i < n; i++) p.refs[out[i]] = 1;
    res = result(OK, -1);
done:
    release(v, got);
    return res;
}

/* oldest(state..., out): the len(out) cached blocks an allocation would evict first, oldest first (the caller
 * checked there are that many); nothing changes. */
static PyObject *kt_oldest(PyObject *self, PyObject *args) {
    POOL_CALL("out", 1);
    int64_t *out = v[NSTATE].buf;
    Py_ssize_t n = v[NSTATE].len / 8, k = 0;
    for (int64_t pos = p.meta[L_HEAD]; k < n && pos < p.meta[L_TAIL]; pos++) {
        int64_t b = p.lru_ring[pos & p.lmask];
        if (p.ticket[b] == pos) out[k++] = b;
    }
    res = result(OK, k);
done:
    release(v, got);
    return res;
}

/* evict(state..., ids): cached, unreferenced blocks (the caller checked) lose their keys and become free. */
static PyObject *kt_evict(PyObject *self, PyObject *args) {
    POOL_CALL("ids", 0);
    CHECKED_IDS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (p.refs[b] != 0 || p.ticket[b] < 0) { res = result(E_FREE, b); goto done; }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        lru_leave(&p, ids[i]);
        forget_key(&p, ids[i]);
        free_push(&p, ids[i]);
    }
    res = result(OK, -1);
done:
    release(v, got);
    return res;
}

static PyMethodDef methods[] = {
    {"get", kt_get, METH_VARARGS, "get(keys, vals, hashes, out) -> (hits, first miss): the block keyed by each hash"},
    {"span", kt_span, METH_O, "span(ids) -> (min, max) of a non-empty int64 array"},
    {"from_list", kt_from_list, METH_VARARGS, "from_list(list, out): a list of ints into an int64 array"},
    {"cache", kt_cache, METH_VARARGS, "cache(keys, vals, key_of, hashed, refs, ids, hashes, out) -> (error kind, at)"},
    {"forget", kt_forget, METH_VARARGS, "forget(keys, vals, key_of, hashed, ids): drop the keys of blocks"},
    {"unref", kt_unref, METH_VARARGS, "unref(state..., ids) -> (error kind, block): drop one reference each"},
    {"ref", kt_ref, METH_VARARGS, "ref(state..., ids) -> (error kind, block): take one reference each"},
    {"allocate", kt_allocate, METH_VARARGS, "allocate(state..., out): blocks with refcount 1, evicting the oldest"},
    {"oldest", kt_oldest, METH_VARARGS, "oldest(state..., out) -> (0, count): the next blocks to evict"},
    {"evict", kt_evict, METH_VARARGS, "evict(state..., ids) -> (error kind, block): cached blocks become free"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keytable", "int64 prefix-hash table", -1, methods};

PyMODINIT_FUNC PyInit__keytable(void) { return PyModule_Create(&module); }
