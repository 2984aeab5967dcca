"""Tools around jobs: ``spmd bench``, the ``spmd`` command, the comms log, timelines
(Chrome trace) and the flight-recorder reader."""
