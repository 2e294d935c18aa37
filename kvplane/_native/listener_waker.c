/*
 * Wakes a TCP listener blocked in accept() while its owner joins it, from a thread that needs no GIL.
 *
 * Mooncake's handshake listener (SocketHandShakePlugin in transfer_metadata_plugin.cpp) loops on accept() with a
 * 1 s SO_RCVTIMEO until its destructor clears the running flag and joins it, so every engine teardown waited up
 * to a second. The binding runs that destructor holding the GIL, so no Python thread can help. start() spawns a
 * pthread that connects to 127.0.0.1:port and closes at once, every POKE_US, until stop() or its deadline: the
 * listener wakes, reads end-of-file (an invalid request, dropped without a reply) and sees the flag cleared.
 * A listener already gone refuses the connection, and the thread stops early.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define POKE_US 2000

typedef struct {
    pthread_t thread;
    atomic_int stop;
    unsigned short port;
    double deadline;
    long pokes;
} waker_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* One connection, closed at once; 0 when the listener took it, -1 when it is gone, did not take it within the
 * bound, or no socket could be made: the thread stops then. */
static int poke(unsigned short port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval bound = {0, 50000}; /* Linux bounds a blocking connect by SO_SNDTIMEO: a full backlog cannot
                                          hold the thread (and stop()) for the kernel's SYN retries */
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof(bound));
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int rc = connect(fd, (struct sockaddr *)&addr, sizeof(addr));
    close(fd);
    return rc;
}

static void *run(void *arg) {
    waker_t *w = arg;
    struct timespec pause = {0, POKE_US * 1000L};
    while (!atomic_load(&w->stop) && now_s() < w->deadline) {
        if (poke(w->port) != 0) break; /* refused: the listener is closed */
        w->pokes++;
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static PyObject *start(PyObject *self, PyObject *args) {
    int port;
    double seconds;
    if (!PyArg_ParseTuple(args, "id", &port, &seconds)) return NULL;
    if (port <= 0 || port > 65535 || !(seconds > 0)) {
        PyErr_Format(PyExc_ValueError, "listener_waker.start: port=%d must be in 1..65535 and seconds > 0", port);
        return NULL;
    }
    waker_t *w = calloc(1, sizeof(waker_t));
    if (w == NULL) return PyErr_NoMemory();
    w->port = (unsigned short)port;
    w->deadline = now_s() + seconds;
    atomic_init(&w->stop, 0);
    if (pthread_create(&w->thread, NULL, run, w) != 0) {
        free(w);
        PyErr_SetString(PyExc_OSError, "listener_waker.start: pthread_create failed");
        return NULL;
    }
    return PyLong_FromVoidPtr(w);
}

/* Every start() needs exactly one stop(): it joins the thread and frees it. */
static PyObject *stop(PyObject *self, PyObject *handle) {
    waker_t *w = PyLong_AsVoidPtr(handle);
    if (w == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "listener_waker.stop: not a waker handle");
        return NULL;
    }
    atomic_store(&w->stop, 1);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    long pokes = w->pokes;
    free(w);
    return PyLong_FromLong(pokes);
}

static PyMethodDef methods[] = {
    {"start", start, METH_VARARGS, "start(port, seconds) -> handle: poke 127.0.0.1:port until stop(handle) or seconds pass"},
    {"stop", stop, METH_O, "stop(handle) -> connections made: stop poking, join the thread, free it (once per start)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_listener_waker", NULL, -1, methods};

PyMODINIT_FUNC PyInit__listener_waker(void) { return PyModule_Create(&module); }
