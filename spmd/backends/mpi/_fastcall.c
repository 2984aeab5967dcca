/* The compiled call path of the common blocking ops on host arrays.
 *
 * A blocking collective or send/recv on contiguous numpy arrays, with a reduce op MPI
 * applies itself and a size below the shared-memory engine's thresholds, runs here
 * without the Python: the MPI call the MPI engine makes for it, then a wait without a
 * Work.  Each method returns False, having done nothing, for a call outside that case
 * (the engine's Python path then runs it); True once the op has completed.
 *
 * Nothing here links against MPI: spmd/backends/mpi/fastcall.py binds the library mpi4py
 * loaded (_fastcall_bind.h), so one build runs with any MPI.
 *
 * What a wait keeps from the Python path: the op is recorded in the flight recorder
 * (written into its preallocated ring here: no Python object per call), a wait past
 * the group's timeout ends in the Python function that raises the same diagnosed
 * DistTimeoutError, signals are checked and the GIL is handed over while waiting.
 *
 * The path is the host engine's: the engine (spmd/backends/host.py) calls a FastComm's
 * method for a blocking op on its group, with the arguments its own method gets (group
 * ranks, validated arrays).  State crosses into C as arguments: the engine makes the
 * FastComm with what this path needs of the group and pushes every change to it
 * (thresholds, the group broken or destroyed); the recorder hands over its ring's
 * columns.  The public ops enter here before any Python of theirs (the module's
 * all_reduce, broadcast, ...: one C call per op): those find the group's FastComm in
 * fields of objects this module defines (WorldSlots, GroupSlots: Python sets them) and
 * decline whatever that FastComm would.
 *
 * This file: the module, FastComm and its op methods, each a call's whole data path
 * (checks, the MPI call, record, wait, finish) with the hot parts of the other files
 * inline; _fastcall.h lists those files.
 */
#include "_fastcall_pieces.h"
#include "_fastcall_recorder.h"
#include "_fastcall_wait.h"
#include <stddef.h>
#include <structmember.h>

PyObject *s_mpi_engine;
PyObject *s_ops[N_OPS];
static const char *const OP_NAMES[N_OPS] = {
    "all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "barrier", "send", "recv", "all_reduce_coalesced"};

/* -- FastComm: what this path needs of one group, pushed by its host engine -------- */

static int fastcomm_init(FastComm *self, PyObject *args, PyObject *kw) {
    long long comm;
    PyObject *ctx, *index, *counters, *shm;
    static char *names[] = {"comm", "rank", "size", "context", "index", "op_counters",
                            "timeout", "yields", "shm", "nap_after", NULL};
    if (self->ctx != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FastComm: initialised once");
        return -1;
    }
    self->nap_after = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LiiOO!OdpO|d", names, &comm, &self->rank,
                                     &self->size, &ctx, &PyDict_Type, &index, &counters,
                                     &self->timeout, &self->yield, &shm, &self->nap_after))
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

/* set_thresholds(*, all_reduce_from, reduce_from, reduce_scatter_from, broadcast_from,
 * all_gather_from, all_gather_to): the shared-memory engine's sizes (the fields of its
 * spmd.backends.shm.thresholds.Thresholds, by keyword), whenever they change. */
static PyObject *fastcomm_set_thresholds(FastComm *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"all_reduce_from", "reduce_from", "reduce_scatter_from",
                            "broadcast_from", "all_gather_from", "all_gather_to", NULL};
    long long v[6];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$LLLLLL", names, &v[0], &v[1], &v[2], &v[3],
                                     &v[4], &v[5]))
        return NULL;
    if (kw == NULL || PyDict_GET_SIZE(kw) != 6) {
        PyErr_SetString(PyExc_TypeError, "set_thresholds: every size is required, by keyword");
        return NULL;
    }
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

/* A buffer of a numpy array (exact ndarray, C-contiguous; writable if asked) and its
 * dtype; 0 (nothing held) if it is not one. */
static int array(PyObject *a, int writable, Py_buffer *view, PyObject **dtype) {
    if (Py_TYPE(a) != ndarray_type) return 0;
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(a, view, flags) < 0) { PyErr_Clear(); return 0; }
    *dtype = ((NumpyArray *)a)->descr;   /* held by the array, which the view holds */
    return 1;
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

/* -- the fused all-reduce (its arrays: _fastcall_pieces.h) ------------------------- */

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

/* -- the public ops' entry: the group's FastComm found from the group -------------- *
 *
 * spmd's public blocking ops call these first, with their own arguments: the group
 * (None: the default one) leads to its FastComm through fields of objects this module
 * defines (WorldSlots, the base of the world's state, holds the default group;
 * GroupSlots, the base of ProcessGroup, holds the FastComm of its engine for host
 * arrays while that engine is the host engine itself: not coalescing's recorder or
 * debug mode's checker in its place).  The call runs there when the FastComm is alive
 * (a group broken, destroyed, shrunk or healed away closed it).  Anything else returns
 * False having done nothing: the op's Python path, which holds every check and error,
 * takes it. */
typedef struct {
    PyObject_HEAD
    PyObject *world;        /* the default ProcessGroup, or NULL/None */
} WorldSlots;

typedef struct {
    PyObject_HEAD
    PyObject *compiled;     /* the FastComm of the group's host engine, or NULL/None */
} GroupSlots;

static PyTypeObject WorldSlotsType, GroupSlotsType, FastCommType;   /* (defined below) */
static WorldSlots *world_state;     /* the process's world state (set_world()) */

/* set_world(world_state): the world's state, whose ``world`` the entry reads. */
static PyObject *fc_set_world(PyObject *m, PyObject *w) {
    if (!PyObject_TypeCheck(w, &WorldSlotsType)) {
        PyErr_SetString(PyExc_TypeError, "set_world(world_state): a WorldSlots");
        return NULL;
    }
    Py_XSETREF(world_state, (WorldSlots *)Py_NewRef(w));
    Py_RETURN_NONE;
}

/* The live FastComm of ``group`` (borrowed: the group holds it for the call), or NULL:
 * decline. */
static FastComm *fast_of(PyObject *group) {
    PyObject *pg = group;
    if (pg == Py_None) {
        if (world_state == NULL) return NULL;
        pg = world_state->world;
    }
    if (pg == NULL || !PyObject_TypeCheck(pg, &GroupSlotsType)) return NULL;
    PyObject *f = ((GroupSlots *)pg)->compiled;
    if (f == NULL || Py_TYPE(f) != &FastCommType || !((FastComm *)f)->alive) return NULL;
    return (FastComm *)f;
}

/* The group rank of global rank ``r`` in fc's group, as a borrowed int; NULL (no error)
 * for anything but an exact int of a member. */
static PyObject *group_rank(FastComm *fc, PyObject *r) {
    if (!PyLong_CheckExact(r)) return NULL;
    PyObject *g = PyDict_GetItemWithError(fc->index, r);
    PyErr_Clear();
    return g;
}

/* ``g`` if it is an exact int naming a rank of fc's group (borrowed); NULL (no error)
 * otherwise. */
static PyObject *member(FastComm *fc, PyObject *g) {
    if (!PyLong_CheckExact(g)) return NULL;
    long v = PyLong_AsLong(g);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    return v >= 0 && v < fc->size ? g : NULL;
}

/* What the group makes of the error the call raised (spmd.backends.mpi.faults.failure:
 * MPI's report of a dead rank becomes the group's ProcessFailedError), raised as the
 * host engine's Python path raises it. */
static void group_error(FastComm *fc, int op) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    PyObject *args[3] = {value, s_ops[op], fc->ctx};
    PyObject *err = PyObject_Vectorcall(failure_of, args, 3, NULL);
    if (err == NULL) {   /* the translation's own error stands */
        Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
        return;
    }
    if (err == value) {
        Py_DECREF(err);
        PyErr_Restore(type, value, tb);
        return;
    }
    PyException_SetCause(err, NULL);     /* raise err from None */
    PyException_SetContext(err, value);  /* (steals value) */
    PyErr_SetObject((PyObject *)Py_TYPE(err), err);
    Py_DECREF(err);
    Py_XDECREF(type);
    Py_XDECREF(tb);
}

typedef PyObject *(*OpMethod)(FastComm *, PyObject *const *, Py_ssize_t);

/* Run ``method`` of group's FastComm with ``args``; False if the group's path declines. */
static PyObject *on_group(PyObject *group, int op, OpMethod method, PyObject *const *args,
                          Py_ssize_t n) {
    FastComm *fc = fast_of(group);
    if (fc == NULL) Py_RETURN_FALSE;
    Py_INCREF(fc);
    PyObject *res = method(fc, args, n);
    if (res == NULL) group_error(fc, op);
    Py_DECREF(fc);
    return res;
}

/* The ops whose root or peer is a global rank (args[root_at]): made a group rank first;
 * or a group rank given instead (group_root: torch's ops name roots so), taken as it is
 * where it names a member and no global rank is given beside it (else the Python path
 * says what is wrong). */
static PyObject *on_group_rooted(PyObject *group, int op, OpMethod method, PyObject **args,
                                 Py_ssize_t n, int root_at, PyObject *group_root) {
    FastComm *fc = fast_of(group);
    if (fc == NULL) Py_RETURN_FALSE;
    PyObject *g;
    if (group_root == Py_None) {
        g = group_rank(fc, args[root_at]);
    } else {   /* the root as a group rank: a member's, and no global one beside it */
        g = args[root_at] == Py_None ? member(fc, group_root) : NULL;
    }
    if (g == NULL) Py_RETURN_FALSE;
    args[root_at] = g;
    Py_INCREF(fc);
    PyObject *res = method(fc, args, n);
    if (res == NULL) group_error(fc, op);
    Py_DECREF(fc);
    return res;
}

#define ARGS(want, sig)                                                               \
    if (n != want) {                                                                  \
        PyErr_Format(PyExc_TypeError, sig ": expected %d arguments, got %zd", want, n);  \
        return NULL;                                                                  \
    }

/* all_reduce(tensor, op, group) */
static PyObject *d_all_reduce(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(3, "all_reduce(tensor, op, group)");
    return on_group(a[2], O_ALL_REDUCE, fc_all_reduce, a, 2);
}

/* broadcast(tensor, src, group, group_src) */
static PyObject *d_broadcast(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(4, "broadcast(tensor, src, group, group_src)");
    PyObject *args[2] = {a[0], a[1]};
    return on_group_rooted(a[2], O_BROADCAST, fc_broadcast, args, 2, 1, a[3]);
}

/* reduce(tensor, dst, op, group, group_dst) */
static PyObject *d_reduce(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(5, "reduce(tensor, dst, op, group, group_dst)");
    PyObject *args[3] = {a[0], a[1], a[2]};
    return on_group_rooted(a[3], O_REDUCE, fc_reduce, args, 3, 1, a[4]);
}

/* all_gather_into_tensor(output_tensor, input_tensor, group) */
static PyObject *d_all_gather(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(3, "all_gather_into_tensor(output_tensor, input_tensor, group)");
    return on_group(a[2], O_ALL_GATHER, fc_all_gather, a, 2);
}

/* reduce_scatter_tensor(output, input, op, group) */
static PyObject *d_reduce_scatter(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(4, "reduce_scatter_tensor(output, input, op, group)");
    return on_group(a[3], O_REDUCE_SCATTER, fc_reduce_scatter, a, 3);
}

/* all_to_all_single(output, input, output_split_sizes, input_split_sizes, group) */
static PyObject *d_all_to_all(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(5, "all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)");
    return on_group(a[4], O_ALL_TO_ALL, fc_all_to_all, a, 4);
}

/* barrier(group) */
static PyObject *d_barrier(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(1, "barrier(group)");
    return on_group(a[0], O_BARRIER, fc_barrier, a, 0);
}

/* send(tensor, dst, group, tag, group_dst) */
static PyObject *d_send(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(5, "send(tensor, dst, group, tag, group_dst)");
    PyObject *args[3] = {a[0], a[1], a[3]};
    return on_group_rooted(a[2], O_SEND, fc_send, args, 3, 1, a[4]);
}

/* recv(tensor, src, group, tag, group_src): a given src only (from any rank, the Work
 * says who sent) */
static PyObject *d_recv(PyObject *m, PyObject *const *a, Py_ssize_t n) {
    ARGS(5, "recv(tensor, src, group, tag, group_src)");
    PyObject *args[3] = {a[0], a[1], a[3]};
    return on_group_rooted(a[2], O_RECV, fc_recv, args, 3, 1, a[4]);
}

/* -- the FastComm type and the module ---------------------------------------------- */

static PyObject *fastcomm_alive(FastComm *self, void *unused) {
    return PyBool_FromLong(self->alive);
}

static PyObject *fastcomm_taken(FastComm *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->taken);
}

#define FASTCALL(name, f, doc) {name, (PyCFunction)(void (*)(void))f, METH_FASTCALL, doc}

static PyMethodDef fastcomm_methods[] = {
    {"set_thresholds", (PyCFunction)(void (*)(void))fastcomm_set_thresholds,
     METH_VARARGS | METH_KEYWORDS,
     "set_thresholds(*, all_reduce_from, ...): the shared-memory engine's sizes, by name."},
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
              "yields, shm, nap_after=-1): one group's engine ops on the compiled call path.  "
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

/* A base type of one object field, for a Python class to derive from (its field is
 * an attribute there; C reads it directly).  Name: the C struct; field: its one field. */
#define ONE_FIELD_BASE(Name, field, type_doc, field_doc)                                \
    static void Name##_dealloc(Name *self) {                                            \
        Py_CLEAR(self->field);                                                          \
        Py_TYPE(self)->tp_free((PyObject *)self);                                       \
    }                                                                                   \
    static PyMemberDef Name##_members[] = {                                             \
        {#field, T_OBJECT, offsetof(Name, field), 0, field_doc},                        \
        {NULL, 0, 0, 0, NULL},                                                          \
    };                                                                                  \
    static PyTypeObject Name##Type = {                                                  \
        PyVarObject_HEAD_INIT(NULL, 0)                                                  \
        .tp_name = "spmd.backends.mpi._fastcall." #Name,                               \
        .tp_doc = type_doc,                                                             \
        .tp_basicsize = sizeof(Name),                                                   \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,                           \
        .tp_new = PyType_GenericNew,                                                    \
        .tp_dealloc = (destructor)Name##_dealloc,                                       \
        .tp_members = Name##_members,                                                   \
    };

ONE_FIELD_BASE(WorldSlots, world,
               "The base of the world's state: its field the public ops' entry reads.",
               "The default group (None before init_process_group and after its destroy).")
ONE_FIELD_BASE(GroupSlots, compiled,
               "The base of ProcessGroup: its field the public ops' entry reads.",
               "The FastComm of the group's host engine while that engine is the group's "
               "engine for host arrays (None otherwise).")

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
    {"bind", (PyCFunction)(void (*)(void))fc_bind, METH_VARARGS | METH_KEYWORDS,
     "bind(*, functions, handle_size, ...): the MPI library and spmd's objects, by keyword."},
    {"set_ring", (PyCFunction)(void (*)(void))fc_set_ring, METH_VARARGS | METH_KEYWORDS,
     "set_ring(*, capacity, next_number, numbers, ...): the flight recorder's ring, its "
     "columns by name (Ring.columns())."},
    {"stream", (PyCFunction)(void (*)(void))fc_stream, METH_FASTCALL,
     "stream(dst, src): copy src's bytes to the start of dst past the cache (into the "
     "shared window, which other processes read next)."},
    {"set_world", (PyCFunction)fc_set_world, METH_O,
     "set_world(world_state): the world's state (a WorldSlots) whose default group the "
     "public ops' entry reads."},
    FASTCALL("all_reduce", d_all_reduce, "all_reduce(tensor, op, group) -> bool"),
    FASTCALL("broadcast", d_broadcast, "broadcast(tensor, src, group, group_src) -> bool"),
    FASTCALL("reduce", d_reduce, "reduce(tensor, dst, op, group, group_dst) -> bool"),
    FASTCALL("all_gather_into_tensor", d_all_gather,
             "all_gather_into_tensor(output_tensor, input_tensor, group) -> bool"),
    FASTCALL("reduce_scatter_tensor", d_reduce_scatter,
             "reduce_scatter_tensor(output, input, op, group) -> bool"),
    FASTCALL("all_to_all_single", d_all_to_all,
             "all_to_all_single(output, input, output_split_sizes, input_split_sizes, group) "
             "-> bool"),
    FASTCALL("barrier", d_barrier, "barrier(group) -> bool"),
    FASTCALL("send", d_send, "send(tensor, dst, group, tag, group_dst) -> bool"),
    FASTCALL("recv", d_recv, "recv(tensor, src, group, tag, group_src) -> bool"),
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
    if (PyType_Ready(&FastCommType) < 0 || PyType_Ready(&PiecesType) < 0
            || PyType_Ready(&WorldSlotsType) < 0 || PyType_Ready(&GroupSlotsType) < 0)
        return NULL;
    INTERN(s_mpi_engine, "MPI");
    for (int i = 0; i < N_OPS; i++) INTERN(s_ops[i], OP_NAMES[i]);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "FastComm", (PyObject *)&FastCommType) < 0
            || PyModule_AddObjectRef(m, "Pieces", (PyObject *)&PiecesType) < 0
            || PyModule_AddObjectRef(m, "WorldSlots", (PyObject *)&WorldSlotsType) < 0
            || PyModule_AddObjectRef(m, "GroupSlots", (PyObject *)&GroupSlotsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
