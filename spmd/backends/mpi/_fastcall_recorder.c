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

/* set_ring(storage): the recorder's ring, as Ring.storage() gives it (again at every
 * resize). */
PyObject *fc_set_ring(PyObject *m, PyObject *storage) {
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
