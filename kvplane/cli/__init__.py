"""The ``kvplane`` command line: ``info``, ``bench`` and ``conformance``."""
