"""The ``evenflow`` command line and what composes the server and the agent on one machine.

This is the only package that imports both :mod:`server` and :mod:`agent`: the local cluster
(an in-process control plane plus local agents, for the demo, tests and benchmarks), the
experiment harness behind ``evenflow compare`` and ``evenflow demo``, and the CLI itself.
"""
