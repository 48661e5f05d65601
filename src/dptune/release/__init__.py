"""The release path: everything a noisy release goes through. ``privatizers`` (the only readers of per-example
gradients) → ``mechanisms.NoisyRelease`` (the one gateway: event recorded in the ``ledger`` before any draw) on batches
from ``sampling`` (Poisson); ``context`` is what one step sees, ``hypergradient`` OSO's sign rules."""
