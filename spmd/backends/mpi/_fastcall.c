/* The compiled call path of the common blocking ops on host arrays.
 *
 * A blocking collective or send/recv on contiguous numpy arrays, with a reduce op MPI
 * applies itself and a size below the shared-memory engine's thresholds, runs here
 * without the Python: the MPI call the MPI engine makes for it, then a wait without a
 * Work.  Each method returns False, having done nothing, for a call outside that case
 * (the engine's Python path then runs it); True once the op has completed.
 *
 * Nothing here links against MPI.  spmd/backends/mpi/fastcall.py binds the library mpi4py
 * loaded: the addresses of the MPI functions, the handle size of that library's ABI (4
 * bytes for MPICH's int handles, 8 for pointer handles: Open MPI, the MPI-5 ABI) and
 * the handles of the datatypes and reduce ops, so one build runs with any MPI.
 *
 * What a wait keeps from the Python path: the op is recorded in the flight recorder
 * (written into its preallocated ring here: no Python object per call), a wait past
 * the group's timeout ends in the Python function that raises the same diagnosed
 * DistTimeoutError, signals are checked and the GIL is handed over while waiting.
 *
 * The path is the host engine's: the engine (spmd/backends/host.py) calls a FastComm's
 * method for a blocking op on its group, with the arguments its own method gets (group
 * ranks, validated arrays).  State crosses into C as arguments, never by looking up
 * attribute names: the engine makes the FastComm with what this path needs of the group
 * and pushes every change to it (thresholds, the group broken or destroyed); the
 * recorder hands over its ring's columns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <string.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

/* -- the bound MPI library ------------------------------------------------------- */

typedef union { int32_t i; void *p; } Handle;   /* an MPI_Request written by MPI */

enum { FN_IALLREDUCE, FN_IREDUCE, FN_IBCAST, FN_IALLGATHER, FN_IREDUCE_SCATTER_BLOCK,
       FN_IALLTOALL, FN_IBARRIER, FN_ISEND, FN_IRECV, FN_TEST, FN_COUNT };
static const char *const FN_NAMES[FN_COUNT] = {
    "MPI_Iallreduce", "MPI_Ireduce", "MPI_Ibcast", "MPI_Iallgather",
    "MPI_Ireduce_scatter_block", "MPI_Ialltoall", "MPI_Ibarrier", "MPI_Isend",
    "MPI_Irecv", "MPI_Test"};

static void *fn[FN_COUNT];
static int h4;               /* handles are 4-byte ints (else pointer-sized) */
static void *in_place;       /* MPI_IN_PLACE */

/* One call site per MPI function, typed for either handle size: a handle travels as
 * intptr_t here and is narrowed to int where the library's handles are ints. */
#define H4(x) ((int32_t)(x))
#define HP(x) ((void *)(x))

typedef int (*test_fn)(void *, int *, void *);

/* Iallreduce, Ireduce_scatter_block: (sendbuf, recvbuf, n, type, op, comm, req) */
static int c_reduction(int f, const void *s, void *r, int n, intptr_t dt, intptr_t op,
                       intptr_t comm, void *req) {
    if (h4) return ((int (*)(const void *, void *, int, int32_t, int32_t, int32_t, void *))
                    fn[f])(s, r, n, H4(dt), H4(op), H4(comm), req);
    return ((int (*)(const void *, void *, int, void *, void *, void *, void *))fn[f])(
        s, r, n, HP(dt), HP(op), HP(comm), req);
}

static int c_ireduce(const void *s, void *r, int n, intptr_t dt, intptr_t op, int root,
                     intptr_t comm, void *req) {
    if (h4) return ((int (*)(const void *, void *, int, int32_t, int32_t, int, int32_t,
                             void *))fn[FN_IREDUCE])(s, r, n, H4(dt), H4(op), root, H4(comm), req);
    return ((int (*)(const void *, void *, int, void *, void *, int, void *, void *))
            fn[FN_IREDUCE])(s, r, n, HP(dt), HP(op), root, HP(comm), req);
}

static int c_ibcast(void *b, int n, intptr_t dt, int root, intptr_t comm, void *req) {
    if (h4) return ((int (*)(void *, int, int32_t, int, int32_t, void *))fn[FN_IBCAST])(
        b, n, H4(dt), root, H4(comm), req);
    return ((int (*)(void *, int, void *, int, void *, void *))fn[FN_IBCAST])(
        b, n, HP(dt), root, HP(comm), req);
}

/* Iallgather, Ialltoall: (sendbuf, n, type, recvbuf, n, type, comm, req) */
static int c_exchange(int f, const void *s, void *r, int n, intptr_t dt, intptr_t comm,
                      void *req) {
    if (h4) return ((int (*)(const void *, int, int32_t, void *, int, int32_t, int32_t,
                             void *))fn[f])(s, n, H4(dt), r, n, H4(dt), H4(comm), req);
    return ((int (*)(const void *, int, void *, void *, int, void *, void *, void *))fn[f])(
        s, n, HP(dt), r, n, HP(dt), HP(comm), req);
}

static int c_ibarrier(intptr_t comm, void *req) {
    if (h4) return ((int (*)(int32_t, void *))fn[FN_IBARRIER])(H4(comm), req);
    return ((int (*)(void *, void *))fn[FN_IBARRIER])(HP(comm), req);
}

/* Isend, Irecv: (buf, n, type, peer, tag, comm, req) */
static int c_p2p(int f, void *b, int n, intptr_t dt, int peer, int tag, intptr_t comm,
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

static Moved moved[MAX_DTYPES];
static int n_moved;
static Reduced reduced[MAX_OPS];
static int n_reduced;

static PyTypeObject *ndarray_type;
static PyObject *observers;      /* spmd.core.work.observers */
static PyObject *recorder;       /* the flight recorder: the one observer this path serves */
static PyObject *push_out;       /* recorder.push_out(slot): keep an in-flight op it overwrites */
static PyObject *end_op;         /* recorder.end(number): an op pushed out while waited on */
static PyObject *given_up;       /* (op, context, number, waited, request, buffers, receive, why) */
static PyObject *mpi_error;      /* (code): raises mpi4py's MPI.Exception */
static PyObject *bucket_bytes;   /* (): the fusion limit (spmd.backends.mpi.packing.get_bucket_bytes) */
static PyObject *shm_all_reduce; /* (engine, pieces, op): its fused all_reduce, waited */
static PyObject *summed;         /* {dtype: SUM_* kernel}: the dtypes Pieces.sum_from adds */
static long tag_ub;
static int bound;

static PyObject *s_mpi_engine;
enum { O_ALL_REDUCE, O_BROADCAST, O_REDUCE, O_ALL_GATHER, O_REDUCE_SCATTER, O_ALL_TO_ALL,
       O_BARRIER, O_SEND, O_RECV, O_COALESCED, N_OPS };
static PyObject *s_ops[N_OPS];
static const char *const OP_NAMES[N_OPS] = {
    "all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "barrier", "send", "recv", "all_reduce_coalesced"};

/* -- the flight recorder's ring (spmd.core.flight_recorder.Ring) ------------------- */

#define IN_FLIGHT (-1.0)
#define WRITING (-2.0)
#define P2P_FLAG 4
enum { C_NUMBERS, C_SEQS, C_SIZES, C_T0, C_T1, C_FLAGS, N_COLUMNS };

static struct {
    Py_ssize_t capacity;          /* 0: no ring handed over yet */
    PyObject *storage;            /* Ring.storage(): holds every column alive */
    PyObject *next_number;        /* itertools.count shared with the Python writer */
    PyObject *ops, *groups, *dtypes, *engines, *devices;   /* lists */
    Py_buffer view[N_COLUMNS];
    int64_t *numbers, *seqs, *sizes;
    double *t0, *t1;
    uint8_t *flags;
} ring;

static void ring_release(void) {
    if (ring.storage == NULL) return;
    for (int i = 0; i < N_COLUMNS; i++) PyBuffer_Release(&ring.view[i]);
    Py_CLEAR(ring.storage);
    ring.capacity = 0;
}

/* set_ring(storage): the recorder's ring, as Ring.storage() gives it (again at every
 * resize). */
static PyObject *fc_set_ring(PyObject *m, PyObject *storage) {
    Py_ssize_t cap;
    PyObject *count, *col[N_COLUMNS], *ops, *groups, *dtypes, *engines, *devices;
    if (!PyArg_ParseTuple(storage, "nOOO!OOOOOOOO!O!", &cap, &count, &col[C_NUMBERS],
                          &PyList_Type, &ops, &groups, &col[C_SEQS], &col[C_SIZES], &dtypes,
                          &col[C_T0], &col[C_T1], &col[C_FLAGS], &PyList_Type, &engines,
                          &PyList_Type, &devices))
        return NULL;
    static const char *const formats[N_COLUMNS] = {"q", "q", "q", "d", "d", "B"};
    Py_buffer views[N_COLUMNS];
    int held = 0;
    for (; held < N_COLUMNS; held++) {
        if (PyObject_GetBuffer(col[held], &views[held], PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
            goto fail;
        if (views[held].len / views[held].itemsize != cap
                || strcmp(views[held].format, formats[held]) != 0) {
            held++;
            PyErr_SetString(PyExc_ValueError, "set_ring: a column of the wrong type or length");
            goto fail;
        }
    }
    if (!PyList_Check(groups) || !PyList_Check(dtypes) || PyList_GET_SIZE(ops) != cap
            || PyList_GET_SIZE(groups) != cap || PyList_GET_SIZE(dtypes) != cap
            || PyList_GET_SIZE(engines) != cap || PyList_GET_SIZE(devices) != cap || cap < 1) {
        PyErr_SetString(PyExc_ValueError, "set_ring: lists of the wrong length");
        goto fail;
    }
    ring_release();
    memcpy(ring.view, views, sizeof views);
    ring.storage = Py_NewRef(storage);
    ring.capacity = cap;
    ring.next_number = count;
    ring.ops = ops;
    ring.groups = groups;
    ring.dtypes = dtypes;
    ring.engines = engines;
    ring.devices = devices;
    ring.numbers = views[C_NUMBERS].buf;
    ring.seqs = views[C_SEQS].buf;
    ring.sizes = views[C_SIZES].buf;
    ring.t0 = views[C_T0].buf;
    ring.t1 = views[C_T1].buf;
    ring.flags = views[C_FLAGS].buf;
    Py_RETURN_NONE;
fail:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    return NULL;
}

/* Put v in list[i]; the old item goes to *old (released by the caller once the slot is
 * whole: releasing it may run Python code). */
static void put(PyObject *list, Py_ssize_t i, PyObject *v, PyObject **old) {
    *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, Py_NewRef(v));
}

/* -- FastComm: what this path needs of one group, pushed by its host engine -------- */

typedef struct {
    PyObject_HEAD
    intptr_t comm;
    int rank, size;
    int alive;              /* 0 once the group is broken or destroyed (close()) */
    unsigned long long taken;   /* calls run here (tests read it: which path ran) */
    int yield;              /* ranks outnumber cores: give the core away while waiting */
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

static int fastcomm_init(FastComm *self, PyObject *args, PyObject *kw) {
    long long comm;
    PyObject *ctx, *index, *counters, *shm;
    static char *names[] = {"comm", "rank", "size", "context", "index", "op_counters",
                            "timeout", "oversubscribed", "shm", NULL};
    if (self->ctx != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FastComm: initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LiiOO!OdpO", names, &comm, &self->rank,
                                     &self->size, &ctx, &PyDict_Type, &index, &counters,
                                     &self->timeout, &self->yield, &shm))
        return -1;
    if (PyObject_GetBuffer(counters, &self->counters_view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    if (self->counters_view.len != 2 * (Py_ssize_t)sizeof(int64_t)
            || strcmp(self->counters_view.format, "q") != 0) {
        PyBuffer_Release(&self->counters_view);
        PyErr_SetString(PyExc_ValueError, "FastComm: op_counters must be two int64s");
        return -1;
    }
    self->seq = self->counters_view.buf;
    self->counters = Py_NewRef(counters);
    self->comm = (intptr_t)comm;
    self->ctx = Py_NewRef(ctx);
    self->index = Py_NewRef(index);
    self->shm = Py_NewRef(shm);
    for (int i = 0; i < N_OPS; i++) self->from[i] = LLONG_MAX;
    self->gather_from = LLONG_MAX;
    self->gather_to = 0;
    self->alive = 1;
    return 0;
}

static void fastcomm_dealloc(FastComm *self) {
    if (self->counters != NULL) PyBuffer_Release(&self->counters_view);
    Py_XDECREF(self->counters);
    Py_XDECREF(self->ctx);
    Py_XDECREF(self->index);
    Py_XDECREF(self->shm);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* set_thresholds(all_reduce_from, reduce_from, reduce_scatter_from, broadcast_from,
 * all_gather_from, all_gather_to): the shared-memory engine's, whenever they change. */
static PyObject *fastcomm_set_thresholds(FastComm *self, PyObject *args) {
    long long v[6];
    if (!PyArg_ParseTuple(args, "LLLLLL", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]))
        return NULL;
    self->from[O_ALL_REDUCE] = v[0];
    self->from[O_COALESCED] = v[0];
    self->from[O_REDUCE] = v[1];
    self->from[O_REDUCE_SCATTER] = v[2];
    self->from[O_BROADCAST] = v[3];
    self->gather_from = v[4];
    self->gather_to = v[5];
    Py_RETURN_NONE;
}

static PyObject *fastcomm_close(FastComm *self, PyObject *unused) {
    self->alive = 0;
    Py_RETURN_NONE;
}

/* -- one call ----------------------------------------------------------------------- */

/* 1 if only the flight recorder (or nothing) observes Works, 0 if another observer
 * needs a Work; *record set when the recorder is on. */
static int observed_by_recorder(int *record) {
    Py_ssize_t n = PyList_GET_SIZE(observers);
    *record = n == 1 && ring.capacity > 0;
    return n == 0 || (n == 1 && PyList_GET_ITEM(observers, 0) == recorder);
}

static int shm_gathers(FastComm *fc, long long nbytes) {
    return fc->gather_from <= nbytes && nbytes < fc->gather_to;
}

static intptr_t moved_type(PyObject *dtype) {   /* 0: not a dtype this path moves */
    for (int i = 0; i < n_moved; i++)
        if (moved[i].dtype == dtype) return moved[i].type;
    return 0;
}

/* The MPI type and op for reducing dtype with op; 0 if MPI does not reduce it itself. */
static int reduced_type(PyObject *op, PyObject *dtype, intptr_t *type, intptr_t *mop) {
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

/* A buffer of a numpy array (exact ndarray, C-contiguous; writable if asked) and its
 * dtype; 0 (nothing held) if it is not one. */
static int array(PyObject *a, int writable, Py_buffer *view, PyObject **dtype) {
    if (Py_TYPE(a) != ndarray_type) return 0;
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(a, view, flags) < 0) { PyErr_Clear(); return 0; }
    *dtype = ((NumpyArray *)a)->descr;   /* held by the array, which the view holds */
    return 1;
}

static double now(void) {   /* time.monotonic()'s clock */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int raise_mpi_error(int code) {
    PyObject *r = PyObject_CallFunction(mpi_error, "i", code);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "MPI error %d", code);
    return -1;
}

/* Record the started op in the ring, as FlightRecorder.begin does (the same columns in
 * the same order; the GIL is held throughout, so no reader sees the slot half written).
 * first: its first array, or NULL.  The op's number; -1 with the recorder off; -2 on
 * error. */
static int64_t record(int record_on, int op, FastComm *fc, Py_buffer *first,
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
static int finish(int64_t n) {
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

/* One call's state: its group's FastComm, whether the recorder is on, the buffers it
 * holds. */
typedef struct {
    FastComm *fc;
    int rec;
    int nviews;
    Py_buffer view[2];
} Call;

/* Why a wait ended without its op (spmd.backends.mpi.fastcall's names). */
enum { GAVE_UP_TIMEOUT, GAVE_UP_ENDED, GAVE_UP_SIGNAL };

/* Hand a request the wait ends without to the Python side, which cancels a receive and
 * otherwise holds the request with the call's arrays until MPI is done with them (MPI
 * may still write into them: they must outlive the call), then raises the error of
 * `why`.  0: the op completed after all (a receive whose message had matched), -1: an
 * error is set (for a signal, the signal's). */
static int give_up(Handle *req, int op, Call *c, int64_t number, double waited, int why) {
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (why == GAVE_UP_SIGNAL) PyErr_Fetch(&type, &value, &tb);
    PyObject *buffers = PyTuple_New(c->nviews);
    PyObject *r = NULL;
    if (buffers != NULL) {
        for (int i = 0; i < c->nviews; i++)
            PyTuple_SET_ITEM(buffers, i, Py_NewRef(c->view[i].obj ? c->view[i].obj : Py_None));
        /* The handle as mpi4py's Request.handle gives it: an unsigned number. */
        unsigned long long h = h4 ? (unsigned long long)(long long)req->i
                                  : (unsigned long long)(uintptr_t)req->p;
        r = PyObject_CallFunction(given_up, "OOLdKOii", s_ops[op], c->fc->ctx,
                                  (long long)number, waited, h, buffers, op == O_RECV, why);
        Py_DECREF(buffers);
    }
    if (why == GAVE_UP_SIGNAL) {
        if (r != NULL) {        /* the signal's error goes on */
            Py_DECREF(r);
            PyErr_Restore(type, value, tb);
        } else {                /* the hand-over failed: its error replaces the signal's */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return -1;
    }
    if (r == NULL) return -1;
    int delivered = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (delivered > 0) return 0;
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "spmd: a given-up wait raised nothing");
    return -1;
}

/* Test the request until it completes: the group's timeout, the group's end (broken or
 * destroyed meanwhile: a peer gave the op up), signals, the GIL handed over, the core
 * given away when ranks outnumber cores, as spmd.core.wait.wait_until.  A wait that ends
 * without the op gives it up (give_up). */
static int wait_for(Handle *req, int op, Call *c, int64_t number) {
    FastComm *fc = c->fc;
    int flag = 0;
    char status[256];   /* larger than any MPI_Status */
    int rc = ((test_fn)fn[FN_TEST])(req, &flag, status);
    if (rc) return raise_mpi_error(rc);
    if (flag) return 0;
    int yield = fc->yield;
    double start = now(), deadline = start + fc->timeout;
    /* Past the first millisecond each test runs without the GIL, as mpi4py's Test does
     * on the Python path: other Python threads of this rank (spmd's control thread,
     * which answers the diagnosis of a peer's timeout; the user's) get the GIL at every
     * poll instead of once in 256, which in a full test process was too rare for them
     * to make progress (a Python thread ticked 3 times in a 0.5 s receive). */
    int released = 0;
    for (unsigned long spins = 1;; spins++) {
        if (released) {
            Py_BEGIN_ALLOW_THREADS
            rc = ((test_fn)fn[FN_TEST])(req, &flag, status);
            Py_END_ALLOW_THREADS
        } else {
            rc = ((test_fn)fn[FN_TEST])(req, &flag, status);
        }
        if (rc) return raise_mpi_error(rc);
        if (flag) return 0;
        if (yield) {    /* ranks outnumber cores: give the core (and the GIL) away */
            Py_BEGIN_ALLOW_THREADS
            sched_yield();
            Py_END_ALLOW_THREADS
        }
        /* A yield can take a scheduler tick: look at the clock more often then. */
        if (spins & (yield ? 7 : 255)) continue;
        double t = now();
        if (t > deadline) return give_up(req, op, c, number, t - start, GAVE_UP_TIMEOUT);
        if (!fc->alive) return give_up(req, op, c, number, t - start, GAVE_UP_ENDED);
        if (PyErr_CheckSignals() < 0)
            return give_up(req, op, c, number, t - start, GAVE_UP_SIGNAL);
        if (!yield && t - start > 1e-3)
            released = 1;
    }
}

/* Start (rc from the MPI call), record, wait, finish: the blocking op's life.  first:
 * the view of its first array (NULL: none) and that array's dtype. */
static PyObject *complete(int rc, Handle *req, int op, Call *c, Py_buffer *first,
                          PyObject *dtype) {
    if (rc) { raise_mpi_error(rc); return NULL; }
    int64_t n = record(c->rec, op, c->fc, first, dtype);
    if (n == -2) return NULL;
    if (wait_for(req, op, c, n) || finish(n)) return NULL;
    Py_RETURN_TRUE;
}

/* A group rank given as an exact int in [0, size); -1 if not. */
static int rank_arg(FastComm *fc, PyObject *r) {
    long x = PyLong_CheckExact(r) ? PyLong_AsLong(r) : -1;
    if (x == -1) PyErr_Clear();
    return x >= 0 && x < fc->size ? (int)x : -1;
}

static int check_bound(void) {
    if (bound) return 1;
    PyErr_SetString(PyExc_RuntimeError, "spmd.backends.mpi._fastcall: bind() has not been called");
    return 0;
}

/* The checks every op starts with: the argument count, bind() done, no observer but the
 * recorder, the group not broken or destroyed.  1: go on (release with end_call); 0:
 * decline; -1: error raised. */
static int start_call(Call *c, FastComm *fc, const char *op, Py_ssize_t n, Py_ssize_t want) {
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "%s: expected %zd arguments, got %zd", op, want, n);
        return -1;
    }
    if (!check_bound()) return -1;
    c->nviews = 0;
    c->fc = fc;
    return fc->alive && observed_by_recorder(&c->rec);
}

/* Hold the buffer of a (see array()); 0 if it is not one the path takes. */
static int hold(Call *c, PyObject *a, int writable, PyObject **dtype) {
    if (!array(a, writable, &c->view[c->nviews], dtype)) return 0;
    c->nviews++;
    return 1;
}

static PyObject *end_call(Call *c, PyObject *res) {
    for (int i = 0; i < c->nviews; i++) PyBuffer_Release(&c->view[i]);
    if (res == Py_True) c->fc->taken++;
    return res;
}

#define START(op, want)                                               \
    Call c;                                                           \
    int go_ = start_call(&c, self, op, n, want);                      \
    if (go_ < 0) return NULL;                                         \
    if (go_ == 0) Py_RETURN_FALSE
#define DECLINE return end_call(&c, Py_NewRef(Py_False))
#define COUNT(v) ((v).len / (v).itemsize)
#define FITS(v) (COUNT(v) <= INT_MAX)

/* all_reduce(tensor, op) */
static PyObject *fc_all_reduce(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("all_reduce", 2);
    PyObject *dtype;
    intptr_t type, mop;
    if (!hold(&c, a[0], 1, &dtype)) DECLINE;
    Py_buffer *v = &c.view[0];
    if (!reduced_type(a[1], dtype, &type, &mop) || !FITS(*v)
            || v->len >= self->from[O_ALL_REDUCE]) DECLINE;
    Handle req;
    int rc = c_reduction(FN_IALLREDUCE, in_place, v->buf, (int)COUNT(*v), type, mop, self->comm,
                         &req);
    return end_call(&c, complete(rc, &req, O_ALL_REDUCE, &c, v, dtype));
}

/* reduce(tensor, root, op): root a group rank */
static PyObject *fc_reduce(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("reduce", 3);
    int root = rank_arg(self, a[1]);
    int is_root = root == self->rank;
    PyObject *dtype;
    intptr_t type, mop;
    if (root < 0 || !hold(&c, a[0], is_root, &dtype)) DECLINE;
    Py_buffer *v = &c.view[0];
    if (!reduced_type(a[2], dtype, &type, &mop) || !FITS(*v)
            || v->len >= self->from[O_REDUCE]) DECLINE;
    Handle req;
    int rc = c_ireduce(is_root ? in_place : v->buf, is_root ? v->buf : NULL, (int)COUNT(*v),
                       type, mop, root, self->comm, &req);
    return end_call(&c, complete(rc, &req, O_REDUCE, &c, v, dtype));
}

/* broadcast(tensor, root): root a group rank */
static PyObject *fc_broadcast(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("broadcast", 2);
    int root = rank_arg(self, a[1]);
    PyObject *dtype;
    if (root < 0 || !hold(&c, a[0], 1, &dtype)) DECLINE;
    Py_buffer *v = &c.view[0];
    intptr_t type = moved_type(dtype);
    if (!type || !FITS(*v) || v->len >= self->from[O_BROADCAST]) DECLINE;
    Handle req;
    int rc = c_ibcast(v->buf, (int)COUNT(*v), type, root, self->comm, &req);
    return end_call(&c, complete(rc, &req, O_BROADCAST, &c, v, dtype));
}

/* The output and input of a gather, scatter or exchange: both held, one dtype. */
static int hold_pair(Call *c, PyObject *out, PyObject *in, PyObject **dtype) {
    PyObject *d2;
    return hold(c, out, 1, dtype) && hold(c, in, 0, &d2) && d2 == *dtype;
}

/* all_gather_into_tensor(output, tensor) */
static PyObject *fc_all_gather(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("all_gather_into_tensor", 2);
    PyObject *dtype;
    if (!hold_pair(&c, a[0], a[1], &dtype)) DECLINE;
    Py_buffer *vo = &c.view[0], *vi = &c.view[1];
    intptr_t type = moved_type(dtype);
    if (!type || vo->len != (Py_ssize_t)self->size * vi->len || !FITS(*vi)
            || shm_gathers(self, vo->len)) DECLINE;
    Handle req;
    int rc = c_exchange(FN_IALLGATHER, vi->buf, vo->buf, (int)COUNT(*vi), type, self->comm,
                        &req);
    return end_call(&c, complete(rc, &req, O_ALL_GATHER, &c, vo, dtype));
}

/* reduce_scatter_tensor(output, tensor, op) */
static PyObject *fc_reduce_scatter(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("reduce_scatter_tensor", 3);
    PyObject *dtype;
    intptr_t type, mop;
    if (!hold_pair(&c, a[0], a[1], &dtype)) DECLINE;
    Py_buffer *vo = &c.view[0], *vi = &c.view[1];
    if (!reduced_type(a[2], dtype, &type, &mop) || vi->len != (Py_ssize_t)self->size * vo->len
            || !FITS(*vo) || vi->len >= self->from[O_REDUCE_SCATTER]) DECLINE;
    Handle req;
    int rc = c_reduction(FN_IREDUCE_SCATTER_BLOCK, vi->buf, vo->buf, (int)COUNT(*vo), type, mop,
                         self->comm, &req);
    return end_call(&c, complete(rc, &req, O_REDUCE_SCATTER, &c, vo, dtype));
}

/* all_to_all_single(output, tensor, output_counts, input_counts): equal splits only (no
 * counts, the same shape in and out, the first dimension a multiple of the group size). */
static PyObject *fc_all_to_all(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("all_to_all_single", 4);
    PyObject *dtype;
    if (a[2] != Py_None || a[3] != Py_None || !hold_pair(&c, a[0], a[1], &dtype)) DECLINE;
    Py_buffer *vo = &c.view[0], *vi = &c.view[1];
    int same = vo->ndim == vi->ndim && vi->ndim > 0;
    for (int d = 0; same && d < vi->ndim; d++) same = vo->shape[d] == vi->shape[d];
    intptr_t type = moved_type(dtype);
    if (!type || !same || vi->shape[0] % self->size || !FITS(*vi)) DECLINE;
    Handle req;
    int rc = c_exchange(FN_IALLTOALL, vi->buf, vo->buf, (int)(COUNT(*vi) / self->size), type,
                        self->comm, &req);
    return end_call(&c, complete(rc, &req, O_ALL_TO_ALL, &c, vo, dtype));
}

/* barrier() */
static PyObject *fc_barrier(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("barrier", 0);
    Handle req;
    int rc = c_ibarrier(self->comm, &req);
    return end_call(&c, complete(rc, &req, O_BARRIER, &c, NULL, NULL));
}

/* send(tensor, peer, tag) and recv(tensor, peer, tag): to or from another group rank,
 * a tag in range. */
static PyObject *p2p(FastComm *self, int op, PyObject *const *a, Py_ssize_t n) {
    START(OP_NAMES[op], 3);
    long tag = PyLong_CheckExact(a[2]) ? PyLong_AsLong(a[2]) : -1;
    if (tag == -1) PyErr_Clear();
    if (tag < 0 || tag >= tag_ub) DECLINE;
    int peer = rank_arg(self, a[1]);     /* itself: an error the Python path raises */
    PyObject *dtype;
    if (peer < 0 || peer == self->rank || !hold(&c, a[0], op == O_RECV, &dtype)) DECLINE;
    Py_buffer *v = &c.view[0];
    intptr_t type = moved_type(dtype);
    if (!type || !FITS(*v)) DECLINE;
    Handle req;
    int rc = c_p2p(op == O_SEND ? FN_ISEND : FN_IRECV, v->buf, (int)COUNT(*v), type, peer,
                   (int)tag, self->comm, &req);
    return end_call(&c, complete(rc, &req, op, &c, v, dtype));
}

static PyObject *fc_send(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    return p2p(self, O_SEND, a, n);
}

static PyObject *fc_recv(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    return p2p(self, O_RECV, a, n);
}

/* -- the arrays of one fused all-reduce ------------------------------------------------
 *
 * Pieces: the arrays of an all_reduce_coalesced, held alive, as consecutive pieces of
 * one virtual buffer.  The shared-memory engine gathers them straight into its window
 * and sums into them straight from the peers' copies, and the MPI path packs them into
 * one buffer: each byte is copied once on the way in and once on the way out.  The sum
 * adds in rank order, as numpy's add in spmd.backends.shm.reduce does, so every rank
 * gets the same bits whichever of the two ran. */
#define MAX_FUSED 4096

typedef struct { char *data; Py_ssize_t len; } Piece;

/* out = s[0] + s[1], then out += s[r]: numpy's order.  Signed integers add as unsigned
 * ones (numpy's wrap-around, without C's undefined overflow).  Built with -O3 where the
 * compiler is GCC, whose -O2 does not vectorise loops of unknown length. */
#if defined(__GNUC__) && !defined(__clang__)
#define VECTORISED __attribute__((optimize("O3")))
#else
#define VECTORISED
#endif
#define SUM_KERNEL(name, T)                                                              \
    VECTORISED static void name(char *out, char *const *src, int q, Py_ssize_t n) {      \
        T *restrict o = (T *)out;                                                        \
        const T *restrict a = (const T *)src[0], *restrict b = (const T *)src[1];        \
        for (Py_ssize_t j = 0; j < n; j++) o[j] = (T)(a[j] + b[j]);                      \
        for (int r = 2; r < q; r++) {                                                    \
            const T *restrict s = (const T *)src[r];                                     \
            for (Py_ssize_t j = 0; j < n; j++) o[j] = (T)(o[j] + s[j]);                  \
        }                                                                                \
    }
SUM_KERNEL(sum_f32, float)
SUM_KERNEL(sum_f64, double)
SUM_KERNEL(sum_u8, uint8_t)
SUM_KERNEL(sum_u16, uint16_t)
SUM_KERNEL(sum_u32, uint32_t)
SUM_KERNEL(sum_u64, uint64_t)
typedef void (*sum_fn)(char *, char *const *, int, Py_ssize_t);
/* The kernels by the codes spmd.backends.mpi.fastcall.SUM_KERNELS gives dtypes (0: none). */
#define SUM_KERNELS 7
static const sum_fn sum_kernels[SUM_KERNELS] = {NULL, sum_f32, sum_f64, sum_u8, sum_u16,
                                                sum_u32, sum_u64};

typedef struct {
    PyObject_HEAD
    Py_ssize_t k, nbytes, itemsize;
    PyObject *dtype;
    int kernel;              /* its SUM_* kernel (summed[dtype]), 0 if sum_from does not add it */
    Piece *piece;
    PyObject **refs;
} Pieces;

static void pieces_dealloc(Pieces *self) {
    for (Py_ssize_t i = 0; i < self->k; i++) Py_DECREF(self->refs[i]);
    PyMem_Free(self->piece);
    PyMem_Free(self->refs);
    Py_XDECREF(self->dtype);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PiecesType;

/* The Pieces of ``seq`` (a list of two or more exact, C-contiguous, writable ndarrays of
 * one dtype); Py_None, no error set, for any other list. */
static PyObject *pieces_of(PyObject *seq) {
    Py_ssize_t k = PyList_CheckExact(seq) ? PyList_GET_SIZE(seq) : -1;
    if (k < 2 || k > MAX_FUSED || !bound) Py_RETURN_NONE;
    PyObject *dtype = NULL;
    Py_ssize_t itemsize = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        NumpyArray *x = (NumpyArray *)PyList_GET_ITEM(seq, i);
        if (Py_TYPE(x) != ndarray_type || (i > 0 && x->descr != dtype)
                || (x->flags & (NUMPY_C_CONTIGUOUS | NUMPY_WRITEABLE))
                   != (NUMPY_C_CONTIGUOUS | NUMPY_WRITEABLE)) Py_RETURN_NONE;
        dtype = x->descr;
    }
    /* The item size from the first array's buffer (one export, not one per array); the
     * kernel from the table bind() pushed. */
    Py_buffer first;
    if (PyObject_GetBuffer(PyList_GET_ITEM(seq, 0), &first, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    itemsize = first.itemsize;
    PyBuffer_Release(&first);
    PyObject *code = PyDict_GetItemWithError(summed, dtype);
    if (code == NULL && PyErr_Occurred()) return NULL;
    int kernel = code ? (int)PyLong_AsLong(code) : 0;
    if (kernel < 0 || kernel >= SUM_KERNELS || itemsize <= 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Pieces *p = PyObject_New(Pieces, &PiecesType);
    if (p == NULL) return NULL;
    p->k = 0;
    p->piece = PyMem_Malloc(sizeof(Piece) * (size_t)k);
    p->refs = PyMem_Malloc(sizeof(PyObject *) * (size_t)k);
    p->dtype = Py_NewRef(dtype);
    if (p->piece == NULL || p->refs == NULL) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    p->itemsize = itemsize;
    p->kernel = kernel;
    p->nbytes = 0;
    for (; p->k < k; p->k++) {
        NumpyArray *x = (NumpyArray *)PyList_GET_ITEM(seq, p->k);
        Py_ssize_t len = itemsize;
        for (int d = 0; d < x->nd; d++) len *= x->dimensions[d];
        p->refs[p->k] = Py_NewRef((PyObject *)x);
        p->piece[p->k].data = x->data;
        p->piece[p->k].len = len;
        p->nbytes += len;
    }
    return (PyObject *)p;
}

static PyObject *fc_pieces(PyObject *m, PyObject *seq) {
    return pieces_of(seq);
}

static void gather(const Pieces *p, char *dst) {
    for (Py_ssize_t i = 0; i < p->k; i++) {
        memcpy(dst, p->piece[i].data, (size_t)p->piece[i].len);
        dst += p->piece[i].len;
    }
}

static void scatter(const Pieces *p, const char *src) {
    for (Py_ssize_t i = 0; i < p->k; i++) {
        memcpy(p->piece[i].data, src, (size_t)p->piece[i].len);
        src += p->piece[i].len;
    }
}

/* Copies into the shared window with non-temporal stores on x86: the peers read those
 * lines next, and a plain store must first take each line back from the peer that read
 * it at the previous op.  Where the two cores are far apart (the 2-core test machine
 * now and then: its vCPUs on different core complexes) that made a 256 KiB fused
 * all-reduce 165-173 us instead of 60-65 us; where they are close streaming still gained
 * 6% (47-48 us against 50-51). */
#if defined(__SSE2__)
#include <emmintrin.h>
static void stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    for (; n >= 16; n -= 16, dst += 16, src += 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    memcpy(dst, src, n);
}
#define STREAM_FENCE() _mm_sfence()   /* the streamed lines are out before the publish */
#else
#define stream_copy(dst, src, n) memcpy(dst, src, n)
#define STREAM_FENCE() ((void)0)
#endif

/* stream(dst, src): copy the bytes of the buffer src to the start of the buffer dst,
 * streamed (the shared-memory engine's copies into its window); below a few pages a
 * plain copy, which is cheaper there. */
#define STREAM_FROM 4096
static PyObject *fc_stream(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "stream(dst, src): two buffers");
        return NULL;
    }
    Py_buffer d, s;
    if (PyObject_GetBuffer(a[0], &d, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(a[1], &s, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    int ok = s.len <= d.len;
    if (ok && s.len < STREAM_FROM) {
        memcpy(d.buf, s.buf, (size_t)s.len);
    } else if (ok) {
        stream_copy(d.buf, s.buf, (size_t)s.len);
        STREAM_FENCE();
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "stream(dst, src): src is longer than dst");
        return NULL;
    }
    Py_RETURN_NONE;
}

static void stream_into(const Pieces *p, char *dst) {
    for (Py_ssize_t i = 0; i < p->k; i++) {
        stream_copy(dst, p->piece[i].data, (size_t)p->piece[i].len);
        dst += p->piece[i].len;
    }
    STREAM_FENCE();
}

/* A writable (or readable) buffer of at least ``p``'s bytes; 0 with an error if not. */
static int buffer_for(const Pieces *p, PyObject *obj, int writable, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    if (view->len < p->nbytes) {
        PyErr_Format(PyExc_ValueError, "Pieces: a buffer of %zd bytes for %zd bytes of arrays",
                     view->len, p->nbytes);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static PyObject *pieces_gather(Pieces *self, PyObject *dst) {
    Py_buffer v;
    if (!buffer_for(self, dst, 1, &v)) return NULL;
    gather(self, v.buf);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static PyObject *pieces_stream_into(Pieces *self, PyObject *dst) {
    Py_buffer v;
    if (!buffer_for(self, dst, 1, &v)) return NULL;
    stream_into(self, v.buf);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static PyObject *pieces_scatter(Pieces *self, PyObject *src) {
    Py_buffer v;
    if (!buffer_for(self, src, 0, &v)) return NULL;
    scatter(self, v.buf);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

#define MAX_SOURCES 256
/* sum_from(sources) -> bool: each array = the sum of its piece of every source (equal
 * buffers of the arrays' dtype, in rank order); False, having done nothing, for a dtype
 * it does not add (the caller reduces with numpy, then scatters). */
static PyObject *pieces_sum_from(Pieces *self, PyObject *srcs) {
    sum_fn f = sum_kernels[self->kernel];
    Py_ssize_t q = PyList_CheckExact(srcs) ? PyList_GET_SIZE(srcs) : -1;
    if (f == NULL || q < 1 || q > MAX_SOURCES) Py_RETURN_FALSE;
    Py_buffer v[MAX_SOURCES];
    char *at[MAX_SOURCES];
    Py_ssize_t got = 0;
    for (; got < q; got++) {
        if (!buffer_for(self, PyList_GET_ITEM(srcs, got), 0, &v[got])) break;
        at[got] = v[got].buf;
    }
    if (got == q) {
        if (q == 1) {
            scatter(self, at[0]);
        } else {
            for (Py_ssize_t i = 0; i < self->k; i++) {
                f(self->piece[i].data, at, (int)q, self->piece[i].len / self->itemsize);
                for (Py_ssize_t r = 0; r < q; r++) at[r] += self->piece[i].len;
            }
        }
    }
    for (Py_ssize_t r = 0; r < got; r++) PyBuffer_Release(&v[r]);
    if (got < q) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *pieces_get_nbytes(Pieces *self, void *unused) {
    return PyLong_FromSsize_t(self->nbytes);
}

static PyObject *pieces_get_dtype(Pieces *self, void *unused) {
    return Py_NewRef(self->dtype);
}

static PyObject *pieces_get_arrays(Pieces *self, void *unused) {
    PyObject *out = PyList_New(self->k);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->k; i++) PyList_SET_ITEM(out, i, Py_NewRef(self->refs[i]));
    return out;
}

static PyMethodDef pieces_methods[] = {
    {"gather", (PyCFunction)pieces_gather, METH_O,
     "gather(dst): copy the arrays, in order, into the start of the buffer dst."},
    {"stream_into", (PyCFunction)pieces_stream_into, METH_O,
     "stream_into(dst): gather(dst) with non-temporal stores, for a buffer other processes "
     "read next (the shared window)."},
    {"scatter", (PyCFunction)pieces_scatter, METH_O,
     "scatter(src): copy consecutive pieces of the start of the buffer src into the arrays."},
    {"sum_from", (PyCFunction)pieces_sum_from, METH_O,
     "sum_from(sources) -> bool: each array = its piece of sources[0] + sources[1] + ...; "
     "False, having done nothing, for a dtype it does not add."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pieces_getset[] = {
    {"nbytes", (getter)pieces_get_nbytes, NULL, "The arrays' bytes together.", NULL},
    {"dtype", (getter)pieces_get_dtype, NULL, "The arrays' dtype.", NULL},
    {"arrays", (getter)pieces_get_arrays, NULL, "The arrays, in order.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PiecesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spmd.backends.mpi._fastcall.Pieces",
    .tp_doc = "The arrays of one fused all-reduce as consecutive pieces of one buffer "
              "(made by pieces(arrays)).",
    .tp_basicsize = sizeof(Pieces),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)pieces_dealloc,
    .tp_methods = pieces_methods,
    .tp_getset = pieces_getset,
};

/* all_reduce_coalesced(tensors, op): two or more arrays of one dtype,
 * each an exact, C-contiguous, writable ndarray, at most one fusion bucket together:
 * on the shared-memory engine's sizes its fused all_reduce of the Pieces; below them
 * packed into one buffer, one MPI all-reduce, copied back (the Python path's calls on
 * the same bytes, without its Python per array). */
static char *scratch;            /* the packing buffer, kept between calls */
static size_t scratch_size;
static int scratch_busy;         /* a call in another thread holds it (GIL released) */

static PyObject *fc_all_reduce_coalesced(FastComm *self, PyObject *const *a, Py_ssize_t n) {
    START("all_reduce_coalesced", 2);
    PyObject *seq = a[0];
    PyObject *dtype;
    intptr_t type = 0, mop = 0;
    /* The first array through the buffer protocol (its item size, and a check of the
     * layout read below), then the rest by their fields. */
    if (!PyList_CheckExact(seq) || PyList_GET_SIZE(seq) < 2
            || !hold(&c, PyList_GET_ITEM(seq, 0), 1, &dtype)
            || !reduced_type(a[1], dtype, &type, &mop)) DECLINE;
    Py_ssize_t itemsize = c.view[0].itemsize;
    if (((NumpyArray *)PyList_GET_ITEM(seq, 0))->data != c.view[0].buf) DECLINE;
    Pieces *p = (Pieces *)pieces_of(seq);
    if (p == NULL) return end_call(&c, NULL);
    if ((PyObject *)p == Py_None) {
        Py_DECREF(p);
        DECLINE;
    }
    PyObject *res = NULL;
    Py_ssize_t total = p->nbytes;
    long long limit = -1;
    PyObject *lim = PyObject_CallNoArgs(bucket_bytes);
    if (lim != NULL) {
        limit = PyLong_AsLongLong(lim);
        Py_DECREF(lim);
    }
    PyErr_Clear();      /* an unreadable limit: the Python path takes the call */
    if (total > limit || total / itemsize > INT_MAX) {
        res = Py_NewRef(Py_False);
        goto done;
    }
    if (total >= self->from[O_ALL_REDUCE]) {
        /* The shared-memory engine's size: its fused all_reduce, as the Python path
         * (HostEngine.all_reduce_coalesced) runs it; it records itself. */
        PyObject *args[3] = {self->shm, (PyObject *)p, a[1]};
        PyObject *r = PyObject_Vectorcall(shm_all_reduce, args, 3, NULL);
        res = r == NULL ? NULL : Py_NewRef(Py_True);
        Py_XDECREF(r);
        goto done;
    }
    char *buf = scratch;
    int own = scratch_busy || scratch_size < (size_t)total;
    if (own) {
        buf = PyMem_RawMalloc((size_t)total ? (size_t)total : 1);
        if (buf == NULL) { PyErr_NoMemory(); goto done; }
    } else {
        scratch_busy = 1;
    }
    gather(p, buf);
    Handle req;
    int rc = c_reduction(FN_IALLREDUCE, in_place, buf, (int)(total / itemsize), type, mop,
                         self->comm, &req);
    res = complete(rc, &req, O_COALESCED, &c, &c.view[0], dtype);
    if (res == NULL) {
        /* A failed or timed-out op may still write into the buffer later: never reuse
         * or free it. */
        if (!own) { scratch = NULL; scratch_size = 0; scratch_busy = 0; }
        goto done;
    }
    scatter(p, buf);
    if (own) {
        /* Keep the larger buffer for the next call when no other call holds one. */
        if (!scratch_busy && (size_t)total > scratch_size) {
            PyMem_RawFree(scratch);
            scratch = buf;
            scratch_size = (size_t)total;
        } else {
            PyMem_RawFree(buf);
        }
    } else {
        scratch_busy = 0;
    }
done:
    Py_DECREF(p);
    return end_call(&c, res);
}

static PyObject *fastcomm_alive(FastComm *self, void *unused) {
    return PyBool_FromLong(self->alive);
}

static PyObject *fastcomm_taken(FastComm *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->taken);
}

#define FASTCALL(name, f, doc) {name, (PyCFunction)(void (*)(void))f, METH_FASTCALL, doc}

static PyMethodDef fastcomm_methods[] = {
    {"set_thresholds", (PyCFunction)fastcomm_set_thresholds, METH_VARARGS,
     "set_thresholds(all_reduce_from, reduce_from, reduce_scatter_from, broadcast_from, "
     "all_gather_from, all_gather_to): the shared-memory engine's sizes."},
    {"close", (PyCFunction)fastcomm_close, METH_NOARGS,
     "close(): the group is broken or destroyed; this path takes no more of its calls."},
    FASTCALL("all_reduce", fc_all_reduce, "all_reduce(tensor, op) -> bool"),
    FASTCALL("reduce", fc_reduce, "reduce(tensor, root, op) -> bool"),
    FASTCALL("broadcast", fc_broadcast, "broadcast(tensor, root) -> bool"),
    FASTCALL("all_gather_into_tensor", fc_all_gather,
             "all_gather_into_tensor(output, tensor) -> bool"),
    FASTCALL("reduce_scatter_tensor", fc_reduce_scatter,
             "reduce_scatter_tensor(output, tensor, op) -> bool"),
    FASTCALL("all_to_all_single", fc_all_to_all,
             "all_to_all_single(output, tensor, output_counts, input_counts) -> bool"),
    FASTCALL("barrier", fc_barrier, "barrier() -> bool"),
    FASTCALL("send", fc_send, "send(tensor, peer, tag) -> bool"),
    FASTCALL("recv", fc_recv, "recv(tensor, peer, tag) -> bool"),
    FASTCALL("all_reduce_coalesced", fc_all_reduce_coalesced,
             "all_reduce_coalesced(tensors, op) -> bool"),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef fastcomm_getset[] = {
    {"alive", (getter)fastcomm_alive, NULL, "False once close() was called.", NULL},
    {"taken", (getter)fastcomm_taken, NULL, "How many calls this path has run.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FastCommType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spmd.backends.mpi._fastcall.FastComm",
    .tp_doc = "FastComm(comm, rank, size, context, index, op_counters, timeout, "
              "oversubscribed, shm): one group's engine ops on the compiled call path.  "
              "Each op method runs a blocking op and returns True, or returns False having "
              "done nothing for a call outside its case (the engine's Python path runs it).",
    .tp_basicsize = sizeof(FastComm),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fastcomm_init,
    .tp_dealloc = (destructor)fastcomm_dealloc,
    .tp_methods = fastcomm_methods,
    .tp_getset = fastcomm_getset,
};

/* -- binding -------------------------------------------------------------------------- */

static void set_ref(PyObject **slot, PyObject *v) {
    Py_XINCREF(v);
    Py_XSETREF(*slot, v);
}

/* bind(functions, handle_size, in_place, moved, reduced, ndarray, observers, recorder,
 *      push_out, end, given_up, mpi_error, tag_ub, bucket_bytes, shm_all_reduce)
 *
 * functions: {MPI function name: address}; moved: [(dtype, type handle)]; reduced:
 * [(op, [(dtype, type handle, op handle)])].  Called once, by spmd.backends.mpi.fastcall. */
static PyObject *fc_bind(PyObject *m, PyObject *args) {
    PyObject *functions, *mv, *rd, *nd, *obs, *rec, *po, *eo, *exp, *me, *bb, *sa, *sm;
    int hsize;
    long long ip;
    long ub;
    if (!PyArg_ParseTuple(args, "O!iLO!O!O!O!OOOOOlOOO!", &PyDict_Type, &functions, &hsize,
                          &ip, &PyList_Type, &mv, &PyList_Type, &rd, &PyType_Type, &nd,
                          &PyList_Type, &obs, &rec, &po, &eo, &exp, &me, &ub, &bb, &sa,
                          &PyDict_Type, &sm))
        return NULL;
    if (hsize != 4 && hsize != (int)sizeof(void *)) {
        PyErr_Format(PyExc_ValueError, "bind: MPI handles of %d bytes are not supported", hsize);
        return NULL;
    }
    void *found[FN_COUNT];
    for (int i = 0; i < FN_COUNT; i++) {
        PyObject *addr = PyDict_GetItemString(functions, FN_NAMES[i]);
        found[i] = addr ? PyLong_AsVoidPtr(addr) : NULL;
        if (found[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "bind: no address for %s", FN_NAMES[i]);
            return NULL;
        }
    }
    Py_ssize_t nm = PyList_GET_SIZE(mv), nr = PyList_GET_SIZE(rd);
    if (nm > MAX_DTYPES || nr > MAX_OPS) {
        PyErr_SetString(PyExc_ValueError, "bind: too many dtypes or ops");
        return NULL;
    }
    Moved new_moved[MAX_DTYPES];
    Reduced *new_reduced = PyMem_Calloc(MAX_OPS, sizeof(Reduced));
    if (new_reduced == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < nm; i++) {
        PyObject *d;
        long long h;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(mv, i), "OL", &d, &h)) goto fail;
        new_moved[i].dtype = d;
        new_moved[i].type = (intptr_t)h;
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *op, *lst;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(rd, i), "OO!", &op, &PyList_Type, &lst)) goto fail;
        if (PyList_GET_SIZE(lst) > MAX_DTYPES) {
            PyErr_SetString(PyExc_ValueError, "bind: too many dtypes");
            goto fail;
        }
        new_reduced[i].op = op;
        new_reduced[i].n = (int)PyList_GET_SIZE(lst);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(lst); j++) {
            PyObject *d;
            long long th, oh;
            if (!PyArg_ParseTuple(PyList_GET_ITEM(lst, j), "OLL", &d, &th, &oh)) goto fail;
            new_reduced[i].dt[j].dtype = d;
            new_reduced[i].dt[j].type = (intptr_t)th;
            new_reduced[i].mop[j] = (intptr_t)oh;
        }
    }
    /* Keep every dtype and op alive for the process's life (the table holds pointers). */
    for (Py_ssize_t i = 0; i < nm; i++) Py_INCREF(new_moved[i].dtype);
    for (Py_ssize_t i = 0; i < nr; i++) {
        Py_INCREF(new_reduced[i].op);
        for (int j = 0; j < new_reduced[i].n; j++) Py_INCREF(new_reduced[i].dt[j].dtype);
    }
    memcpy(fn, found, sizeof fn);
    h4 = hsize == 4;
    in_place = (void *)(intptr_t)ip;
    memcpy(moved, new_moved, sizeof(Moved) * (size_t)nm);
    n_moved = (int)nm;
    memcpy(reduced, new_reduced, sizeof(Reduced) * (size_t)nr);
    n_reduced = (int)nr;
    PyMem_Free(new_reduced);
    set_ref((PyObject **)&ndarray_type, nd);
    set_ref(&observers, obs);
    set_ref(&recorder, rec);
    set_ref(&push_out, po);
    set_ref(&end_op, eo);
    set_ref(&given_up, exp);
    set_ref(&mpi_error, me);
    set_ref(&bucket_bytes, bb);
    set_ref(&shm_all_reduce, sa);
    set_ref(&summed, sm);
    tag_ub = ub;
    bound = 1;
    Py_RETURN_NONE;
fail:
    PyMem_Free(new_reduced);
    return NULL;
}


/* host_arrays(items, dtypes): whether every item is an exact, writable numpy array
 * whose dtype is a key of the dict ``dtypes`` (what spmd.core.arrays.array_list accepts
 * for an output list, checked without a Python call per array; False: let it check). */
static PyObject *fc_host_arrays(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyDict_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "host_arrays(items, dtypes): a sequence and a dict");
        return NULL;
    }
    if (!check_bound()) return NULL;
    PyObject *seq = a[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_FALSE;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < k; i++) {
        NumpyArray *x = (NumpyArray *)items[i];
        if (Py_TYPE(x) != ndarray_type || !(x->flags & NUMPY_WRITEABLE)) Py_RETURN_FALSE;
        int known = PyDict_Contains(a[1], x->descr);
        if (known < 0) return NULL;
        if (!known) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"host_arrays", (PyCFunction)(void (*)(void))fc_host_arrays, METH_FASTCALL,
     "host_arrays(items, dtypes) -> bool: every item an exact, writable numpy array of a "
     "dtype in dtypes."},
    {"bind", (PyCFunction)fc_bind, METH_VARARGS, "Bind the MPI library and spmd's objects."},
    {"set_ring", (PyCFunction)fc_set_ring, METH_O,
     "set_ring(storage): the flight recorder's ring (Ring.storage())."},
    {"stream", (PyCFunction)(void (*)(void))fc_stream, METH_FASTCALL,
     "stream(dst, src): copy src's bytes to the start of dst past the cache (into the "
     "shared window, which other processes read next)."},
    {"pieces", (PyCFunction)fc_pieces, METH_O,
     "pieces(arrays) -> Pieces or None: the arrays of a fused all-reduce, if they are two "
     "or more exact, C-contiguous, writable ndarrays of one dtype (needs bind())."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "spmd.backends.mpi._fastcall",
    "The compiled call path of spmd's common blocking ops (see spmd.backends.mpi.fastcall).",
    -1, methods,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__fastcall(void) {
    if (PyType_Ready(&FastCommType) < 0 || PyType_Ready(&PiecesType) < 0) return NULL;
    INTERN(s_mpi_engine, "MPI");
    for (int i = 0; i < N_OPS; i++) INTERN(s_ops[i], OP_NAMES[i]);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "FastComm", (PyObject *)&FastCommType) < 0
            || PyModule_AddObjectRef(m, "Pieces", (PyObject *)&PiecesType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
