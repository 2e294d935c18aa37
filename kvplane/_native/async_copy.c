/*
 * Enqueues a copy plan on an accelerator stream through the vendor's async memcpy, looping in C.
 *
 * Accelerator backends (kvplane/backend/accelerator.py) resolve the vendor function (cudaMemcpyAsync,
 * aclrtMemcpyAsync, cnrtMemcpyAsync_V2, or CUDA's cudaMemcpyBatchAsync) to a raw address and hand it here with
 * the plan's three int64 arrays and the stream's raw handle: one call per plan, no Python per descriptor, the
 * GIL released while descriptors are enqueued. Nothing is gathered on the device first. A backend whose vendor
 * function has another calling convention brings its own loop with the "plan" signature (plan_fn below): the
 * convention lives in the backend package, and this file does not change for it.
 *
 * The emulated functions at the end stand in for the vendor library on machines without the device
 * (kvplane/testing/emulated.py): they take exactly the vendor signatures and memcpy synchronously, so the real
 * backend path and this loop run in CI. They return 1 for an invalid argument (not a vendor code).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

_Static_assert(sizeof(void *) == 8 && sizeof(size_t) == 8, "descriptor arrays are int64: a 64-bit target is needed");

/* cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind, cudaStream_t s) */
typedef int (*cuda_memcpy_fn)(void *, const void *, size_t, int, void *);
/* aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
 *                           aclrtStream stream) */
typedef int (*acl_memcpy_fn)(void *, size_t, const void *, size_t, int, void *);
/* cnrtRet_t cnrtMemcpyAsync_V2(void *dst, void *src, size_t bytes, cnrtQueue_t queue, cnrtMemTransDir_t dir) */
typedef int (*cnrt_memcpy_fn)(void *, void *, size_t, void *, int);

/* struct cudaMemcpyAttributes (CUDA 12.8+): access order, source and destination location hints, flags. */
typedef struct {
    int type, id;
} cuda_mem_location;
typedef struct {
    int src_access_order;
    cuda_mem_location src_loc_hint, dst_loc_hint;
    unsigned int flags;
} cuda_memcpy_attributes;
#define CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM 1

/* CUDA 12.8/12.9: cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream) */
typedef int (*cuda_batch12_fn)(void **, void **, size_t *, size_t, cuda_memcpy_attributes *, size_t *, size_t,
                               size_t *, void *);
/* CUDA 13: the same without failIdx */
typedef int (*cuda_batch13_fn)(void **, void **, size_t *, size_t, cuda_memcpy_attributes *, size_t *, size_t,
                               void *);

/* A backend package's own plan function, for a calling convention this file does not know (a SYCL queue's
 * memcpy, a future NPU's): it loops over the descriptors itself and returns -1 when all were enqueued, else the
 * index of the first that failed (n when it cannot name one) with the vendor's code in *code. */
typedef int64_t (*plan_fn)(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n, int kind,
                           void *stream, int *code);

typedef enum { SIG_CUDA, SIG_ACL, SIG_CNRT, SIG_CUDA_BATCH12, SIG_CUDA_BATCH13, SIG_PLAN, SIG_UNKNOWN } signature_t;

static signature_t parse_signature(const char *name) {
    if (strcmp(name, "cuda") == 0) return SIG_CUDA;
    if (strcmp(name, "acl") == 0) return SIG_ACL;
    if (strcmp(name, "cnrt") == 0) return SIG_CNRT;
    if (strcmp(name, "cuda_batch12") == 0) return SIG_CUDA_BATCH12;
    if (strcmp(name, "cuda_batch13") == 0) return SIG_CUDA_BATCH13;
    if (strcmp(name, "plan") == 0) return SIG_PLAN;
    return SIG_UNKNOWN;
}

/* Enqueue descriptors one by one; the index of the first that failed, or -1. */
static Py_ssize_t loop(void *fn, signature_t sig, const int64_t *src, const int64_t *dst, const int64_t *len,
                       Py_ssize_t n, int kind, void *stream, int *code) {
    for (Py_ssize_t i = 0; i < n; i++) {
        void *d = (void *)(intptr_t)dst[i], *s = (void *)(intptr_t)src[i];
        size_t count = (size_t)len[i];
        int rc;
        switch (sig) {
        case SIG_CUDA: rc = ((cuda_memcpy_fn)fn)(d, s, count, kind, stream); break;
        case SIG_ACL: rc = ((acl_memcpy_fn)fn)(d, count, s, count, kind, stream); break;
        default: rc = ((cnrt_memcpy_fn)fn)(d, s, count, stream, kind); break;
        }
        if (rc != 0) {
            *code = rc;
            return i;
        }
    }
    return -1;
}

/* One batched call; the failing index when the API names one, n when it names none, -1 on success. */
static Py_ssize_t batch(void *fn, signature_t sig, const int64_t *src, const int64_t *dst, const int64_t *len,
                        Py_ssize_t n, void *stream, int *code) {
    cuda_memcpy_attributes attrs;
    memset(&attrs, 0, sizeof(attrs));
    attrs.src_access_order = CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM; /* sources are read in stream order */
    size_t attrs_idx = 0, fail_idx = SIZE_MAX;
    int rc;
    if (sig == SIG_CUDA_BATCH12)
        rc = ((cuda_batch12_fn)fn)((void **)dst, (void **)src, (size_t *)len, (size_t)n, &attrs, &attrs_idx, 1,
                                   &fail_idx, stream);
    else
        rc = ((cuda_batch13_fn)fn)((void **)dst, (void **)src, (size_t *)len, (size_t)n, &attrs, &attrs_idx, 1,
                                   stream);
    if (rc == 0) return -1;
    *code = rc;
    return fail_idx < (size_t)n ? (Py_ssize_t)fail_idx : n;
}

static int get_int64_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
    if (view->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 array, got itemsize %zd", name, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_batch_async(PyObject *self, PyObject *args) {
    unsigned long long fn_addr, stream_addr;
    const char *sig_name;
    PyObject *src_obj, *dst_obj, *len_obj;
    int kind;
    if (!PyArg_ParseTuple(args, "KsOOOiK", &fn_addr, &sig_name, &src_obj, &dst_obj, &len_obj, &kind,
                          &stream_addr))
        return NULL;
    signature_t sig = parse_signature(sig_name);
    if (sig == SIG_UNKNOWN) {
        PyErr_Format(PyExc_ValueError,
                     "signature=%R is unknown; use cuda, acl, cnrt, cuda_batch12, cuda_batch13 or plan",
                     PyTuple_GET_ITEM(args, 1));
        return NULL;
    }
    if (fn_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "fn_ptr is 0: resolve the vendor memcpy before enqueuing a plan");
        return NULL;
    }
    Py_buffer src, dst, len;
    if (get_int64_buffer(src_obj, &src, "src") != 0) return NULL;
    if (get_int64_buffer(dst_obj, &dst, "dst") != 0) { PyBuffer_Release(&src); return NULL; }
    if (get_int64_buffer(len_obj, &len, "length") != 0) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); return NULL;
    }
    Py_ssize_t n = src.len / 8, failed = -1;
    int code = 0;
    PyObject *result = NULL;
    if (dst.len / 8 != n || len.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "src, dst and length must have equal lengths, got %zd, %zd, %zd",
                     n, dst.len / 8, len.len / 8);
        goto done;
    }
    const int64_t *lens = (const int64_t *)len.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lens[i] < 0) {
            PyErr_Format(PyExc_ValueError, "length[%zd] is negative (%lld)", i, (long long)lens[i]);
            goto done;
        }
    }
    void *fn = (void *)(uintptr_t)fn_addr, *stream = (void *)(uintptr_t)stream_addr;
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        if (sig == SIG_PLAN) {
            int64_t at = ((plan_fn)fn)((const int64_t *)src.buf, (const int64_t *)dst.buf, lens, (int64_t)n, kind,
                                       stream, &code);
            failed = at < 0 ? -1 : (at > n ? n : (Py_ssize_t)at);
        } else if (sig == SIG_CUDA_BATCH12 || sig == SIG_CUDA_BATCH13)
            failed = batch(fn, sig, (const int64_t *)src.buf, (const int64_t *)dst.buf, lens, n, stream, &code);
        else
            failed = loop(fn, sig, (const int64_t *)src.buf, (const int64_t *)dst.buf, lens, n, kind, stream,
                          &code);
        Py_END_ALLOW_THREADS
    }
    if (failed < 0) {
        result = Py_None;
        Py_INCREF(result);
    } else {
        result = Py_BuildValue("(ni)", failed, code);
    }
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&len);
    return result;
}

/* -- emulated vendor functions: the vendor signatures, a synchronous memcpy behind them ------------------ */
#define EMULATED_INVALID_ARGUMENT 1

static int emulated_cuda(void *dst, const void *src, size_t n, int kind, void *stream) {
    (void)stream;
    if (dst == NULL || src == NULL || kind < 0 || kind > 4) return EMULATED_INVALID_ARGUMENT;
    memcpy(dst, src, n);
    return 0;
}

static int emulated_acl(void *dst, size_t dest_max, const void *src, size_t n, int kind, void *stream) {
    (void)stream;
    if (dst == NULL || src == NULL || n > dest_max || kind < 0 || kind > 4) return EMULATED_INVALID_ARGUMENT;
    memcpy(dst, src, n);
    return 0;
}

static int emulated_cnrt(void *dst, void *src, size_t n, void *queue, int dir) {
    (void)queue;
    if (dst == NULL || src == NULL || dir < 0 || dir > 5) return EMULATED_INVALID_ARGUMENT;
    memcpy(dst, src, n);
    return 0;
}

/* Checks what kvplane passes the real API (one attribute entry, stream order, applying from copy 0), then
 * validates every copy before moving any byte, as the batch API does. */
static int emulated_batch_check(void **dsts, void **srcs, size_t count, cuda_memcpy_attributes *attrs,
                                size_t *attrs_idxs, size_t num_attrs, size_t *fail_idx) {
    if (fail_idx) *fail_idx = SIZE_MAX;
    if (attrs == NULL || attrs_idxs == NULL || num_attrs != 1 || attrs_idxs[0] != 0 ||
        attrs[0].src_access_order != CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM || attrs[0].flags != 0)
        return EMULATED_INVALID_ARGUMENT;
    for (size_t i = 0; i < count; i++) {
        if (dsts[i] == NULL || srcs[i] == NULL) {
            if (fail_idx) *fail_idx = i;
            return EMULATED_INVALID_ARGUMENT;
        }
    }
    return 0;
}

static int emulated_cuda_batch12(void **dsts, void **srcs, size_t *sizes, size_t count,
                                 cuda_memcpy_attributes *attrs, size_t *attrs_idxs, size_t num_attrs,
                                 size_t *fail_idx, void *stream) {
    (void)stream;
    int rc = emulated_batch_check(dsts, srcs, count, attrs, attrs_idxs, num_attrs, fail_idx);
    if (rc != 0) return rc;
    for (size_t i = 0; i < count; i++) memcpy(dsts[i], srcs[i], sizes[i]);
    return 0;
}

static int emulated_cuda_batch13(void **dsts, void **srcs, size_t *sizes, size_t count,
                                 cuda_memcpy_attributes *attrs, size_t *attrs_idxs, size_t num_attrs,
                                 void *stream) {
    return emulated_cuda_batch12(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, NULL, stream);
}

static int64_t emulated_plan(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n, int kind,
                             void *stream, int *code) {
    (void)stream;
    for (int64_t i = 0; i < n; i++) {
        if (dst[i] == 0 || src[i] == 0 || kind < 0) {
            *code = EMULATED_INVALID_ARGUMENT;
            return i;
        }
        memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)len[i]);
    }
    return -1;
}

static PyObject *emulated_function(PyObject *self, PyObject *args) {
    const char *sig_name;
    if (!PyArg_ParseTuple(args, "s", &sig_name)) return NULL;
    void *fn;
    switch (parse_signature(sig_name)) {
    case SIG_CUDA: fn = (void *)&emulated_cuda; break;
    case SIG_ACL: fn = (void *)&emulated_acl; break;
    case SIG_CNRT: fn = (void *)&emulated_cnrt; break;
    case SIG_CUDA_BATCH12: fn = (void *)&emulated_cuda_batch12; break;
    case SIG_CUDA_BATCH13: fn = (void *)&emulated_cuda_batch13; break;
    case SIG_PLAN: fn = (void *)&emulated_plan; break;
    default:
        PyErr_Format(PyExc_ValueError, "signature=%R is unknown; use cuda, acl, cnrt, cuda_batch12 or cuda_batch13",
                     PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    return PyLong_FromVoidPtr(fn);
}

static PyMethodDef methods[] = {
    {"copy_batch_async", copy_batch_async, METH_VARARGS,
     "copy_batch_async(fn_ptr, signature, src, dst, length, kind, stream) -> None | (index, code): enqueue every "
     "descriptor through the vendor memcpy at fn_ptr; stops at the first non-zero return."},
    {"emulated_function", emulated_function, METH_VARARGS,
     "emulated_function(signature) -> int: the address of a memcpy-backed stand-in with that vendor signature."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_async_copy",
                                    "Copy plans enqueued through a vendor async memcpy, looped in C.", -1, methods};

PyMODINIT_FUNC PyInit__async_copy(void) { return PyModule_Create(&module); }
