"""The ``kvbroker`` command line."""
