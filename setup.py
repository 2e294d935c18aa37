"""Builds kvplane's one native piece: the batched memcpy the cpu backend executes plans with."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvplane._native._memcpy",
            sources=["kvplane/_native/memcpy.c"],
            extra_compile_args=["-O3", "-std=c11"],
            libraries=["pthread"],
        )
    ]
)
