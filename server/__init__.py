"""Evenflow control plane (FastAPI)."""
