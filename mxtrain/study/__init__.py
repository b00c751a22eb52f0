"""Controlled studies: arms (recipes) x seeds from one base config, metrics, diagnostics, reports.

* ``mxtrain.study.metrics``: extra-token cost, final-loss gaps, paired differences (pure Python).
* ``mxtrain.study.diagnostics``: per-GEMM quantization diagnostics on sampled training steps.
* ``mxtrain.study.plan``: the plan of ``mxtrain study`` (``StudySpec``, presets, each run's training config).
* ``mxtrain.study.run``: one run and its cooldown branches, and a run folder's status.
* ``mxtrain.study.workers``: ``mxtrain study`` (runs every arm and seed, resumable; the worker pool, the lock).
* ``mxtrain.study.summary``: ``summary.json`` and the report, recomputed from the run folders.
* ``mxtrain.study.report``: ``mxtrain report DIR`` (self-contained HTML + Markdown).
"""
