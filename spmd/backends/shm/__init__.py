"""The node-local shared-memory engine for host arrays, hierarchical across nodes."""
