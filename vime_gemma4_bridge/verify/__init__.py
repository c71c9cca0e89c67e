"""Proofs: the one fingerprint, the one comparison engine, and what stands on them.

The round trip's report, the checkpoint doctor (``compare``), the probe, numerical parity and the
round-trip job; ``verify-update`` uses the engine too. Imports the layers below (convert/, runtime/,
the I/O modules, core/, compat/), never testing/ or cli/.
"""
