"""The training frameworks Evenflow works with, each in a module of its own and imported only
when used: :mod:`evenflow.integrations.lightning` (PyTorch Lightning)."""
