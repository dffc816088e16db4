"""Runnable examples shipped with the package (``hybridmem demo`` runs them)."""
