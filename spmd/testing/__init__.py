"""Test doubles for running spmd's GPU code paths on machines without a GPU.

``spmd.testing.device_double`` stands in for the device runtime spmd uses (CuPy arrays,
CUDA streams and events, NCCL communicators): every engine, the watchdog, the flight
recorder and the diagnoses run unchanged on top of it, at any world size, on CPU.
"""

__all__ = ["device_double"]
