/*
 * Batched memcpy for the cpu backend: copies a plan of (src, dst, length) descriptors.
 *
 * The plan arrives as three int64 buffers. The bytes of all descriptors are treated as one stream and cut
 * into equal slices, one per thread, so a single large descriptor is split as well as many small ones.
 * The GIL is released for the whole copy. Bounds are the caller's job: kvplane checks every descriptor
 * against registered regions before it reaches this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 64
#define STREAM_MIN_BYTES 4096

/* Copy with non-temporal stores where the CPU has them: KV blocks are written once and not read back soon,
 * so bypassing the cache saves the read-for-ownership traffic that makes scattered copies slower than one
 * large memcpy (which glibc already streams). */
static void copy_bytes(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= STREAM_MIN_BYTES) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    memcpy(dst, src, n);
}

typedef struct {
    const int64_t *src, *dst, *len, *start; /* start[i] = byte offset of descriptor i in the stream */
    Py_ssize_t n;
    int64_t begin, end;                     /* this worker's slice of the stream */
} slice_t;

static Py_ssize_t first_descriptor(const int64_t *start, Py_ssize_t n, int64_t offset) {
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo + 1) / 2;
        if (start[mid] <= offset) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static void *copy_slice(void *arg) {
    slice_t *s = (slice_t *)arg;
    int64_t pos = s->begin;
    Py_ssize_t i = first_descriptor(s->start, s->n, pos);
    while (pos < s->end && i < s->n) {
        int64_t off = pos - s->start[i];
        int64_t take = s->len[i] - off;
        if (take > s->end - pos) take = s->end - pos;
        if (take > 0) {
            copy_bytes((char *)(intptr_t)s->dst[i] + off, (const char *)(intptr_t)s->src[i] + off, (size_t)take);
            pos += take;
        }
        i++;
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streamed stores are visible before the caller is told the copy is done */
#endif
    return NULL;
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

static PyObject *copy_batch(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj, *len_obj;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOO|i", &src_obj, &dst_obj, &len_obj, &threads)) return NULL;
    Py_buffer src, dst, len;
    if (get_int64_buffer(src_obj, &src, "src") != 0) return NULL;
    if (get_int64_buffer(dst_obj, &dst, "dst") != 0) { PyBuffer_Release(&src); return NULL; }
    if (get_int64_buffer(len_obj, &len, "length") != 0) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); return NULL;
    }
    Py_ssize_t n = src.len / 8;
    PyObject *result = Py_None;
    int64_t *start = NULL;
    if (dst.len / 8 != n || len.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "src, dst and length must have equal lengths, got %zd, %zd, %zd",
                     n, dst.len / 8, len.len / 8);
        result = NULL;
        goto done;
    }
    if (n == 0) goto done;
    start = (int64_t *)PyMem_RawMalloc(sizeof(int64_t) * (size_t)n);
    if (start == NULL) { PyErr_NoMemory(); result = NULL; goto done; }
    const int64_t *lens = (const int64_t *)len.buf;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lens[i] < 0) {
            PyErr_Format(PyExc_ValueError, "length[%zd] is negative (%lld)", i, (long long)lens[i]);
            result = NULL;
            goto done;
        }
        start[i] = total;
        total += lens[i];
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    slice_t slices[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int64_t per = (total + threads - 1) / threads;
    int created[MAX_THREADS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        slices[t] = (slice_t){(const int64_t *)src.buf, (const int64_t *)dst.buf, lens, start, n,
                              per * t, per * (t + 1) < total ? per * (t + 1) : total};
        if (t < threads - 1 && pthread_create(&tids[t], NULL, copy_slice, &slices[t]) == 0) {
            created[t] = 1;
        } else {
            /* the last slice, or one whose thread could not start, runs on this thread */
            copy_slice(&slices[t]);
        }
    }
    for (int t = 0; t < threads; t++) if (created[t]) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
done:
    if (start) PyMem_RawFree(start);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&len);
    if (result == NULL) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_batch", copy_batch, METH_VARARGS,
     "copy_batch(src, dst, length, threads=1): memcpy every descriptor of int64 arrays, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memcpy", "Batched memcpy for kvplane.", -1, methods};

PyMODINIT_FUNC PyInit__memcpy(void) { return PyModule_Create(&module); }
