"""kvplane-toy: a fourth backend package, written the way a vendor outside kvplane would write one.

The test suite installs it into a temporary environment (a dist-info declaring the entry point ``toy`` in the
group ``kvplane.backends``) and runs kvplane's conformance suite on it, with no change to kvplane. Its device
is host memory behind a device module of its own, and its copy function uses a calling convention kvplane's
core does not list: it brings the loop itself, with the native loop's ``plan`` signature.
"""
