/*
 * Untouched memory filled page by page: userfaultfd, register_untouched, fill_crc32c, serve_faults and
 * unregister install a load's bytes as the pages of memory nothing has touched yet (UFFDIO_COPY), without the
 * kernel clearing them first. Built without <linux/userfaultfd.h>, each raises OSError ENOSYS.
 *
 * fill_crc32c checksums as it fills, with crc32c.c's kernel (cio_crc_raw); it is here, not in crc32c.c,
 * because what it adds to copy_crc32c is the fill.
 */
#include "cio.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__linux__) && __has_include(<linux/userfaultfd.h>)
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/ioctl.h>
#define FP_DCP_HAVE_USERFAULTFD 1
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1 /* Linux 5.11: faults in user mode only, allowed without privileges */
#endif
#endif

PyDoc_STRVAR(userfaultfd_doc,
             "userfaultfd() -> int\n\n"
             "A new userfaultfd (close-on-exec, non-blocking, faults in user mode only: Linux 5.11, "
             "no privilege needed), its API handshake done; the caller closes it, which also "
             "unregisters every range registered with it. Raises OSError where the kernel or a "
             "seccomp filter (Docker's default one) refuses it.");

static PyObject *py_userfaultfd(PyObject *self, PyObject *noargs)
{
    (void)self, (void)noargs;
#ifdef FP_DCP_HAVE_USERFAULTFD
    int fd = (int)syscall(__NR_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    struct uffdio_api api = {.api = UFFD_API, .features = 0};
    if (ioctl(fd, UFFDIO_API, &api) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(fd);
#else
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

PyDoc_STRVAR(register_untouched_doc,
             "register_untouched(fd, buffer, /) -> (start, end) | None\n\n"
             "Register with userfaultfd fd, for missing pages, the whole pages inside a writable "
             "buffer, if none of them holds a page yet (mincore); returns their address range, or "
             "None where there is no whole page or one is touched. Until fd is closed, a thread "
             "of this process that touches one of them before fill_crc32c fills it waits for "
             "serve_faults to answer, and the kernel's own accesses to them (a read(2) or direct "
             "read into them) fail with EFAULT. Raises OSError where the kernel refuses the memory "
             "(not anonymous or shmem, hugetlbfs, or registered with another userfaultfd).");

static PyObject *py_register_untouched(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer view;
    (void)self;
    if (!PyArg_ParseTuple(args, "iw*:register_untouched", &fd, &view))
        return NULL;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), base = (uintptr_t)view.buf;
    uintptr_t lo = (base + page - 1) & ~(page - 1), hi = (base + (uintptr_t)view.len) & ~(page - 1);
    PyBuffer_Release(&view); /* the caller holds the memory; only its addresses are kept */
    if (hi <= lo)
        Py_RETURN_NONE;
    size_t pages = (hi - lo) / page;
    unsigned char *resident = PyMem_RawMalloc(pages);
    if (!resident)
        return PyErr_NoMemory();
    int rc, touched = 0;
    Py_BEGIN_ALLOW_THREADS rc = mincore((void *)lo, hi - lo, resident);
    for (size_t i = 0; rc == 0 && i < pages && !touched; i++)
        touched = resident[i] & 1;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(resident);
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (touched)
        Py_RETURN_NONE;
#ifdef FP_DCP_HAVE_USERFAULTFD
    struct uffdio_register reg = {.range = {.start = lo, .len = hi - lo}, .mode = UFFDIO_REGISTER_MODE_MISSING};
    if (ioctl(fd, UFFDIO_REGISTER, &reg) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    /* both, or not this memory: hugetlbfs takes neither a zero page nor copies of single small pages */
    uint64_t needed = ((uint64_t)1 << _UFFDIO_COPY) | ((uint64_t)1 << _UFFDIO_ZEROPAGE);
    if ((reg.ioctls & needed) != needed) {
        if (ioctl(fd, UFFDIO_UNREGISTER, &reg.range) < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        errno = EOPNOTSUPP;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(KK)", (unsigned long long)lo, (unsigned long long)hi);
#else
    (void)fd;
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

PyDoc_STRVAR(unregister_doc,
             "unregister(fd, start, end, /) -> None\n\n"
             "End the registration of [start, end) with userfaultfd fd (UFFDIO_UNREGISTER): its "
             "missing pages fault in as zeros again. Closing fd does the same for all its ranges, "
             "unless a child made by fork still holds it.");

static PyObject *py_unregister(PyObject *self, PyObject *args)
{
    int fd;
    unsigned long long lo, hi;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKK:unregister", &fd, &lo, &hi))
        return NULL;
#ifdef FP_DCP_HAVE_USERFAULTFD
    struct uffdio_range range = {.start = lo, .len = hi - lo};
    if (ioctl(fd, UFFDIO_UNREGISTER, &range) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
#else
    (void)fd, (void)lo, (void)hi;
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

#ifdef FP_DCP_HAVE_USERFAULTFD
/* Install the n bytes at src (whole pages) as the registered pages from dst on; a page already there is
 * copied into instead. 0, or -1 with errno set. */
static int fill_pages(int fd, uintptr_t dst, const uint8_t *src, size_t n, size_t page)
{
    while (n) {
        struct uffdio_copy cp = {.dst = dst, .src = (uintptr_t)src, .len = n, .mode = 0};
        if (ioctl(fd, UFFDIO_COPY, &cp) == 0)
            return 0;
        int e = errno;
        size_t done = cp.copy > 0 ? (size_t)cp.copy : 0; /* the pages before the one that stopped it */
        dst += done, src += done, n -= done;
        if (e == EEXIST) { /* touched meanwhile: no fault can wait on it */
            memcpy((void *)dst, src, page);
            dst += page, src += page, n -= page;
        } else if (e != EAGAIN || !done) {
            errno = e;
            return -1;
        }
    }
    return 0;
}

/* Write n bytes at src into the registered page at page_addr from byte at on: the page installed with zeros
 * around them (what its first fault would have shown), or, where it is there already, copied into. */
static int fill_part(int fd, uintptr_t page_addr, size_t at, const uint8_t *src, size_t n, uint8_t *bounce,
                     size_t page)
{
    memset(bounce, 0, page);
    memcpy(bounce + at, src, n);
    struct uffdio_copy cp = {.dst = page_addr, .src = (uintptr_t)bounce, .len = page, .mode = 0};
    if (ioctl(fd, UFFDIO_COPY, &cp) == 0)
        return 0;
    if (errno != EEXIST)
        return -1;
    memcpy((void *)(page_addr + at), src, n);
    return 0;
}

/* Copy n bytes from src to dst, the pages of [lo, hi) through fd (fill_pages, fill_part), the rest plainly. */
static int fill_range(int fd, uintptr_t lo, uintptr_t hi, uintptr_t dst, const uint8_t *src, size_t n,
                      uint8_t *bounce, size_t page)
{
    uintptr_t a = dst, end = dst + n;
    if (a < lo) {
        size_t k = (end < lo ? end : lo) - a;
        memcpy((void *)a, src, k);
        a += k;
    }
    uintptr_t stop = end < hi ? end : hi;
    while (a < stop) {
        uintptr_t p = a & ~(uintptr_t)(page - 1), full = (stop - p) / page * page;
        int rc;
        if (a == p && full) /* whole pages from here */
            rc = fill_pages(fd, a, src + (a - dst), full, page), a += full;
        else {
            size_t k = (p + page < stop ? p + page : stop) - a;
            rc = fill_part(fd, p, a - p, src + (a - dst), k, bounce, page), a += k;
        }
        if (rc < 0)
            return -1;
    }
    if (a < end)
        memcpy((void *)a, src + (a - dst), end - a);
    return 0;
}
#endif

PyDoc_STRVAR(serve_faults_doc,
             "serve_faults(fd, stop_fd, /) -> None\n\n"
             "Answer the faults userfaultfd fd reports (a thread of this process touched a registered "
             "page before it was filled) with the zero page, as the kernel would have, and wake the "
             "thread; return once stop_fd is readable. GIL released while waiting.");

#ifdef FP_DCP_HAVE_USERFAULTFD
/* Map the zero page at each fault read from fd (one already filled: wake its waiter); 0, or -1 with errno. */
static int answer_faults(int fd, size_t page)
{
    struct uffd_msg msg;
    for (;;) {
        ssize_t got = read(fd, &msg, sizeof msg);
        if (got < 0)
            return errno == EAGAIN ? 0 : -1;
        if (got != (ssize_t)sizeof msg) {
            errno = EIO;
            return -1;
        }
        if (msg.event != UFFD_EVENT_PAGEFAULT)
            continue;
        struct uffdio_range range = {.start = msg.arg.pagefault.address & ~(uint64_t)(page - 1), .len = page};
        struct uffdio_zeropage zero = {.range = range, .mode = 0};
        if (ioctl(fd, UFFDIO_ZEROPAGE, &zero) < 0 && (errno != EEXIST || ioctl(fd, UFFDIO_WAKE, &range) < 0))
            return -1;
    }
}
#endif

static PyObject *py_serve_faults(PyObject *self, PyObject *args)
{
    int fd, stop_fd;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii:serve_faults", &fd, &stop_fd))
        return NULL;
#ifdef FP_DCP_HAVE_USERFAULTFD
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS for (;;)
    {
        struct pollfd fds[2] = {{.fd = fd, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
        rc = poll(fds, 2, -1);
        if (rc < 0 && errno == EINTR)
            continue;
        if (rc < 0 || (rc = (fds[0].revents & POLLIN) ? answer_faults(fd, page) : 0) < 0)
            break;
        if (fds[1].revents)
            break;
    }
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
#else
    (void)fd, (void)stop_fd;
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

PyDoc_STRVAR(fill_crc32c_doc,
             "fill_crc32c(fd, start, end, dst, src, crc=0, /) -> int\n\n"
             "copy_crc32c(dst, src, crc) for a dst whose pages in [start, end) are registered with "
             "userfaultfd fd (register_untouched): those still missing are installed with their "
             "bytes (UFFDIO_COPY: no clearing, no fault), the others copied into. Partly covered "
             "pages are installed with zeros around the bytes, as a first fault would show them. "
             "GIL released. Raises OSError where the kernel refuses a page.");

static PyObject *py_fill_crc32c(PyObject *self, PyObject *args)
{
    int fd;
    unsigned long long lo, hi;
    Py_buffer dst, src;
    PyObject *crc_obj = NULL, *result = NULL;
    uint32_t crc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKw*y*|O:fill_crc32c", &fd, &lo, &hi, &dst, &src, &crc_obj))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "fill_crc32c: dst has %zd bytes, src has %zd", dst.len, src.len);
        goto done;
    }
    if (crc_obj && cio_parse_crc(crc_obj, &crc) < 0)
        goto done;
#ifdef FP_DCP_HAVE_USERFAULTFD
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uint8_t *bounce = PyMem_RawMalloc(2 * page); /* a page-aligned page inside it */
    if (!bounce) {
        PyErr_NoMemory();
        goto done;
    }
    uint8_t *aligned = (uint8_t *)(((uintptr_t)bounce + page - 1) & ~(uintptr_t)(page - 1));
    uint32_t c = ~crc;
    int rc = 0;
    uintptr_t base = (uintptr_t)dst.buf;
    size_t n = (size_t)src.len;
    Py_BEGIN_ALLOW_THREADS for (size_t off = 0; off < n && rc == 0;)
    {
        /* cache-sized steps that end on dst's page boundaries: checksummed first, then copied from the cache,
         * and no page of dst split between two steps */
        size_t m = n - off;
        if (m > COPY_STEP) {
            uintptr_t cut = (base + off + COPY_STEP) & ~(uintptr_t)(page - 1);
            m = cut > base + off ? cut - (base + off) : COPY_STEP;
        }
        c = cio_crc_raw(c, (const uint8_t *)src.buf + off, m);
        rc = fill_range(fd, (uintptr_t)lo, (uintptr_t)hi, base + off, (const uint8_t *)src.buf + off, m, aligned,
                        page);
        off += m;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(bounce);
    if (rc < 0)
        PyErr_SetFromErrno(PyExc_OSError);
    else
        result = PyLong_FromUnsignedLong(~c);
#else
    (void)fd, (void)lo, (void)hi;
    errno = ENOSYS;
    PyErr_SetFromErrno(PyExc_OSError);
#endif
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef userfault_methods[] = {
    {"userfaultfd", py_userfaultfd, METH_NOARGS, userfaultfd_doc},
    {"register_untouched", py_register_untouched, METH_VARARGS, register_untouched_doc},
    {"fill_crc32c", py_fill_crc32c, METH_VARARGS, fill_crc32c_doc},
    {"serve_faults", py_serve_faults, METH_VARARGS, serve_faults_doc},
    {"unregister", py_unregister, METH_VARARGS, unregister_doc},
    {NULL, NULL, 0, NULL}};

int cio_userfault_add(PyObject *module) { return PyModule_AddFunctions(module, userfault_methods); }
