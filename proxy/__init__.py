"""Sluice: the HTTP side."""
