/* Pieces, the arrays of one fused all-reduce, as the op calls (_fastcall.c) use them;
 * the type, its sum kernels and the streamed copies are in _fastcall_pieces.c. */
#ifndef SPMD_FASTCALL_PIECES_H
#define SPMD_FASTCALL_PIECES_H

#include "_fastcall_bind.h"

/* Pieces: the arrays of an all_reduce_coalesced, held alive, as consecutive pieces of
 * one virtual buffer.  The shared-memory engine gathers them straight into its window
 * and sums into them straight from the peers' copies, and the MPI path packs them into
 * one buffer: each byte is copied once on the way in and once on the way out.  The sum
 * adds in rank order, as numpy's add in spmd.backends.shm.reduce does, so every rank
 * gets the same bits whichever of the two ran. */
#define MAX_FUSED 4096

typedef struct { char *data; Py_ssize_t len; } Piece;

typedef struct {
    PyObject_HEAD
    Py_ssize_t k, nbytes, itemsize;
    PyObject *dtype;
    int kernel;              /* its SUM_* kernel (summed[dtype]), 0 if sum_from does not add it */
    Piece *piece;
    PyObject **refs;
} Pieces;

extern INTERNAL PyTypeObject PiecesType;

/* The Pieces of ``seq`` (a list of two or more exact, C-contiguous, writable ndarrays of
 * one dtype); Py_None, no error set, for any other list. */
INTERNAL PyObject *pieces_of(PyObject *seq);
/* Copy the arrays, in order, into dst; copy consecutive pieces of src into the arrays. */
INTERNAL void gather(const Pieces *p, char *dst);
INTERNAL void scatter(const Pieces *p, const char *src);

/* pieces(arrays) and stream(dst, src): the module-level functions. */
INTERNAL PyObject *fc_pieces(PyObject *m, PyObject *seq);
INTERNAL PyObject *fc_stream(PyObject *m, PyObject *const *a, Py_ssize_t n);

#endif
