"""The version of spmd."""

__version__ = "0.1.0"
