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
    *shm_all_reduce, *summed;
long tag_ub;
int bound;

static void set_ref(PyObject **slot, PyObject *v) {
    Py_XINCREF(v);
    Py_XSETREF(*slot, v);
}

/* bind(functions, handle_size, in_place, moved, reduced, ndarray, observers, recorder,
 *      push_out, end, given_up, mpi_error, tag_ub, bucket_bytes, shm_all_reduce)
 *
 * functions: {MPI function name: address}; moved: [(dtype, type handle)]; reduced:
 * [(op, [(dtype, type handle, op handle)])].  Called once, by spmd.backends.mpi.fastcall. */
PyObject *fc_bind(PyObject *m, PyObject *args) {
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
