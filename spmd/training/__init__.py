"""Training utilities on top of the API: DistributedDataParallel's bucketed gradient all-reduce."""
