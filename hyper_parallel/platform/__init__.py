"""Mechanics on PyTorch."""
