"""``train.cpp_wrapper``: the trainer compiles every block with inductor's C++ wrapper (less host time a step where
the host bounds it: BENCHMARKS.md, "The HF model as a bench step model"); refused where nothing compiles, and said
where ``train.compile=auto`` does not compile on the run's device."""

import pytest
import torch

from mxtrain.errors import UserError


def test_blocks_compile_with_the_cpp_wrapper_when_asked(tmp_path, monkeypatch):
    """With the option, inductor's ``cpp_wrapper`` setting is on whenever a block compiles during the run (a spy
    compiles each block with a backend that records the setting instead of building C++), and back to what it was
    after the run; without the option it stays off. The setting is process-wide for the run, not an option of each
    block's ``compile``: mxtrain/train/cpp_wrapper.py says why."""
    import torch._inductor.config as inductor_config
    from train_helpers import tiny_run_cfg
    from mxtrain.train import trainer as TR
    seen, kwargs = [], []
    real = torch.nn.Module.compile

    def recording_backend(gm, example_inputs):
        seen.append(inductor_config.cpp_wrapper)
        return gm.forward

    def spy(self, *args, **kw):
        kwargs.append(kw)
        return real(self, backend=recording_backend)
    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    import torch._inductor.cpp_builder as cb
    monkeypatch.setattr(cb, "get_cpp_compiler", lambda: "g++")   # (no C++ is built: any machine passes the check)
    before = inductor_config.cpp_wrapper
    for cpp in (True, False):
        seen.clear()
        kwargs.clear()
        torch._dynamo.reset()
        cfg = tiny_run_cfg(tmp_path / str(cpp), 1)
        cfg.train.compile, cfg.train.cpp_wrapper = "on", cpp
        TR.fit(cfg)
        assert len(kwargs) >= 1 and kwargs == [{}] * len(kwargs), kwargs
        assert len(seen) >= 1 and seen == [cpp] * len(seen), seen
        assert inductor_config.cpp_wrapper == before


def test_the_option_is_refused_up_front_where_nothing_compiles(tmp_path):
    from train_helpers import tiny_run_cfg
    from mxtrain.train import trainer as TR
    cfg = tiny_run_cfg(tmp_path / "a", 1)
    cfg.train.compile, cfg.train.cpp_wrapper = "off", True
    with pytest.raises(UserError, match="train.cpp_wrapper is for compiled blocks, but train.compile is off"):
        TR.fit(cfg)
    cfg.train.compile, cfg.train.cuda_graphs = "auto", True
    with pytest.raises(UserError, match="train.cuda_graphs turns compiling off"):
        TR.fit(cfg)
    assert not (tmp_path / "a").exists()


def test_auto_on_a_cpu_says_the_option_does_nothing(tmp_path, capsys):
    from train_helpers import tiny_run_cfg
    from mxtrain.train import trainer as TR
    cfg = tiny_run_cfg(tmp_path / "a", 1)
    cfg.train.compile, cfg.train.cpp_wrapper = "auto", True
    TR.fit(cfg)
    assert "train.cpp_wrapper applies to compiled blocks" in capsys.readouterr().out


def test_no_cpp_compiler_is_one_line_before_any_step(tmp_path, monkeypatch):
    """Where inductor finds no C++ compiler (torch's own lookup raising), the run stops with one line that names
    the option and the way out, before its first step."""
    import torch._inductor.cpp_builder as cb
    from train_helpers import tiny_run_cfg
    from mxtrain.train import trainer as TR

    def none():
        raise RuntimeError("no compiler")
    monkeypatch.setattr(cb, "get_cpp_compiler", none)
    cfg = tiny_run_cfg(tmp_path / "a", 1)
    cfg.train.compile, cfg.train.cpp_wrapper = "on", True
    with pytest.raises(UserError, match="train.cpp_wrapper needs a C\\+\\+ compiler .* leave train.cpp_wrapper off"):
        TR.fit(cfg)
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_bind_backward_thread_runs_a_small_backward_and_keeps_no_state():
    """The workaround for torch's issue #144609 (mxtrain/train/cpp_wrapper.py): one small eager backward on the
    device; on a CPU it runs the same operations. Grad mode and the default dtype are as before."""
    from mxtrain.train.cpp_wrapper import bind_backward_thread
    before = (torch.is_grad_enabled(), torch.get_default_dtype())
    bind_backward_thread(torch.device("cpu"))
    assert (torch.is_grad_enabled(), torch.get_default_dtype()) == before


def test_bench_step_refuses_a_cpp_wrapper_variant_without_a_compiler_as_a_result(monkeypatch):
    """In ``bench step`` a ``cpp_wrapper=true`` variant where no C++ compiler is found fails as that variant's
    result, in one line naming the option; the other variants are not touched."""
    import torch._inductor.cpp_builder as cb
    from mxtrain.bench import step as bs

    def none():
        raise RuntimeError("no compiler")
    monkeypatch.setattr(cb, "get_cpp_compiler", none)
    got = {}
    bs._measure_variant("bf16:cpp_wrapper=true", lambda v, out: got.update({v: out}), model="125m", layers=1,
                        batch=1, seq=16, steps=1, warmup=0, compile_mode="none", device="cpu", recompute_ffn=False,
                        param_dtype="float32", checkpoint_blocks=False, recompute_gemm_inputs=False,
                        memory_budget=None, profile=0)
    err = got["bf16:cpp_wrapper=true"]["error"]
    assert err.startswith("UserError: cpp_wrapper=true needs a C++ compiler"), err
