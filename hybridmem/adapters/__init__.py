"""Adapters for training frameworks (import each submodule explicitly; they import their framework)."""
