"""The public operations, with torch.distributed's names and semantics.

Collectives, point-to-point, object collectives, coalescing, persistent collectives and
``monitored_barrier``; ``spmd`` re-exports them.
"""
