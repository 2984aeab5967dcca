"""Every rank passes a list where spmd wants an array and does not catch the TypeError:
the traceback printed ends at this file's call (tests/jobs/test_uncaught_tracebacks.py)."""
import spmd

spmd.init_process_group()
values = [1.0, 2.0]
spmd.all_reduce(values)   # the call the traceback ends at
print(f"rank {spmd.get_rank()} went on after the error", flush=True)
