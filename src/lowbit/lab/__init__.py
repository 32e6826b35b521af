"""The lab around the library: what measures, predicts and reports when low-precision communication pays.

A training script imports the library (``lowbit.codecs``, ``lowbit.comm``, ``lowbit.ddp``, ``lowbit.fsdp``,
``lowbit.parallel``, ``lowbit.auto``, ...), never this package. The lab is:

* :mod:`lowbit.lab.study`: the experiment runner, its presets, metrics, the results store and the report;
* :mod:`lowbit.lab.perfmodel`: the speed model (step time, speedup, calibration, projections, advice);
* :mod:`lowbit.lab.cli`: the ``lowbit`` command, one module a command;
* :mod:`lowbit.lab.data`: the data sets the studies train on (offline ones, the papers' on-disk formats);
* :mod:`lowbit.lab.models`: the model zoo (the seeds' networks and small ones);
* :mod:`lowbit.lab.baselines`: the baselines a study sets beside lowbit's codecs (torch's own hooks).
* :mod:`lowbit.lab.codec_report`: the ``lowbit codecs`` table (bits, error, throughput of each codec).
* :mod:`lowbit.lab.bench`: the measuring half of ``lowbit bench allreduce``.

The lab imports the library; the library never imports the lab, at module level or inside a function
(``tests/unit/test_import_layers.py`` checks it). The one exception is ``python -m lowbit``
(``lowbit/__main__.py``), the command's entry point. This package imports nothing itself, so that
``import lowbit.lab.cli`` does not load the study.
"""
