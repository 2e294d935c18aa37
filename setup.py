"""Builds kvplane's native pieces: the batched memcpy the cpu backend executes plans with, the C loop
that enqueues plans through an accelerator vendor's async memcpy (with memcpy-backed stand-ins for emulation),
and the offload host index's prefix-hash table."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvplane._native._memcpy",
            sources=["kvplane/_native/memcpy.c"],
            extra_compile_args=["-O3", "-std=c11"],
            libraries=["pthread"],
        ),
        Extension(
            "kvplane._native._keytable",
            sources=["kvplane/_native/keytable.c"],
            extra_compile_args=["-O2", "-std=c11"],
        ),
        Extension(
            "kvplane._native._listener_waker",
            sources=["kvplane/_native/listener_waker.c"],
            extra_compile_args=["-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L"],
            libraries=["pthread"],
        ),
        Extension(
            "kvplane._native._async_copy",
            sources=["kvplane/_native/async_copy.c"],
            extra_compile_args=["-O2", "-std=c11"],
        ),
    ]
)
