/* The wait of a blocking op: the loop that tests its request (inline in every op), and
 * its ends other than completion (_fastcall_wait.c): the group's timeout, the group's
 * end, a signal, an MPI error. */
#ifndef SPMD_FASTCALL_WAIT_H
#define SPMD_FASTCALL_WAIT_H

#include "_fastcall_bind.h"

#include <sched.h>
#include <time.h>

/* Why a wait ended without its op (spmd.backends.mpi.fastcall's names). */
enum { GAVE_UP_TIMEOUT, GAVE_UP_ENDED, GAVE_UP_SIGNAL };

/* Hand a request the wait ends without to the Python side, which cancels a receive and
 * otherwise holds the request with the call's arrays until MPI is done with them (MPI
 * may still write into them: they must outlive the call), then raises the error of
 * `why`.  0: the op completed after all (a receive whose message had matched), -1: an
 * error is set (for a signal, the signal's). */
INTERNAL int give_up(Handle *req, int op, Call *c, int64_t number, double waited, int why);

/* Raise mpi4py's error for an MPI error code; -1. */
INTERNAL int raise_mpi_error(int code);

/* How long a napping wait sleeps between polls: its core goes to other processes, and a
 * completion is seen within about this long (plus the kernel's timer slack), short beside
 * a wait that already lasted nap_after.  As spmd.core.wait.NAP_SECONDS. */
#define NAP_NANOSECONDS 20000L

static inline void nap(void) {
    struct timespec ts = {0, NAP_NANOSECONDS};
    Py_BEGIN_ALLOW_THREADS
    nanosleep(&ts, NULL);
    Py_END_ALLOW_THREADS
}

/* Test the request until it completes: the group's timeout, the group's end (broken or
 * destroyed meanwhile: a peer gave the op up), signals, the GIL handed over, the core
 * given away between polls where ranks outnumber cores (a sched_yield: the peer on this
 * core runs at once), and naps between polls past nap_after (a wait that long is for a
 * late peer, and a core spinning or yielding for it is one another process of the node
 * lacks), as spmd.core.wait.wait_until.  A wait that ends without the op gives it up
 * (give_up). */
static inline int wait_for(Handle *req, int op, Call *c, int64_t number) {
    FastComm *fc = c->fc;
    int flag = 0;
    char status[256];   /* larger than any MPI_Status */
    int rc = ((test_fn)fn[FN_TEST])(req, &flag, status);
    if (rc) return raise_mpi_error(rc);
    if (flag) return 0;
    int yield = fc->yield, napping = 0;
    double start = now(), deadline = start + fc->timeout;
    double nap_from = fc->nap_after < 0 ? 1e300 : start + fc->nap_after;
    /* Past the first millisecond each test runs without the GIL, as mpi4py's Test does
     * on the Python path: other Python threads of this rank (spmd's control thread,
     * which answers the diagnosis of a peer's timeout; the user's) get the GIL at every
     * poll instead of once in 256, which in a full test process was too rare for them
     * to make progress (a Python thread ticked 3 times in a 0.5 s receive).  A yielding
     * or napping wait hands the GIL over in each yield or nap. */
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
        if (napping) {
            nap();
        } else if (yield) {
            Py_BEGIN_ALLOW_THREADS
            sched_yield();
            Py_END_ALLOW_THREADS
        }
        /* A yield can take a scheduler tick, a nap tens of microseconds: look at the
         * clock more often then. */
        if (spins & ((yield || napping) ? 7 : 255)) continue;
        double t = now();
        if (t > deadline) return give_up(req, op, c, number, t - start, GAVE_UP_TIMEOUT);
        if (!fc->alive) return give_up(req, op, c, number, t - start, GAVE_UP_ENDED);
        if (PyErr_CheckSignals() < 0)
            return give_up(req, op, c, number, t - start, GAVE_UP_SIGNAL);
        if (t >= nap_from) {
            napping = 1;
            released = 0;
        } else if (!napping && !yield && t - start > 1e-3) {
            released = 1;
        }
    }
}

#endif
