/* How a blocking op's wait ends without the op: given up (a timeout, the group's end, a
 * signal) or an MPI error.  The loop itself is in _fastcall_wait.h. */
#include "_fastcall_wait.h"

int raise_mpi_error(int code) {
    PyObject *r = PyObject_CallFunction(mpi_error, "i", code);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "MPI error %d", code);
    return -1;
}

/* Hand a request the wait ends without to the Python side, which cancels a receive and
 * otherwise holds the request with the call's arrays until MPI is done with them (MPI
 * may still write into them: they must outlive the call), then raises the error of
 * `why`.  0: the op completed after all (a receive whose message had matched), -1: an
 * error is set (for a signal, the signal's). */
int give_up(Handle *req, int op, Call *c, int64_t number, double waited, int why) {
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
