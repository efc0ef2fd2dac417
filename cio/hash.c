/*
 * Hash128: a running XXH3-128 (libxxhash), the content hash incremental saves compare items by. Absent when
 * built without libxxhash: then claiming one for a checksum raises NotImplementedError.
 *
 * crc32c.c's checksums feed a Hash128 in the same pass as their CRC (cio_hash_claim, cio_hash_feed,
 * cio_hash_release); its own update() is one of those passes, without a CRC (cio_checksum_buffers).
 */
#include "cio.h"

#ifdef FP_DCP_HAVE_XXHASH
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h> /* libxxhash picks SSE2, AVX2 or AVX-512 at run time */
#endif

struct HashObject {
    PyObject_HEAD XXH3_state_t *state;
    int busy; /* set (under the GIL) while an update runs without it */
};

static PyTypeObject HashType;

static int hash_init(HashObject *h, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":Hash128", kwlist))
        return -1;
    if (!h->state && !(h->state = XXH3_createState())) {
        PyErr_NoMemory();
        return -1;
    }
    if (XXH3_128bits_reset(h->state) != XXH_OK) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3_128bits_reset failed");
        return -1;
    }
    h->busy = 0;
    return 0;
}

static void hash_dealloc(HashObject *h)
{
    if (h->state)
        XXH3_freeState(h->state);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

/* Claim h for an update that may run without the GIL; NULL (error set) if it is not a Hash128 or in use. */
HashObject *cio_hash_claim(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &HashType)) {
        PyErr_Format(PyExc_TypeError, "hasher must be a Hash128, not %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    HashObject *h = (HashObject *)obj;
    if (!h->state || h->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Hash128 is uninitialized or in use by another thread");
        return NULL;
    }
    h->busy = 1;
    return h;
}

int cio_hash_feed(HashObject *h, const void *p, size_t n)
{
    return XXH3_128bits_update(h->state, p, n) == XXH_OK ? 0 : -1;
}

/* Give back what cio_hash_claim took (h may be NULL: no hasher). */
void cio_hash_release(HashObject *h)
{
    if (h)
        h->busy = 0;
}

PyDoc_STRVAR(hash_update_doc, "update(data, /) -> None\n\nFeed bytes (the GIL is released for large ones).");

static PyObject *hash_update(HashObject *self, PyObject *arg)
{
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = cio_checksum_buffers(NULL, &data, NULL, (PyObject *)self);
    PyBuffer_Release(&data);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hash_hexdigest_doc,
             "hexdigest() -> str\n\nThe XXH3-128 of the bytes fed so far: 32 lowercase hex digits, "
             "xxHash's canonical (big-endian) form, as `xxhsum -H2` prints it.");

static PyObject *hash_hexdigest(HashObject *self, PyObject *unused)
{
    (void)unused;
    if (!self->state || self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Hash128 is uninitialized or in use by another thread");
        return NULL;
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(self->state));
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", canon.digest[i]);
    return PyUnicode_FromStringAndSize(hex, 32);
}

static PyMethodDef hash_methods[] = {
    {"update", (PyCFunction)hash_update, METH_O, hash_update_doc},
    {"hexdigest", (PyCFunction)hash_hexdigest, METH_NOARGS, hash_hexdigest_doc},
    {NULL, NULL, 0, NULL}};

static PyTypeObject HashType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fp_dcp._native._cio.Hash128",
    .tp_doc = "Hash128()\n\nA running XXH3-128 (seed 0). Feed it with update() or as the hasher of "
              "crc32c / copy_crc32c; one thread at a time.",
    .tp_basicsize = sizeof(HashObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hash_init,
    .tp_dealloc = (destructor)hash_dealloc,
    .tp_methods = hash_methods,
};

int cio_hash_add(PyObject *module)
{
    if (PyType_Ready(&HashType) < 0 || PyModule_AddObjectRef(module, "Hash128", (PyObject *)&HashType) < 0)
        return -1;
    return 0;
}

#else
HashObject *cio_hash_claim(PyObject *obj)
{
    (void)obj;
    PyErr_SetString(PyExc_NotImplementedError,
                    "fp_dcp._native._cio was built without libxxhash: no content hashing");
    return NULL;
}
int cio_hash_feed(HashObject *h, const void *p, size_t n)
{
    (void)h, (void)p, (void)n;
    return -1;
}
void cio_hash_release(HashObject *h) { (void)h; }
int cio_hash_add(PyObject *module)
{
    (void)module;
    return 0;
}
#endif /* FP_DCP_HAVE_XXHASH */
