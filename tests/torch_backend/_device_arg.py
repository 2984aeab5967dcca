"""The command line the training scripts share: where they train (``--device cuda`` on a
GPU machine, tests/gpu/run.sh) and, optionally, spmd's engines chosen before torch's
group is made (``--spmd-backend cpu:mpi,cuda:mpi``: GPU tensors staged through MPI)."""

import argparse

import torch


def device_from_args() -> torch.device:
    """Parse the arguments; start spmd with ``--spmd-backend`` if given; the device."""
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--spmd-backend", default=None)
    args = p.parse_args()
    if args.spmd_backend:
        import spmd

        spmd.init_process_group(backend=args.spmd_backend)  # the torch backend wraps it
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)  # one GPU per machine here; several ranks share it
    return dev
