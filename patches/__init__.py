"""Patch declarations, one module per feature."""
