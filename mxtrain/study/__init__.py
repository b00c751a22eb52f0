"""Controlled studies: arms (recipes) x seeds from one base config, metrics, diagnostics, reports.

* ``mxtrain.study.metrics``: extra-token cost, final-loss gaps, paired differences (pure Python).
* ``mxtrain.study.diagnostics``: per-GEMM quantization diagnostics on sampled training steps.
* ``mxtrain.study.runner``: ``mxtrain study`` (runs every arm and seed, resumable).
* ``mxtrain.study.report``: ``mxtrain report DIR`` (self-contained HTML + Markdown).
"""
