/* The flight recorder's ring, as the recorder hands it over (set_ring); the writes of
 * each op are in _fastcall_recorder.h. */
#include "_fastcall_recorder.h"

Ring ring;

static void ring_release(void) {
    if (ring.storage == NULL) return;
    for (int i = 0; i < N_COLUMNS; i++) PyBuffer_Release(&ring.view[i]);
    Py_CLEAR(ring.storage);
    ring.capacity = 0;
}

/* The ring's columns, checked, taken as the ring the writer uses. */
static PyObject *hand_over(PyObject *storage, Py_ssize_t cap, PyObject *count,
                           PyObject *col[N_COLUMNS], PyObject *ops, PyObject *groups,
                           PyObject *dtypes, PyObject *engines, PyObject *devices) {
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
    if (PyList_GET_SIZE(ops) != cap
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

/* set_ring(*, capacity, next_number, numbers, ops, groups, seqs, sizes, dtypes, t0, t1,
 * flags, engines, devices): the recorder's ring (spmd.core.flight_recorder.Ring), its
 * columns by keyword (Ring.columns()), again at every resize. */
PyObject *fc_set_ring(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity", "next_number", "numbers", "ops", "groups", "seqs",
                            "sizes", "dtypes", "t0", "t1", "flags", "engines", "devices", NULL};
    Py_ssize_t cap;
    PyObject *count, *col[N_COLUMNS], *ops, *groups, *dtypes, *engines, *devices;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$nOOO!O!OOO!OOOO!O!", names, &cap, &count,
                                     &col[C_NUMBERS], &PyList_Type, &ops, &PyList_Type, &groups,
                                     &col[C_SEQS], &col[C_SIZES], &PyList_Type, &dtypes,
                                     &col[C_T0], &col[C_T1], &col[C_FLAGS], &PyList_Type,
                                     &engines, &PyList_Type, &devices))
        return NULL;
    if (kw == NULL || PyDict_GET_SIZE(kw) != (Py_ssize_t)(sizeof names / sizeof *names) - 1) {
        PyErr_SetString(PyExc_TypeError, "set_ring: every column is required, by keyword");
        return NULL;
    }
    /* The columns, held together: the writer keeps pointers to them (and the Ring may
     * rebind its attributes later). */
    PyObject *held = PyTuple_Pack(12, count, col[0], col[1], col[2], col[3], col[4], col[5],
                                  ops, groups, dtypes, engines, devices);
    if (held == NULL) return NULL;
    PyObject *ret = hand_over(held, cap, count, col, ops, groups, dtypes, engines, devices);
    Py_DECREF(held);
    return ret;
}
