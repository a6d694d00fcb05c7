"""Mechanics on PyTorch: DeviceMesh, DTensor and c10d collectives."""
