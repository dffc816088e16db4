"""Test support that ships with the package (never imported by library code paths).

- :mod:`hybridmem.testing.workers`: a reusable pool of processes joined in a gloo group, so
  distributed tests do not pay process start-up per test.
"""
