/*
 * What the files of fp_dcp._native._cio share, and nothing else: each file keeps its own helpers static.
 *
 * Shared symbols are prefixed cio_ and declared hidden here, so that every build (setup.py's, a cross-compile
 * by hand) exports PyInit__cio alone, whatever its -fvisibility.
 */
#ifndef FP_DCP_CIO_H
#define FP_DCP_CIO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

/* Checksum (and, with dst, copy) in cache-sized steps: each step is checksummed and hashed first, which brings
 * it into the cache, then copied from there. */
#define COPY_STEP (256 * 1024)

/* A running XXH3-128 (hash.c); opaque to the files that feed it. */
typedef struct HashObject HashObject;

#pragma GCC visibility push(hidden)

/* crc32c.c: the CRC-32C kernel this build and CPU run (the raw register, no pre/post inversion), for
 * userfault.c's fills; a crc argument parsed; Python buffers checksummed and hashed, for Hash128.update. */
extern uint32_t (*cio_crc_raw)(uint32_t crc, const uint8_t *p, size_t n);
int cio_parse_crc(PyObject *obj, uint32_t *out);
int cio_checksum_buffers(Py_buffer *dst, Py_buffer *src, uint32_t *crc, PyObject *hasher);

/* hash.c: a Hash128 claimed, fed (without the GIL) and given back by the checksums that hash as they go. */
HashObject *cio_hash_claim(PyObject *obj);
int cio_hash_feed(HashObject *h, const void *p, size_t n);
void cio_hash_release(HashObject *h);

/* Each file's part of the module (its functions, types and constants), added by module.c's PyInit__cio; 0, or -1
 * with an exception set. */
int cio_crc32c_add(PyObject *module);
int cio_hash_add(PyObject *module);
int cio_system_add(PyObject *module);
int cio_userfault_add(PyObject *module);
int cio_ring_add(PyObject *module);

#pragma GCC visibility pop

#endif /* FP_DCP_CIO_H */
