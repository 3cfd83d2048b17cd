"""Evenflow agent, training runtime, wire contract and CLI.

Nothing here imports the server at module level.
"""
