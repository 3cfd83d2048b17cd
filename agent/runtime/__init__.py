"""Evenflow's training runtime: the library inside each worker process of a synchronous
data-parallel job whose ranks have unequal local batch sizes.

Modules, by what they are:

- :mod:`~agent.runtime.sampler`: which samples each rank takes (the global batch is split, so
  every sample is used exactly once per epoch whatever the plans).
- :mod:`~agent.runtime.datasets`, :mod:`~agent.runtime.loading`, :mod:`~agent.runtime.streams`,
  :mod:`~agent.runtime.packing`: what ``ctx.batches`` takes (the user's DataLoader, a Dataset,
  an IterableDataset, tensors) and how each rank's share is loaded ahead by DataLoader workers
  under the plan in force.
- :mod:`~agent.runtime.gradients`: the exact all-reduce (summed losses, scaled by 1/B).
- :mod:`~agent.runtime.plan_sync`, :mod:`~agent.runtime.fetcher`: switching all ranks to a plan at
  the same iteration; fetching plans off the critical path on the leading rank.
- :mod:`~agent.runtime.membership`, :mod:`~agent.runtime.resync`, :mod:`~agent.runtime.probes`:
  partial all-reduce: excluded ranks leave the group, probe their speed, and are readmitted with
  parameters and optimizer state re-synchronised.
- :mod:`~agent.runtime.timing`, :mod:`~agent.runtime.emulation`,
  :mod:`~agent.runtime.telemetry`: per-iteration timings, emulated speeds, best-effort delivery.
- :mod:`~agent.runtime.workloads`, :mod:`~agent.runtime.context`, :mod:`~agent.runtime.stats`:
  what to train, and the per-rank loop engine (the user entrypoint API is documented in
  ``workloads``; porting a script in ``docs/guide/porting.md``).
- :mod:`~agent.runtime.rendezvous`: the rank's device and backend from its assignment, and the
  bounded rendezvous (rank 0 binds a free port and publishes it).
- :mod:`~agent.runtime.trainer`: ``run_training``; :mod:`~agent.runtime.worker`: the process
  entry (``python -m agent.runtime.worker``); :mod:`~agent.runtime.remote`: the REST adapter;
  :mod:`~agent.runtime.parent`: a worker dies with its agent.

The runtime never imports the server; it shares only :mod:`contract` with it.
"""
