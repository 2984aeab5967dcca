/* The bound MPI library and spmd's objects: what bind() (in _fastcall_bind.c) is told
 * once, and the typed calls of the MPI functions, inline where each op makes them.
 *
 * Nothing here links against MPI.  spmd/backends/mpi/fastcall.py binds the library mpi4py
 * loaded: the addresses of the MPI functions, the handle size of that library's ABI (4
 * bytes for MPICH's int handles, 8 for pointer handles: Open MPI, the MPI-5 ABI) and
 * the handles of the datatypes and reduce ops, so one build runs with any MPI. */
#ifndef SPMD_FASTCALL_BIND_H
#define SPMD_FASTCALL_BIND_H

#include "_fastcall.h"

typedef union { int32_t i; void *p; } Handle;   /* an MPI_Request written by MPI */

enum { FN_IALLREDUCE, FN_IREDUCE, FN_IBCAST, FN_IALLGATHER, FN_IREDUCE_SCATTER_BLOCK,
       FN_IALLTOALL, FN_IBARRIER, FN_ISEND, FN_IRECV, FN_TEST, FN_COUNT };

extern INTERNAL void *fn[FN_COUNT];
extern INTERNAL int h4;               /* handles are 4-byte ints (else pointer-sized) */
extern INTERNAL void *in_place;       /* MPI_IN_PLACE */

/* One call site per MPI function, typed for either handle size: a handle travels as
 * intptr_t here and is narrowed to int where the library's handles are ints. */
#define H4(x) ((int32_t)(x))
#define HP(x) ((void *)(x))

typedef int (*test_fn)(void *, int *, void *);

/* Iallreduce, Ireduce_scatter_block: (sendbuf, recvbuf, n, type, op, comm, req) */
static inline int c_reduction(int f, const void *s, void *r, int n, intptr_t dt, intptr_t op,
                              intptr_t comm, void *req) {
    if (h4) return ((int (*)(const void *, void *, int, int32_t, int32_t, int32_t, void *))
                    fn[f])(s, r, n, H4(dt), H4(op), H4(comm), req);
    return ((int (*)(const void *, void *, int, void *, void *, void *, void *))fn[f])(
        s, r, n, HP(dt), HP(op), HP(comm), req);
}

static inline int c_ireduce(const void *s, void *r, int n, intptr_t dt, intptr_t op, int root,
                            intptr_t comm, void *req) {
    if (h4) return ((int (*)(const void *, void *, int, int32_t, int32_t, int, int32_t,
                             void *))fn[FN_IREDUCE])(s, r, n, H4(dt), H4(op), root, H4(comm), req);
    return ((int (*)(const void *, void *, int, void *, void *, int, void *, void *))
            fn[FN_IREDUCE])(s, r, n, HP(dt), HP(op), root, HP(comm), req);
}

static inline int c_ibcast(void *b, int n, intptr_t dt, int root, intptr_t comm, void *req) {
    if (h4) return ((int (*)(void *, int, int32_t, int, int32_t, void *))fn[FN_IBCAST])(
        b, n, H4(dt), root, H4(comm), req);
    return ((int (*)(void *, int, void *, int, void *, void *))fn[FN_IBCAST])(
        b, n, HP(dt), root, HP(comm), req);
}

/* Iallgather, Ialltoall: (sendbuf, n, type, recvbuf, n, type, comm, req) */
static inline int c_exchange(int f, const void *s, void *r, int n, intptr_t dt, intptr_t comm,
                             void *req) {
    if (h4) return ((int (*)(const void *, int, int32_t, void *, int, int32_t, int32_t,
                             void *))fn[f])(s, n, H4(dt), r, n, H4(dt), H4(comm), req);
    return ((int (*)(const void *, int, void *, void *, int, void *, void *, void *))fn[f])(
        s, n, HP(dt), r, n, HP(dt), HP(comm), req);
}

static inline int c_ibarrier(intptr_t comm, void *req) {
    if (h4) return ((int (*)(int32_t, void *))fn[FN_IBARRIER])(H4(comm), req);
    return ((int (*)(void *, void *))fn[FN_IBARRIER])(HP(comm), req);
}

/* Isend, Irecv: (buf, n, type, peer, tag, comm, req) */
static inline int c_p2p(int f, void *b, int n, intptr_t dt, int peer, int tag, intptr_t comm,
                        void *req) {
    if (h4) return ((int (*)(void *, int, int32_t, int, int, int32_t, void *))fn[f])(
        b, n, H4(dt), peer, tag, H4(comm), req);
    return ((int (*)(void *, int, void *, int, int, void *, void *))fn[f])(
        b, n, HP(dt), peer, tag, HP(comm), req);
}

/* -- what spmd tells this module at bind time --------------------------------------- */

#define MAX_DTYPES 32
#define MAX_OPS 16

typedef struct { PyObject *dtype; intptr_t type; } Moved;          /* dtype -> MPI type */
typedef struct { PyObject *op; int n; Moved dt[MAX_DTYPES]; intptr_t mop[MAX_DTYPES]; } Reduced;

extern INTERNAL Moved moved[MAX_DTYPES];
extern INTERNAL int n_moved;
extern INTERNAL Reduced reduced[MAX_OPS];
extern INTERNAL int n_reduced;

extern INTERNAL PyTypeObject *ndarray_type;
extern INTERNAL PyObject *observers;   /* spmd.core.work.observers */
/* the flight recorder: the one observer this path serves */
extern INTERNAL PyObject *recorder;
/* recorder.push_out(slot): keep an in-flight op it overwrites */
extern INTERNAL PyObject *push_out;
/* recorder.end(number): an op pushed out while waited on */
extern INTERNAL PyObject *end_op;
/* (op, context, number, waited, request, buffers, receive, why) */
extern INTERNAL PyObject *given_up;
/* (code): raises mpi4py's MPI.Exception */
extern INTERNAL PyObject *mpi_error;
/* (): the fusion limit (spmd.backends.mpi.packing.get_bucket_bytes) */
extern INTERNAL PyObject *bucket_bytes;
/* (engine, pieces, op): its fused all_reduce, waited */
extern INTERNAL PyObject *shm_all_reduce;
/* (exc, op, context): the error to raise for exc (spmd.backends.mpi.faults.failure) */
extern INTERNAL PyObject *failure_of;
/* {dtype: kernel code}: the dtypes Pieces.sum_from adds (made by bind() from the names
 * spmd.backends.mpi.routes.SUMMED gives, _fastcall_bind.c's KERNEL_NAMES) */
extern INTERNAL PyObject *summed;
extern INTERNAL long tag_ub;
extern INTERNAL int bound;

static inline intptr_t moved_type(PyObject *dtype) {   /* 0: not a dtype this path moves */
    for (int i = 0; i < n_moved; i++)
        if (moved[i].dtype == dtype) return moved[i].type;
    return 0;
}

/* The MPI type and op for reducing dtype with op; 0 if MPI does not reduce it itself. */
static inline int reduced_type(PyObject *op, PyObject *dtype, intptr_t *type, intptr_t *mop) {
    for (int i = 0; i < n_reduced; i++) {
        if (reduced[i].op != op) continue;
        for (int j = 0; j < reduced[i].n; j++) {
            if (reduced[i].dt[j].dtype == dtype) {
                *type = reduced[i].dt[j].type;
                *mop = reduced[i].mop[j];
                return 1;
            }
        }
        return 0;
    }
    return 0;
}

/* 1 once bind() has run; else 0, with the error set. */
static inline int check_bound(void) {
    if (bound) return 1;
    PyErr_SetString(PyExc_RuntimeError, "spmd.backends.mpi._fastcall: bind() has not been called");
    return 0;
}

/* bind(...): the module-level function (_fastcall_bind.c says its arguments). */
INTERNAL PyObject *fc_bind(PyObject *m, PyObject *args, PyObject *kw);

#endif
