"""Proofs: the one fingerprint, the one comparison engine, and what stands on them.

The round trip's report, the checkpoint doctor (``compare``), the probe, numerical parity, the
round-trip job and ``verify-update``'s check of a pushed weight update. Imports the layers below
(convert/, runtime/, io/, core/, compat/), never testing/ or cli/.
"""
