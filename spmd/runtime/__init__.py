"""Groups and the default group, and what keeps a job alive or ends it well.

``group`` (ProcessGroup, new_group, splits), ``world`` (init/destroy), ``control`` (ranks
ask each other where they are), ``debug`` (the debug level), ``watchdog`` (timeouts that
end in a diagnosis, aborting the job).
"""
