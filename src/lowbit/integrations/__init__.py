"""Thin adapters for the training frameworks users already run (optional extras):

* :mod:`lowbit.integrations.lightning` — ``LowbitCallback`` for PyTorch Lightning (CPU and GPU alike);
* :mod:`lowbit.integrations.accelerate` — ``register(accelerator, model)`` for Hugging Face Accelerate
  (and so the Hugging Face Trainer).
"""
