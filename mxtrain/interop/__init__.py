"""The way out of mxtrain and into others' tools (layer 6): ``export`` (Hugging Face folders from run folders,
and a run folder read back as a model), ``generate`` (sampling and evaluation of a run or an exported folder),
``hftrainer`` (``StepCallback``: the MX step kept in ``transformers.Trainer``'s state)."""
