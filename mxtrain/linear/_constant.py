"""``assume_constant_result``: the mark ``torch.compile`` reads on a function whose result it may treat as a
constant, set without importing ``torch._dynamo``.

``torch._dynamo.assume_constant_result`` only sets ``fn._dynamo_marked_constant = True``; importing
``torch._dynamo`` to call it costs about 0.9 s in every process that imports mxtrain (each CLI call, each study
worker, each torchrun rank) although most of them never compile. The mark is the same attribute;
tests/test_startup.py checks it against torch's own decorator, so a torch that marks differently fails there."""

from __future__ import annotations


def assume_constant_result(fn):
    fn._dynamo_marked_constant = True
    return fn
