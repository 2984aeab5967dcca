"""Ranks laid out for parallelism: DeviceMesh, Megatron's parallel_state, node topology, MPMD programs."""
