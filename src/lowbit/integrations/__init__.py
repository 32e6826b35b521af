"""Thin adapters for the training frameworks users already run (optional extras), each on with one line,
off by deleting it, and saying so when it compresses nothing (one process, a wrapper it has no hook for):

* :mod:`lowbit.integrations.transformers` — ``register(trainer, ...)`` for the Hugging Face Trainer;
* :mod:`lowbit.integrations.lightning` — ``LowbitCallback`` for PyTorch Lightning (CPU and GPU alike);
* :mod:`lowbit.integrations.accelerate` — ``register(accelerator, model)`` for Hugging Face Accelerate.

Each registers :func:`lowbit.ddp.register` on a ``DistributedDataParallel`` model and
:func:`lowbit.fsdp.register` on an FSDP2 (``fully_shard``) model, whichever the framework built
(:mod:`lowbit.integrations._register`). docs/integrations.md has one line per trainer.
"""
