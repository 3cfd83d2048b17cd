"""Tests of the training runtime (``agent.runtime``)."""
