"""Sluice: the local model side (importable without quart)."""
