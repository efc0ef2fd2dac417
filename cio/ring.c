/*
 * Ring: a thin wrapper over one liburing ring. Requests are queued with write()/read()/fsync(), submitted and
 * reaped with wait(). The ring holds a buffer export and the caller's tag for every request until its
 * completion is reaped, so memory under an in-flight request can never be freed. It never retries, splits or
 * interprets results: completions carry the raw result (bytes or -errno) and the policy lives in Python.
 *
 * Built without liburing, the module has no Ring and HAVE_IO_URING is False.
 */
#include "cio.h"

#ifdef FP_DCP_HAVE_LIBURING
#include <errno.h>
#include <liburing.h>
#include <sys/uio.h>

/* Kernel read/write calls transfer at most this much in one request. */
#define MAX_REQUEST_BYTES (1u << 30)

typedef struct {
    Py_buffer view; /* view.obj is NULL for requests without memory (fsync) */
    PyObject *tag;
} Slot;

typedef struct {
    PyObject_HEAD struct io_uring ring;
    int open;
    unsigned depth;
    unsigned in_flight;
    Slot *slots;
    unsigned *free_slots; /* stack of unused slot indices */
    unsigned n_free;
    Py_buffer *fixed; /* registered buffers, exported while registered */
    unsigned n_fixed;
} RingObject;

static PyObject *ring_oserror(int neg_errno, const char *what)
{
    errno = -neg_errno;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, what);
}

static void slot_release(RingObject *r, unsigned idx)
{
    Slot *s = &r->slots[idx];
    if (s->view.obj)
        PyBuffer_Release(&s->view);
    s->view.obj = NULL;
    Py_CLEAR(s->tag);
    r->free_slots[r->n_free++] = idx;
    r->in_flight--;
}

/* Move all available completions into list (or drop them when list is NULL). */
static int ring_reap(RingObject *r, PyObject *list, unsigned *reaped)
{
    struct io_uring_cqe *cqe;
    unsigned head, n = 0;
    int failed = 0;
    io_uring_for_each_cqe(&r->ring, head, cqe)
    {
        unsigned idx = (unsigned)io_uring_cqe_get_data64(cqe);
        if (list && !failed) {
            PyObject *item = Py_BuildValue("(Oi)", r->slots[idx].tag, cqe->res);
            if (!item || PyList_Append(list, item) < 0)
                failed = 1;
            Py_XDECREF(item);
        }
        slot_release(r, idx);
        n++;
    }
    io_uring_cq_advance(&r->ring, n);
    *reaped += n;
    return failed ? -1 : 0;
}

/* Submit queued requests and wait until `want` more have completed. */
static int ring_wait(RingObject *r, PyObject *list, unsigned want)
{
    unsigned got = 0;
    if (want > r->in_flight)
        want = r->in_flight;
    for (;;) {
        if (ring_reap(r, list, &got) < 0)
            return -1;
        if (got >= want && io_uring_sq_ready(&r->ring) == 0)
            return 0;
        int rc;
        unsigned wait_nr = got >= want ? 0 : want - got;
        Py_BEGIN_ALLOW_THREADS rc = io_uring_submit_and_wait(&r->ring, wait_nr);
        Py_END_ALLOW_THREADS
        if (rc == -EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        if (rc < 0) {
            ring_oserror(rc, "io_uring_submit_and_wait");
            return -1;
        }
    }
}

/* Wait out every request, dropping results: memory must outlive the kernel's use. */
static void ring_drain(RingObject *r)
{
    while (r->in_flight) {
        unsigned got = 0;
        int rc;
        ring_reap(r, NULL, &got);
        if (!r->in_flight)
            break;
        Py_BEGIN_ALLOW_THREADS rc = io_uring_submit_and_wait(&r->ring, 1);
        Py_END_ALLOW_THREADS
        if (rc < 0 && rc != -EINTR)
            break; /* the ring is unusable; exiting it below reclaims the requests */
    }
}

static void ring_unregister(RingObject *r)
{
    if (!r->n_fixed)
        return;
    io_uring_unregister_buffers(&r->ring); /* only fails if none are registered */
    for (unsigned i = 0; i < r->n_fixed; i++)
        PyBuffer_Release(&r->fixed[i]);
    PyMem_Free(r->fixed);
    r->fixed = NULL;
    r->n_fixed = 0;
}

static void ring_close(RingObject *r)
{
    if (!r->open)
        return;
    ring_drain(r);
    ring_unregister(r);
    io_uring_queue_exit(&r->ring);
    r->open = 0;
    /* Anything still held could not be waited for; the ring's exit has cancelled it. */
    for (unsigned i = 0; i < r->depth; i++) {
        if (r->slots[i].view.obj)
            PyBuffer_Release(&r->slots[i].view);
        Py_CLEAR(r->slots[i].tag);
    }
    r->in_flight = 0;
}

static int ring_init(RingObject *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", NULL};
    unsigned depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "I:Ring", kwlist, &depth))
        return -1;
    if (r->open) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is already initialised");
        return -1;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "Ring depth must be 1..4096, got %u", depth);
        return -1;
    }
    PyMem_Free(r->slots);
    PyMem_Free(r->free_slots);
    r->slots = PyMem_Calloc(depth, sizeof(Slot));
    r->free_slots = PyMem_Calloc(depth, sizeof(unsigned));
    if (!r->slots || !r->free_slots) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = io_uring_queue_init(depth, &r->ring, 0);
    if (rc < 0) {
        ring_oserror(rc, "io_uring_queue_init");
        return -1;
    }
    r->open = 1;
    r->depth = depth;
    r->in_flight = 0;
    r->n_free = depth;
    for (unsigned i = 0; i < depth; i++)
        r->free_slots[i] = depth - 1 - i;
    return 0;
}

static void ring_dealloc(RingObject *r)
{
    ring_close(r);
    PyMem_Free(r->slots);
    PyMem_Free(r->free_slots);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int ring_check_open(RingObject *r)
{
    if (!r->open) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on a closed Ring");
        return -1;
    }
    return 0;
}

/* Claim a slot and an SQE; the caller fills the SQE. */
static struct io_uring_sqe *ring_claim(RingObject *r, unsigned *idx)
{
    if (ring_check_open(r) < 0)
        return NULL;
    if (!r->n_free) {
        PyErr_Format(PyExc_BlockingIOError, "Ring: all %u requests are in flight; wait() first",
                     r->depth);
        return NULL;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe) { /* cannot happen: queued requests never exceed depth */
        PyErr_SetString(PyExc_RuntimeError, "Ring: submission queue full");
        return NULL;
    }
    *idx = r->free_slots[--r->n_free];
    r->in_flight++;
    io_uring_sqe_set_data64(sqe, *idx);
    return sqe;
}

static int find_fixed(RingObject *r, const char *p, size_t n)
{
    for (unsigned i = 0; i < r->n_fixed; i++) {
        const char *base = r->fixed[i].buf;
        if (p >= base && p + n <= base + r->fixed[i].len)
            return (int)i;
    }
    return -1;
}

static PyObject *ring_rw(RingObject *r, PyObject *args, int is_write)
{
    int fd;
    Py_buffer view;
    long long offset;
    PyObject *tag;
    int punt = 0;
    if (!PyArg_ParseTuple(args, is_write ? "iy*LO|p:write" : "iw*LO|p:read", &fd, &view, &offset,
                          &tag, &punt))
        return NULL;
    if ((size_t)view.len > MAX_REQUEST_BYTES || offset < 0) {
        PyErr_Format(PyExc_ValueError, "Ring: request of %zd bytes at offset %lld is out of range",
                     view.len, offset);
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned idx;
    struct io_uring_sqe *sqe = ring_claim(r, &idx);
    if (!sqe) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int fixed = find_fixed(r, view.buf, (size_t)view.len);
    unsigned len = (unsigned)view.len;
    if (is_write && fixed >= 0)
        io_uring_prep_write_fixed(sqe, fd, view.buf, len, (__u64)offset, fixed);
    else if (is_write)
        io_uring_prep_write(sqe, fd, view.buf, len, (__u64)offset);
    else if (fixed >= 0)
        io_uring_prep_read_fixed(sqe, fd, view.buf, len, (__u64)offset, fixed);
    else
        io_uring_prep_read(sqe, fd, view.buf, len, (__u64)offset);
    if (punt) /* to the kernel's io-wq workers: a page-cache copy then runs beside the caller, not in it */
        io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
    r->slots[idx].view = view; /* the slot now owns the export */
    Py_INCREF(tag);
    r->slots[idx].tag = tag;
    Py_RETURN_NONE;
}

static PyObject *ring_write(RingObject *r, PyObject *args) { return ring_rw(r, args, 1); }
static PyObject *ring_read(RingObject *r, PyObject *args) { return ring_rw(r, args, 0); }

static PyObject *ring_fsync(RingObject *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "tag", "datasync", NULL};
    int fd, datasync = 0;
    PyObject *tag;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO|p:fsync", kwlist, &fd, &tag, &datasync))
        return NULL;
    unsigned idx;
    struct io_uring_sqe *sqe = ring_claim(r, &idx);
    if (!sqe)
        return NULL;
    io_uring_prep_fsync(sqe, fd, datasync ? IORING_FSYNC_DATASYNC : 0);
    Py_INCREF(tag);
    r->slots[idx].tag = tag;
    Py_RETURN_NONE;
}

static PyObject *ring_wait_method(RingObject *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"min_complete", NULL};
    unsigned want = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I:wait", kwlist, &want))
        return NULL;
    if (ring_check_open(r) < 0)
        return NULL;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    if (ring_wait(r, list, want) < 0) {
        Py_DECREF(list);
        return NULL;
    }
    return list;
}

static PyObject *ring_register_buffers(RingObject *r, PyObject *seq)
{
    if (ring_check_open(r) < 0)
        return NULL;
    if (r->in_flight) {
        PyErr_SetString(PyExc_RuntimeError, "Ring: cannot change buffers with requests in flight");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "register_buffers expects a sequence of buffers");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc(n ? (size_t)n : 1, sizeof(struct iovec));
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    if (!views || !iov) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &views[got],
                               PyBUF_WRITABLE) < 0)
            goto done;
        iov[got].iov_base = views[got].buf;
        iov[got].iov_len = (size_t)views[got].len;
    }
    ring_unregister(r);
    if (n) {
        int rc = io_uring_register_buffers(&r->ring, iov, (unsigned)n);
        if (rc < 0) {
            ring_oserror(rc, "io_uring_register_buffers");
            goto done;
        }
        r->fixed = views;
        r->n_fixed = (unsigned)n;
        views = NULL; /* owned by the ring now */
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (views) {
        for (Py_ssize_t i = 0; i < got; i++)
            PyBuffer_Release(&views[i]);
        PyMem_Free(views);
    }
    PyMem_Free(iov);
    Py_DECREF(fast);
    return result;
}

static PyObject *ring_close_method(RingObject *r, PyObject *unused)
{
    (void)unused;
    ring_close(r);
    Py_RETURN_NONE;
}

static PyObject *ring_get_in_flight(RingObject *r, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(r->in_flight);
}

static PyObject *ring_get_depth(RingObject *r, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(r->depth);
}

static PyObject *ring_get_fixed(RingObject *r, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(r->n_fixed);
}

static PyMethodDef ring_methods[] = {
    {"write", (PyCFunction)ring_write, METH_VARARGS,
     "write(fd, buffer, offset, tag, punt=False) -> None: queue a write of buffer at offset; punt hands it "
     "to the kernel's worker threads (IOSQE_ASYNC)."},
    {"read", (PyCFunction)ring_read, METH_VARARGS,
     "read(fd, buffer, offset, tag, punt=False) -> None: queue a read into buffer from offset; punt as for "
     "write."},
    {"fsync", (PyCFunction)(void (*)(void))ring_fsync, METH_VARARGS | METH_KEYWORDS,
     "fsync(fd, tag, datasync=False) -> None: queue an fsync (fdatasync if datasync)."},
    {"wait", (PyCFunction)(void (*)(void))ring_wait_method, METH_VARARGS | METH_KEYWORDS,
     "wait(min_complete=1) -> list[(tag, result)]: submit queued requests, wait until at "
     "least min_complete have completed (GIL released) and return every completion "
     "reaped; result is a byte count or -errno."},
    {"register_buffers", (PyCFunction)ring_register_buffers, METH_O,
     "register_buffers(buffers) -> None: register writable buffers as fixed buffers; "
     "requests inside them then skip per-request page pinning."},
    {"close", (PyCFunction)ring_close_method, METH_NOARGS,
     "close() -> None: wait for requests in flight, then release the ring."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef ring_getset[] = {
    {"in_flight", (getter)ring_get_in_flight, NULL, "requests queued or in flight", NULL},
    {"depth", (getter)ring_get_depth, NULL, "most requests in flight at once", NULL},
    {"fixed_buffers", (getter)ring_get_fixed, NULL, "number of registered buffers", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fp_dcp._native._cio.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(depth): one io_uring instance with at most depth requests in flight.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};

int cio_ring_add(PyObject *module)
{
    if (PyType_Ready(&RingType) < 0 || PyModule_AddObjectRef(module, "Ring", (PyObject *)&RingType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "HAVE_IO_URING", Py_True);
}

#else
int cio_ring_add(PyObject *module) { return PyModule_AddObjectRef(module, "HAVE_IO_URING", Py_False); }
#endif /* FP_DCP_HAVE_LIBURING */
