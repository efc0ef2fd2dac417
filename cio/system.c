/*
 * Small system helpers: dio_alignment (statx), fallocate, start_writeback (sync_file_range), cached_pages
 * (cachestat) and address; populate and advise_huge prepare memory a load is about to fill.
 */
#include "cio.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

PyDoc_STRVAR(dio_alignment_doc,
             "dio_alignment(fd, /) -> (mem_align, offset_align)\n\n"
             "Direct-I/O alignment the kernel reports for an open file (statx "
             "STATX_DIOALIGN); (0, 0) when the file does not support direct I/O, None when "
             "the kernel or C library cannot tell.");

static PyObject *py_dio_alignment(PyObject *self, PyObject *args)
{
    int fd;
    (void)self;
    if (!PyArg_ParseTuple(args, "i:dio_alignment", &fd))
        return NULL;
#ifdef STATX_DIOALIGN
    struct statx stx;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        if (errno == ENOSYS || errno == EINVAL)
            Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!(stx.stx_mask & STATX_DIOALIGN))
        Py_RETURN_NONE;
    return Py_BuildValue("(II)", stx.stx_dio_mem_align, stx.stx_dio_offset_align);
#else
    Py_RETURN_NONE;
#endif
}

/* A call on a byte range of an open file, (fd, offset, length) from Python, without the GIL; OSError on failure. */
typedef int (*range_call)(int fd, off_t offset, off_t length);

static PyObject *on_range(PyObject *args, const char *format, range_call call)
{
    int fd;
    long long offset, length;
    int rc;
    if (!PyArg_ParseTuple(args, format, &fd, &offset, &length))
        return NULL;
    Py_BEGIN_ALLOW_THREADS rc = call(fd, (off_t)offset, (off_t)length);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(fallocate_doc,
             "fallocate(fd, offset, length, /) -> None\n\n"
             "Reserve blocks and extend the file (Linux fallocate, mode 0). Raises OSError, "
             "EOPNOTSUPP where the filesystem cannot; unlike posix_fallocate it never "
             "emulates by writing.");

static int reserve(int fd, off_t offset, off_t length) { return fallocate(fd, 0, offset, length); }

static PyObject *py_fallocate(PyObject *self, PyObject *args)
{
    (void)self;
    return on_range(args, "iLL:fallocate", reserve);
}

PyDoc_STRVAR(start_writeback_doc,
             "start_writeback(fd, offset, length, /) -> None\n\n"
             "Start writing the dirty pages of a byte range to the disk without waiting for them "
             "(sync_file_range, SYNC_FILE_RANGE_WRITE): what a later fsync then waits on is only "
             "the rest. Durability is still the fsync's. Raises OSError.");

static int write_back(int fd, off_t offset, off_t length)
{
    return sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE);
}

static PyObject *py_start_writeback(PyObject *self, PyObject *args)
{
    (void)self;
    return on_range(args, "iLL:start_writeback", write_back);
}

/* cachestat(2), Linux 6.5; syscall 451 on every architecture. Declared here since older kernel headers lack it. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct fp_cachestat_range {
    uint64_t off, len;
};
struct fp_cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

PyDoc_STRVAR(cached_pages_doc,
             "cached_pages(fd, offset, length, /) -> int | None\n\n"
             "Pages of [offset, offset + length) of an open file that are in the page cache, dirty ones "
             "included (cachestat); None where the kernel cannot tell (before Linux 6.5, a seccomp "
             "filter refusing the call, a file without a page cache).");

static PyObject *py_cached_pages(PyObject *self, PyObject *args)
{
    int fd;
    unsigned long long offset, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKK:cached_pages", &fd, &offset, &length))
        return NULL;
    if (length == 0) /* cachestat reads 0 as "to the end of the file" */
        return PyLong_FromLong(0);
    struct fp_cachestat_range range = {offset, length};
    struct fp_cachestat cs;
    long rc;
    Py_BEGIN_ALLOW_THREADS rc = syscall(__NR_cachestat, fd, &range, &cs, 0);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        if (errno == ENOSYS || errno == EPERM || errno == EOPNOTSUPP)
            Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(cs.nr_cache);
}

PyDoc_STRVAR(address_doc, "address(buffer, /) -> int\n\nStart address of a bytes-like object.");

static PyObject *py_address(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *r = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return r;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#define HUGE_PAGE (2u << 20)

/* The pages holding a buffer: its start rounded down and its end up to the page size. */
static int page_span(Py_buffer *view, uintptr_t *start, size_t *length)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)view->buf & ~(page - 1);
    uintptr_t hi = ((uintptr_t)view->buf + (uintptr_t)view->len + page - 1) & ~(page - 1);
    *start = lo;
    *length = hi - lo;
    return view->len > 0;
}

PyDoc_STRVAR(populate_doc,
             "populate(buffer, /) -> int\n\n"
             "Fault in the pages of a writable buffer that hold none yet (mincore), writable, "
             "without changing a byte (madvise MADV_POPULATE_WRITE, Linux 5.14), GIL released; "
             "returns the bytes it faulted in. Pages already there are skipped: faulting them in "
             "again walks them one by one for nothing (a touched target cost 18% more CPU). "
             "Raises OSError: EINVAL where the kernel is older.");

/* MADV_POPULATE_WRITE on [start, end); 0 or -1 with errno set. */
static int populate_run(uintptr_t start, uintptr_t end)
{
    return madvise((void *)start, end - start, MADV_POPULATE_WRITE);
}

/* Populate the runs of [start, start + length) that mincore finds without pages; the bytes populated, or
 * -1 with errno set. Without the vector (no memory for it, or mincore failing), the whole span. */
static ssize_t populate_missing(uintptr_t start, size_t length)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = length / page;
    unsigned char *resident = PyMem_RawMalloc(pages);
    if (!resident || mincore((void *)start, length, resident) < 0) {
        PyMem_RawFree(resident);
        return populate_run(start, start + length) < 0 ? -1 : (ssize_t)length;
    }
    ssize_t done = 0;
    size_t i = 0;
    while (i < pages) {
        for (; i < pages && (resident[i] & 1); i++)
            ;
        size_t first = i;
        for (; i < pages && !(resident[i] & 1); i++)
            ;
        if (i > first) {
            if (populate_run(start + first * page, start + i * page) < 0) {
                PyMem_RawFree(resident);
                return -1;
            }
            done += (ssize_t)((i - first) * page);
        }
    }
    PyMem_RawFree(resident);
    return done;
}

static PyObject *py_populate(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    uintptr_t start;
    size_t length;
    ssize_t done = 0;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (page_span(&view, &start, &length)) {
        Py_BEGIN_ALLOW_THREADS done = populate_missing(start, length);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    if (done < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromSsize_t(done);
}

PyDoc_STRVAR(advise_huge_doc,
             "advise_huge(buffer, /) -> [(offset, length), ...]\n\n"
             "Ask for transparent huge pages (madvise MADV_HUGEPAGE) on the 2 MiB-aligned "
             "blocks of a writable buffer that hold no page yet (mincore), so that their first "
             "touch maps 2 MiB at a time; blocks already touched are left alone. Returns the "
             "runs advised, as offsets into the buffer: none where the kernel has no huge pages.");

/* Advise [start, end) and append it to runs as offsets from base; 0, or -1 with an exception set. */
static int advise_run(PyObject *runs, uintptr_t base, uintptr_t start, uintptr_t end)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = madvise((void *)start, end - start, MADV_HUGEPAGE);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return 0; /* EINVAL: no transparent huge pages in this kernel; the memory is as it was */
    PyObject *run = Py_BuildValue("(nn)", (Py_ssize_t)(start - base), (Py_ssize_t)(end - start));
    if (!run)
        return -1;
    rc = PyList_Append(runs, run);
    Py_DECREF(run);
    return rc;
}

static PyObject *py_advise_huge(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *runs = PyList_New(0);
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), base = (uintptr_t)view.buf;
    uintptr_t lo = (base + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    uintptr_t hi = (base + (uintptr_t)view.len) & ~(uintptr_t)(HUGE_PAGE - 1);
    unsigned char *resident = NULL;
    if (!runs || hi <= lo)
        goto done;
    if (!(resident = PyMem_RawMalloc((hi - lo) / page))) {
        Py_CLEAR(runs);
        PyErr_NoMemory();
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = mincore((void *)lo, hi - lo, resident);
    Py_END_ALLOW_THREADS
    if (rc < 0) /* part of the range unmapped: cannot be, for a live buffer; then advise nothing */
        goto done;
    size_t per_block = HUGE_PAGE / page;
    uintptr_t run = 0; /* start of the current run of untouched blocks; 0: none */
    for (uintptr_t block = lo; block <= hi; block += HUGE_PAGE) {
        int untouched = block < hi;
        for (size_t i = 0; untouched && i < per_block; i++)
            untouched = !(resident[(block - lo) / page + i] & 1);
        if (untouched && !run)
            run = block;
        else if (!untouched && run) {
            if (advise_run(runs, base, run, block) < 0) {
                Py_CLEAR(runs);
                break;
            }
            run = 0;
        }
    }
done:
    PyMem_RawFree(resident);
    PyBuffer_Release(&view);
    return runs;
}

static PyMethodDef system_methods[] = {
    {"dio_alignment", py_dio_alignment, METH_VARARGS, dio_alignment_doc},
    {"fallocate", py_fallocate, METH_VARARGS, fallocate_doc},
    {"start_writeback", py_start_writeback, METH_VARARGS, start_writeback_doc},
    {"cached_pages", py_cached_pages, METH_VARARGS, cached_pages_doc},
    {"address", py_address, METH_O, address_doc},
    {"populate", py_populate, METH_O, populate_doc},
    {"advise_huge", py_advise_huge, METH_O, advise_huge_doc},
    {NULL, NULL, 0, NULL}};

int cio_system_add(PyObject *module) { return PyModule_AddFunctions(module, system_methods); }
