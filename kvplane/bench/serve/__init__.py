"""Live serving for the bench's ``serve`` rows and tests/serve: a tiny model made on the spot (``model``) and
real ``vllm serve`` and ``kvplane proxy`` processes, started, read and killed (``procs``)."""
