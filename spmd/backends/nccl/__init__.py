"""The NCCL engine for GPU arrays, through CuPy, bootstrapped over MPI."""
