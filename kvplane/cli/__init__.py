"""The ``kvplane`` command line: ``info`` and ``bench``."""
