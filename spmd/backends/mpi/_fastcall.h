/* What every file of spmd.backends.mpi._fastcall shares: the ops this path runs, the
 * state of one group (FastComm) and of one call (Call), numpy's array layout, the clock.
 *
 * The module is one concept per file; hot code that crosses files is static inline in
 * their headers, so a call's data path compiles into one function as before the split:
 *   _fastcall.c           the module, FastComm and the op calls (start, record, wait, end)
 *   _fastcall_bind.[ch]   the bound MPI library and spmd's objects (bind())
 *   _fastcall_recorder.[ch]  the flight recorder's writer (its ring)
 *   _fastcall_wait.[ch]   the wait loop, and how a wait gives up
 *   _fastcall_pieces.[ch] Pieces (the arrays of a fused all-reduce), its sum kernels and
 *                         streamed copies
 * Headers include only those above them in this order: _fastcall.h, _fastcall_bind.h,
 * then the recorder's, the wait's and the Pieces' (each on its own). */
#ifndef SPMD_FASTCALL_H
#define SPMD_FASTCALL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Names shared between this module's files stay inside the module: a hidden symbol is
 * reached directly, as a static one is, not through the dynamic linker's tables. */
#if defined(__GNUC__)
#define INTERNAL __attribute__((visibility("hidden")))
#else
#define INTERNAL
#endif

/* The ops, as the flight recorder and the Python side name them (interned at import). */
enum { O_ALL_REDUCE, O_BROADCAST, O_REDUCE, O_ALL_GATHER, O_REDUCE_SCATTER, O_ALL_TO_ALL,
       O_BARRIER, O_SEND, O_RECV, O_COALESCED, N_OPS };
extern INTERNAL PyObject *s_ops[N_OPS];
extern INTERNAL PyObject *s_mpi_engine;   /* "MPI": the engine the recorder names */

/* What this path needs of one group, pushed by its host engine. */
typedef struct {
    PyObject_HEAD
    intptr_t comm;
    int rank, size;
    int alive;              /* 0 once the group is broken or destroyed (close()) */
    unsigned long long taken;   /* calls run here (tests read it: which path ran) */
    int yield;              /* nap between polls from the start (spmd.core.wait.yields) */
    double nap_after;       /* seconds of waiting after which polls nap (< 0: never) */
    double timeout;         /* seconds */
    PyObject *ctx;          /* the group's context: what Works, the recorder, errors name */
    PyObject *index;        /* global rank -> group rank */
    PyObject *counters;     /* the context's op_counters (collectives, p2p started) */
    Py_buffer counters_view;
    int64_t *seq;
    PyObject *shm;          /* the group's shared-memory engine, or None */
    long long from[N_OPS];  /* bytes from which that engine takes the op (LLONG_MAX: never) */
    long long gather_from, gather_to;
} FastComm;

/* One call's state: its group's FastComm, whether the recorder is on, the buffers it
 * holds. */
typedef struct {
    FastComm *fc;
    int rec;
    int nviews;
    Py_buffer view[2];
} Call;

/* numpy's public array layout (PyArrayObject_fields in numpy/ndarraytypes.h, the same
 * in numpy 1.x and 2.x) and two of its flags, read directly as pybind11 does: the fused
 * op checks and copies hundreds of arrays, and a buffer export per array would cost
 * more than the copy. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} NumpyArray;
#define NUMPY_C_CONTIGUOUS 0x0001
#define NUMPY_WRITEABLE 0x0400

static inline double now(void) {   /* time.monotonic()'s clock */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif
