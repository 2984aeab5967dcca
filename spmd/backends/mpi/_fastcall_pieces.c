/* Pieces and its kernels: the arrays of one fused all-reduce as one virtual buffer
 * (see _fastcall_pieces.h), the sums that add them in rank order, and the streamed
 * copies into the shared-memory engine's window. */
#include "_fastcall_pieces.h"

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
/* The kernels by code (0: none), in the order of _fastcall_bind.c's KERNEL_NAMES. */
#define SUM_KERNELS 7
static const sum_fn sum_kernels[SUM_KERNELS] = {NULL, sum_f32, sum_f64, sum_u8, sum_u16,
                                                sum_u32, sum_u64};

static void pieces_dealloc(Pieces *self) {
    for (Py_ssize_t i = 0; i < self->k; i++) Py_DECREF(self->refs[i]);
    PyMem_Free(self->piece);
    PyMem_Free(self->refs);
    Py_XDECREF(self->dtype);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The Pieces of ``seq`` (a list of two or more exact, C-contiguous, writable ndarrays of
 * one dtype); Py_None, no error set, for any other list. */
PyObject *pieces_of(PyObject *seq) {
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

PyObject *fc_pieces(PyObject *m, PyObject *seq) {
    return pieces_of(seq);
}

void gather(const Pieces *p, char *dst) {
    for (Py_ssize_t i = 0; i < p->k; i++) {
        memcpy(dst, p->piece[i].data, (size_t)p->piece[i].len);
        dst += p->piece[i].len;
    }
}

void scatter(const Pieces *p, const char *src) {
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
PyObject *fc_stream(PyObject *m, PyObject *const *a, Py_ssize_t n) {
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

PyTypeObject PiecesType = {
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
