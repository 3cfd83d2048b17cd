"""Evenflow under the training frameworks people already use, each in a module of its own that
imports its framework only when imported itself: :mod:`evenflow.integrations.lightning` (PyTorch
Lightning), :mod:`evenflow.integrations.huggingface` (the Hugging Face ``Trainer``) and
:mod:`evenflow.integrations.accelerate` (Accelerate)."""
