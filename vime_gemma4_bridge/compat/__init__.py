"""Every seam with, and patch of, someone else's code: each feature-detected, scoped, and in docs/UPSTREAM.md.

Imports nothing of this package outside ``compat``.
"""
