/* bind(): the MPI library mpi4py loaded and spmd's objects, handed over once (see
 * _fastcall_bind.h). */
#include "_fastcall_bind.h"

static const char *const FN_NAMES[FN_COUNT] = {
    "MPI_Iallreduce", "MPI_Ireduce", "MPI_Ibcast", "MPI_Iallgather",
    "MPI_Ireduce_scatter_block", "MPI_Ialltoall", "MPI_Ibarrier", "MPI_Isend",
    "MPI_Irecv", "MPI_Test"};

void *fn[FN_COUNT];
int h4;
void *in_place;
Moved moved[MAX_DTYPES];
int n_moved;
Reduced reduced[MAX_OPS];
int n_reduced;
PyTypeObject *ndarray_type;
PyObject *observers, *recorder, *push_out, *end_op, *given_up, *mpi_error, *bucket_bytes,
    *shm_all_reduce, *failure_of, *summed;
long tag_ub;
int bound;

static void set_ref(PyObject **slot, PyObject *v) {
    Py_XINCREF(v);
    Py_XSETREF(*slot, v);
}

/* The sum kernels by the names spmd.backends.mpi.routes.SUMMED gives dtypes; their
 * index here is the code Pieces keeps (0: none). */
static const char *const KERNEL_NAMES[] = {"", "float32", "float64", "uint8", "uint16", "uint32",
                                           "uint64"};

static int kernel_code(PyObject *name) {
    const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (text == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "bind: a kernel name must be a str");
        return -1;
    }
    for (int i = 1; i < (int)(sizeof KERNEL_NAMES / sizeof KERNEL_NAMES[0]); i++)
        if (strcmp(text, KERNEL_NAMES[i]) == 0) return i;
    PyErr_Format(PyExc_ValueError, "bind: no sum kernel is named %R", name);
    return -1;
}

/* bind(*, functions, handle_size, in_place, moved, reduced_types, reduced_ops, summed,
 *      tag_ub, ndarray, observers, recorder, push_out, end, given_up, mpi_error,
 *      bucket_bytes, shm_all_reduce, failure): keywords only.  Called once, by
 *      spmd.backends.mpi.fastcall, with the tables of spmd.backends.mpi.routes.
 *
 * functions: {MPI function name: address}; moved: {dtype: datatype handle};
 * reduced_types and reduced_ops: {ReduceOp: {dtype: datatype handle}} and {ReduceOp:
 * {dtype: op handle}}, the same keys; summed: {dtype: kernel name}. */
PyObject *fc_bind(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"functions", "handle_size", "in_place", "moved", "reduced_types",
                            "reduced_ops", "summed", "tag_ub", "ndarray", "observers", "recorder",
                            "push_out", "end", "given_up", "mpi_error", "bucket_bytes",
                            "shm_all_reduce", "failure", NULL};
    PyObject *functions, *mv, *rd, *ro, *sm, *nd, *obs, *rec, *po, *eo, *exp, *me, *bb, *sa,
        *fo;
    int hsize;
    long long ip;
    long ub;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O!iLO!O!O!O!lO!O!OOOOOOOO", names, &PyDict_Type,
                                     &functions, &hsize, &ip, &PyDict_Type, &mv, &PyDict_Type, &rd,
                                     &PyDict_Type, &ro, &PyDict_Type, &sm, &ub, &PyType_Type, &nd,
                                     &PyList_Type, &obs, &rec, &po, &eo, &exp, &me, &bb, &sa,
                                     &fo))
        return NULL;
    if (kw == NULL || PyDict_GET_SIZE(kw) != (Py_ssize_t)(sizeof names / sizeof *names) - 1) {
        PyErr_SetString(PyExc_TypeError, "bind: every argument is required, by keyword");
        return NULL;
    }
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
    if (PyDict_GET_SIZE(mv) > MAX_DTYPES || PyDict_GET_SIZE(rd) > MAX_OPS) {
        PyErr_SetString(PyExc_ValueError, "bind: too many dtypes or ops");
        return NULL;
    }
    Moved new_moved[MAX_DTYPES];
    int nm = 0, nr = 0;
    Reduced *new_reduced = PyMem_Calloc(MAX_OPS, sizeof(Reduced));
    PyObject *codes = PyDict_New();
    if (new_reduced == NULL || codes == NULL) {
        PyMem_Free(new_reduced);
        Py_XDECREF(codes);
        return PyErr_NoMemory();
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    long long h;
    while (PyDict_Next(mv, &pos, &key, &value)) {
        h = PyLong_AsLongLong(value);
        if (h == -1 && PyErr_Occurred()) goto fail;
        new_moved[nm].dtype = key;
        new_moved[nm++].type = (intptr_t)h;
    }
    pos = 0;
    while (PyDict_Next(rd, &pos, &key, &value)) {
        PyObject *ops = PyDict_GetItemWithError(ro, key);   /* {dtype: op handle} */
        if (!PyDict_Check(value) || PyDict_GET_SIZE(value) > MAX_DTYPES || ops == NULL
                || !PyDict_Check(ops)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "bind: reduced_types[op] and reduced_ops[op] "
                                "must be dicts of at most MAX_DTYPES handles");
            goto fail;
        }
        Reduced *r = &new_reduced[nr++];
        r->op = key;
        Py_ssize_t inner = 0;
        PyObject *dt, *type;
        while (PyDict_Next(value, &inner, &dt, &type)) {
            PyObject *mop = PyDict_GetItemWithError(ops, dt);
            if (mop == NULL) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "bind: reduced_ops has no handle for %R", dt);
                goto fail;
            }
            long long th = PyLong_AsLongLong(type), oh = PyLong_AsLongLong(mop);
            if (PyErr_Occurred()) goto fail;
            r->dt[r->n].dtype = dt;
            r->dt[r->n].type = (intptr_t)th;
            r->mop[r->n++] = (intptr_t)oh;
        }
    }
    pos = 0;
    while (PyDict_Next(sm, &pos, &key, &value)) {
        int code = kernel_code(value);
        PyObject *c = code < 0 ? NULL : PyLong_FromLong(code);
        if (c == NULL || PyDict_SetItem(codes, key, c) < 0) {
            Py_XDECREF(c);
            goto fail;
        }
        Py_DECREF(c);
    }
    /* Keep every dtype and op alive for the process's life (the table holds pointers). */
    for (int i = 0; i < nm; i++) Py_INCREF(new_moved[i].dtype);
    for (int i = 0; i < nr; i++) {
        Py_INCREF(new_reduced[i].op);
        for (int j = 0; j < new_reduced[i].n; j++) Py_INCREF(new_reduced[i].dt[j].dtype);
    }
    memcpy(fn, found, sizeof fn);
    h4 = hsize == 4;
    in_place = (void *)(intptr_t)ip;
    memcpy(moved, new_moved, sizeof(Moved) * (size_t)nm);
    n_moved = nm;
    memcpy(reduced, new_reduced, sizeof(Reduced) * (size_t)nr);
    n_reduced = nr;
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
    set_ref(&failure_of, fo);
    Py_XSETREF(summed, codes);
    tag_ub = ub;
    bound = 1;
    Py_RETURN_NONE;
fail:
    PyMem_Free(new_reduced);
    Py_DECREF(codes);
    return NULL;
}
