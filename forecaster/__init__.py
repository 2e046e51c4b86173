"""prewarm: predictive pre-warming for GPU inference fleets (the domain package)."""

__version__ = "0.1.0"
