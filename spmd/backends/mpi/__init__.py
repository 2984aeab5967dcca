"""The MPI engine for host arrays, its short blocking path and that path's compiled twin."""
