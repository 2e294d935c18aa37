"""The built-in cpu backend: real memcpy on ordered worker threads. Registered through the entry-point group
like every other backend (``kvplane.backend.cpu.plugin``)."""
