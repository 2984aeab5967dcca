/* The flight recorder's writer: an op recorded into the recorder's ring as
 * spmd.core.flight_recorder.FlightRecorder.begin and .end write it, without a Python
 * object per call.  record() and finish() run in every op, inline; the ring's hand-over
 * (set_ring) is in _fastcall_recorder.c. */
#ifndef SPMD_FASTCALL_RECORDER_H
#define SPMD_FASTCALL_RECORDER_H

#include "_fastcall_bind.h"

#define IN_FLIGHT (-1.0)
#define WRITING (-2.0)
#define P2P_FLAG 4
enum { C_NUMBERS, C_SEQS, C_SIZES, C_T0, C_T1, C_FLAGS, N_COLUMNS };

typedef struct {
    Py_ssize_t capacity;          /* 0: no ring handed over yet */
    PyObject *storage;            /* what set_ring read of the Ring: holds every column alive */
    PyObject *next_number;        /* itertools.count shared with the Python writer */
    PyObject *ops, *groups, *dtypes, *engines, *devices;   /* lists */
    Py_buffer view[N_COLUMNS];
    int64_t *numbers, *seqs, *sizes;
    double *t0, *t1;
    uint8_t *flags;
} Ring;
extern INTERNAL Ring ring;

/* set_ring(*, capacity, ...): the module-level function. */
INTERNAL PyObject *fc_set_ring(PyObject *m, PyObject *args, PyObject *kw);

/* Put v in list[i]; the old item goes to *old (released by the caller once the slot is
 * whole: releasing it may run Python code). */
static inline void put(PyObject *list, Py_ssize_t i, PyObject *v, PyObject **old) {
    *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, Py_NewRef(v));
}

/* Record the started op in the ring, as FlightRecorder.begin does (the same columns in
 * the same order; the GIL is held throughout, so no reader sees the slot half written).
 * first: its first array, or NULL.  The op's number; -1 with the recorder off; -2 on
 * error. */
static inline int64_t record(int record_on, int op, FastComm *fc, Py_buffer *first,
                             PyObject *dtype) {
    if (!record_on) return -1;
    PyObject *num = Py_TYPE(ring.next_number)->tp_iternext(ring.next_number);
    if (num == NULL) return -2;
    int64_t n = PyLong_AsLongLong(num);
    Py_DECREF(num);
    if (n == -1 && PyErr_Occurred()) return -2;
    Py_ssize_t i = (Py_ssize_t)(n % ring.capacity);
    if (ring.t1[i] == IN_FLIGHT) {     /* an op still in flight: the recorder keeps it */
        PyObject *slot = PyLong_FromSsize_t(i);
        PyObject *r = slot ? PyObject_CallOneArg(push_out, slot) : NULL;
        Py_XDECREF(slot);
        if (r == NULL) return -2;
        Py_DECREF(r);
        if (ring.capacity == 0 || n % ring.capacity != i) {   /* resized meanwhile */
            PyErr_SetString(PyExc_RuntimeError, "the flight recorder was resized during an op");
            return -2;
        }
    }
    int p2p = op == O_SEND || op == O_RECV;
    int64_t seq = ++fc->seq[p2p];
    PyObject *old[5];
    ring.numbers[i] = n;
    put(ring.ops, i, s_ops[op], &old[0]);
    put(ring.groups, i, fc->ctx, &old[1]);
    ring.seqs[i] = seq;
    ring.sizes[i] = first ? first->len / first->itemsize : -1;
    put(ring.dtypes, i, dtype ? dtype : Py_None, &old[2]);
    ring.flags[i] = p2p ? P2P_FLAG : 0;
    put(ring.engines, i, s_mpi_engine, &old[3]);
    put(ring.devices, i, Py_None, &old[4]);
    ring.t0[i] = now();
    ring.t1[i] = IN_FLIGHT;
    for (int k = 0; k < 5; k++) Py_XDECREF(old[k]);
    return n;
}

/* The op's end time (its slot, or the recorder's copy if it was pushed out meanwhile). */
static inline int finish(int64_t n) {
    if (n < 0) return 0;
    if (ring.capacity > 0) {
        Py_ssize_t i = (Py_ssize_t)(n % ring.capacity);
        if (ring.numbers[i] == n) {
            if (ring.t1[i] == IN_FLIGHT) ring.t1[i] = now();
            return 0;
        }
    }
    PyObject *num = PyLong_FromLongLong(n);
    PyObject *r = num ? PyObject_CallOneArg(end_op, num) : NULL;
    Py_XDECREF(num);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

#endif
