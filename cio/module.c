/*
 * fp_dcp._native._cio: the native half of fp-dcp, one concern per file, each adding its part to the module:
 *
 * - crc32c.c: CRC-32C and the copies that checksum as they go (crc32c, copy_crc32c, read_crc32c, write_crc32c,
 *   crc32c_combine);
 * - hash.c: Hash128, a running XXH3-128 (libxxhash) that those checksums feed;
 * - system.c: small system helpers (dio_alignment, fallocate, start_writeback, cached_pages, address, populate,
 *   advise_huge);
 * - userfault.c: untouched memory filled page by page (userfaultfd, register_untouched, fill_crc32c,
 *   serve_faults, unregister);
 * - ring.c: Ring, one liburing ring;
 * - cio.h: what they share.
 *
 * This file: the module, and LINKED_LIBRARIES. Every libc/liburing return code is checked; errors become
 * OSError.
 */
#include "cio.h"

/* The optional libraries this build links, named as fp_dcp._native.libraries names them. */
static const char *const linked_libraries[] = {
#ifdef FP_DCP_HAVE_LIBURING
    "liburing",
#endif
#ifdef FP_DCP_HAVE_ISAL
    "isa-l",
#endif
#ifdef FP_DCP_HAVE_XXHASH
    "libxxhash",
#endif
};

static int add_linked_libraries(PyObject *m)
{
    size_t n = sizeof(linked_libraries) / sizeof(linked_libraries[0]);
    PyObject *names = PyTuple_New((Py_ssize_t)n);
    if (!names)
        return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *name = PyUnicode_FromString(linked_libraries[i]);
        if (!name) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, (Py_ssize_t)i, name);
    }
    int rc = PyModule_AddObjectRef(m, "LINKED_LIBRARIES", names);
    Py_DECREF(names);
    return rc;
}

static struct PyModuleDef cio_module = {
    PyModuleDef_HEAD_INIT, "fp_dcp._native._cio", "Native I/O and checksum primitives of fp-dcp (see cio/).", -1,
    NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cio(void)
{
    PyObject *m = PyModule_Create(&cio_module);
    if (!m)
        return NULL;
    if (cio_crc32c_add(m) < 0 || cio_hash_add(m) < 0 || cio_system_add(m) < 0 || cio_userfault_add(m) < 0 ||
        cio_ring_add(m) < 0 || add_linked_libraries(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
