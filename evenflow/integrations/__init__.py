"""Evenflow under the training frameworks people already use: each submodule imports its
framework only when imported itself (``evenflow.integrations.accelerate``,
``evenflow.integrations.huggingface``)."""
