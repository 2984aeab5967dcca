"""Foundations every other package stands on.

Errors, reduce ops, dtypes and array adapters, Work and futures, the one wait loop, the
op table, what engines know of their group (context), settings, the launch environment,
node detection, start-up exchanges and the flight recorder.  Nothing here imports
another spmd package.
"""
