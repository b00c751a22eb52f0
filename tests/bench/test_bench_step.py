"""``mxtrain bench step`` (mxtrain.bench.step): the whole-step benchmark's bookkeeping on CPU with a tiny model
(the timings themselves are GPU work, recorded in BENCHMARKS.md): every variant trains the same model from
the same initialization, ratios are against BF16 and the fastest FP8 variant of the run, and a variant
that fails is reported without stopping the others."""

import importlib.util
import statistics

import pytest
import torch

from mxtrain.bench import step as bs


def test_measure_runs_every_variant_and_computes_ratios():
    variants = ["bf16", "fp8", "mxfp4-all-dh16", "torchao-tensorwise"]
    res = bs.measure(variants, model="tiny", layers=2, batch=2, seq=32, steps=2, warmup=1, compile_mode="none",
                     device="cpu")
    runs = res["runs"]
    assert list(runs) == variants
    for v in ("bf16", "fp8", "mxfp4-all-dh16"):
        r = runs[v]
        assert r["ms"] > 0 and len(r["ms_all"]) == 2 and r["tokens_per_s"] == pytest.approx(2 * 32 / (r["ms"] * 1e-3))
        assert r["ms_back_to_back"] > 0   # the same number of steps again, one wait at the end
        assert r["speed_vs_bf16"] == pytest.approx(runs["bf16"]["ms"] / r["ms"])
        assert r["params"] == runs["bf16"]["params"]
    # same model, same init, same tokens: the first loss is the same up to the recipe's quantization error
    assert abs(runs["fp8"]["loss"] - runs["bf16"]["loss"]) < 0.5
    if importlib.util.find_spec("torchao") is None:
        assert "error" in runs["torchao-tensorwise"] and "ms" not in runs["torchao-tensorwise"]
        assert res["best_fp8"] == "fp8"
    assert runs["mxfp4-all-dh16"]["speed_vs_best_fp8"] == pytest.approx(
        runs[res["best_fp8"]]["ms"] / runs["mxfp4-all-dh16"]["ms"])
    table = bs.format_table(res)
    assert "| mxfp4-all-dh16 |" in table and f"vs {res['best_fp8']}" in table
    r = runs["mxfp4-all-dh16"]   # the steps' spread, to judge a ratio near 1 by
    assert f"| {min(r['ms_all']):.1f}-{max(r['ms_all']):.1f} |" in table
    assert "back to back" in table and f"mxfp4-all-dh16 {r['ms_back_to_back']:.1f}" in table


def test_device_time_ratio_from_the_kernel_profiles():
    """With ``--profile`` on a GPU each variant's device time a step is summed from its kernels: BF16's over the
    variant's is ``device_speed_vs_bf16`` (a CPU profile, operators' self time, gives none)."""
    def prof(total, time="device"):
        return {"time": time, "by_class": {"gemm": total / 2, "total": total}, "kernels": [["k", 1.0, total]]}
    res = {"runs": {"bf16": {"ms": 16.8, "profile": prof(16.04)},
                    "mxfp4-all-dh16": {"ms": 17.8, "profile": prof(16.92)},
                    "fp8": {"ms": 17.0, "profile": prof(16.0, time="cpu")},
                    "tseng": {"ms": 18.0}}}
    out = bs.summarize(res)["runs"]
    assert out["mxfp4-all-dh16"]["device_speed_vs_bf16"] == pytest.approx(16.04 / 16.92)
    assert out["bf16"]["device_speed_vs_bf16"] == pytest.approx(1.0)
    assert "device_speed_vs_bf16" not in out["fp8"] and "device_speed_vs_bf16" not in out["tseng"]
    table = bs.format_table(dict(res, model="125m-fused", layers=4, batch=4, seq=4096, compile="default", steps=10))
    assert f"({16.04 / 16.92:.3f}x BF16's device time)" in table


def test_summarize_picks_the_fastest_fp8():
    res = {"runs": {"bf16": {"ms": 100.0, "peak_gib": 40.0},
                    "torchao-tensorwise": {"ms": 80.0, "peak_gib": 34.0},
                    "torchao-rowwise": {"ms": 90.0, "peak_gib": 34.0},
                    "fp8": {"ms": 85.0},
                    "mxfp4-all-dh16": {"ms": 64.0, "peak_gib": 36.0},
                    "tseng": {"error": "OutOfMemoryError"}}}
    out = bs.summarize(res)
    assert out["best_fp8"] == "torchao-tensorwise"
    m = out["runs"]["mxfp4-all-dh16"]
    assert m["speed_vs_bf16"] == pytest.approx(100 / 64) and m["speed_vs_best_fp8"] == pytest.approx(80 / 64)
    assert m["memory_vs_bf16"] == pytest.approx(36 / 40)
    assert "memory_vs_bf16" not in out["runs"]["fp8"] and "speed_vs_bf16" not in out["runs"]["tseng"]
    assert "failed: OutOfMemoryError" in bs.format_table(dict(out, model="8b-layers", layers=4, batch=4, seq=4096,
                                                               compile="default", steps=10))
    # an FP8 variant with options is an FP8 variant of the run; a recipe with options is not
    res["runs"]["fp8:fp8_fast_accum=fprop:fp8_autocast=autocast"] = {"ms": 79.0}
    res["runs"]["mxfp4-all:dual=off"] = {"ms": 60.0}
    assert bs.summarize(res)["best_fp8"] == "fp8:fp8_fast_accum=fprop:fp8_autocast=autocast"


def test_bench_cli_refuses_without_a_gpu_in_one_line():
    import torch

    from train_helpers import one_line_error, run_cli
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    one_line_error(run_cli("bench", "step", "--model", "125m"), "needs a CUDA GPU")


def test_variant_settings_apply_while_it_runs():
    from mxtrain import settings
    assert bs.split_variant("mxfp4-all-dh16:wgrad_x=forward: dual=off") == (
        "mxfp4-all-dh16", {"wgrad_x": "forward", "dual": "off"})
    assert bs.split_variant("bf16") == ("bf16", {})
    with pytest.raises(ValueError, match="key=value"):
        bs.split_variant("mxfp4-all:forward")
    seen = []
    res = bs.measure(["mxfp4-all:wgrad_x=backward", "mxfp4-all:wgrad_x=nowhere"], model="tiny", layers=1,
                     batch=1, seq=16, steps=1, warmup=0, compile_mode="none", device="cpu",
                     on_variant=lambda v, r: seen.append((v, settings.current().wgrad_x, "error" in r)))
    assert seen == [("mxfp4-all:wgrad_x=backward", "backward", False), ("mxfp4-all:wgrad_x=nowhere", "auto", True)]
    assert settings.current().wgrad_x == "auto"
    assert res["runs"]["mxfp4-all:wgrad_x=backward"]["ms"] > 0
    assert res["runs"]["mxfp4-all:wgrad_x=backward"]["settings"] == {"wgrad_x": "backward"}
    assert "wgrad_x" in res["runs"]["mxfp4-all:wgrad_x=nowhere"]["error"]


def test_progress_line_names_inexact_blocks(capsys):
    from mxtrain.bench import suite as bench
    bench._step_progress("mxfp4-all", {"ms": 10.0, "tokens_per_s": 1000.0, "peak_gib": 1.0,
                                       "inexact_blocks": {"x": 3, "w": 0, "dy": 12}})
    bench._step_progress("bf16", {"ms": 10.0, "tokens_per_s": 1000.0, "peak_gib": 1.0,
                                  "inexact_blocks": {"x": 0, "w": 0, "dy": 0}})
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("inexact carrier blocks x 3, w 0, dy 12") and "inexact" not in err[1]


def test_each_finished_variant_is_kept_in_the_out_file(tmp_path, capsys):
    """``bench step --out F``: after each variant, F holds the variants measured so far (a run cut by a time limit
    keeps them); the progress line gives the host and device time a step where they were measured."""
    import json
    import types
    from mxtrain.bench import suite as bench
    out = tmp_path / "step.json"
    on_variant = bench._keeping(types.SimpleNamespace(out=str(out)), "step", bench._step_progress)
    on_variant("bf16", {"ms": 10.0, "tokens_per_s": 1000.0, "peak_gib": 1.0, "host_ms": 4.5,
                        "profile": {"by_class": {"gemm": 6.0, "total": 9.25}}})
    assert list(json.loads(out.read_text())["step_partial"]["runs"]) == ["bf16"]
    on_variant("mxfp4-all", {"error": "RuntimeError: out of memory"})
    got = json.loads(out.read_text())
    assert list(got["step_partial"]["runs"]) == ["bf16", "mxfp4-all"] and "command" in got
    err = capsys.readouterr().err.splitlines()
    assert "host 4.5 ms to issue a step, device 9.2 ms a step" in err[0] and "failed" in err[1]
    on_variant = bench._keeping(types.SimpleNamespace(out=None), "step", bench._step_progress)
    on_variant("bf16", {"ms": 10.0, "tokens_per_s": 1000.0})   # (no --out: nothing written)


def test_bf16_parameters_train_the_same_model_in_bf16(monkeypatch):
    """``param_dtype="bfloat16"``: every variant's model (and so its AdamW state) is bf16 and runs without
    autocast; the table says so; another value is refused."""
    seen = []
    real = torch.optim.AdamW

    def spy(params, *a, **k):
        params = list(params)
        seen.append({p.dtype for p in params})
        return real(params, *a, **k)
    monkeypatch.setattr(torch.optim, "AdamW", spy)
    res = bs.measure(["bf16", "mxfp4-all"], model="tiny", layers=1, batch=2, seq=32, steps=1, warmup=1,
                     compile_mode="none", device="cpu", param_dtype="bfloat16")
    assert seen == [{torch.bfloat16}, {torch.bfloat16}]
    assert all("ms" in r for r in res["runs"].values()) and res["param_dtype"] == "bfloat16"
    assert "bf16 parameters" in bs.format_table(res)
    bad = bs.measure(["bf16"], model="tiny", layers=1, batch=2, seq=32, steps=1, warmup=1, compile_mode="none",
                     device="cpu", param_dtype="float16")
    assert "param_dtype" in bad["runs"]["bf16"]["error"]


def test_checkpoint_blocks_reaches_every_variants_blocks(monkeypatch):
    """--checkpoint-blocks: every variant's blocks run their forward again in the backward: twice the block
    calls of the same measurement without it."""
    from mxtrain.model import llama as M
    calls = []
    real = M.Block._block

    def counted(self, x, cos, sin):
        calls.append(1)
        return real(self, x, cos, sin)
    monkeypatch.setattr(M.Block, "_block", counted)
    kw = dict(model="tiny", layers=1, batch=2, seq=32, steps=1, warmup=1, compile_mode="none", device="cpu")
    plain = bs.measure(["bf16", "mxfp4-all-sr"], **kw)
    n_plain = len(calls)
    calls.clear()
    res = bs.measure(["bf16", "mxfp4-all-sr"], checkpoint_blocks=True, **kw)
    assert res["checkpoint_blocks"] is True and plain["checkpoint_blocks"] is False
    assert all("ms" in r for r in res["runs"].values())
    assert n_plain > 0 and len(calls) == 2 * n_plain
    assert "blocks checkpointed" in bs.format_table(res) and "checkpointed" not in bs.format_table(plain)


def test_recompute_gemm_inputs_applies_to_every_variant_while_it_runs():
    import torch._functorch.config as fc
    before = fc.ban_recompute_materialized_backward
    seen = []
    res = bs.measure(["bf16", "mxfp4-all"], model="tiny", layers=1, batch=1, seq=16, steps=1, warmup=0,
                     compile_mode="none", device="cpu", recompute_gemm_inputs=True,
                     on_variant=lambda v, r: seen.append((v, fc.ban_recompute_materialized_backward)))
    assert seen == [("bf16", False), ("mxfp4-all", False)]
    assert fc.ban_recompute_materialized_backward == before and res["recompute_gemm_inputs"] is True
    assert "GEMM inputs recomputable" in bs.format_table(res)


def test_a_variant_sets_its_own_model_options(monkeypatch):
    """``name:recompute_ffn=true`` / ``:checkpoint_blocks=on``: that variant alone builds its blocks with the
    option, over the run's; the rest of the pairs stay settings; a value that is not a boolean fails that
    variant with a message naming the option."""
    from mxtrain import settings
    seen = []
    real = bs._one_variant

    def spy(variant, *args):   # args[8], args[10]: recompute_ffn, checkpoint_blocks
        seen.append((variant, settings.current().wgrad_x, args[8], args[10]))
        return real(variant, *args)
    monkeypatch.setattr(bs, "_one_variant", spy)
    res = bs.measure(["bf16", "mxfp4-all:recompute_ffn=true:wgrad_x=backward", "bf16:checkpoint_blocks=on",
                      "mxfp4-all:recompute_ffn=maybe"], model="tiny", layers=1, batch=1, seq=16, steps=1,
                     warmup=0, compile_mode="none", device="cpu")
    assert seen == [("bf16", "auto", False, False), ("mxfp4-all", "backward", True, False),
                    ("bf16", "auto", False, True)]   # the refused variant never builds
    runs = res["runs"]
    assert runs["mxfp4-all:recompute_ffn=true:wgrad_x=backward"]["step_options"] == {
        "recompute_ffn": True, "checkpoint_blocks": False}
    assert runs["mxfp4-all:recompute_ffn=true:wgrad_x=backward"]["settings"] == {"wgrad_x": "backward"}
    assert runs["bf16:checkpoint_blocks=on"]["step_options"] == {"recompute_ffn": False, "checkpoint_blocks": True}
    assert runs["bf16"]["step_options"] == {"recompute_ffn": False, "checkpoint_blocks": False}
    assert "recompute_ffn='maybe'" in runs["mxfp4-all:recompute_ffn=maybe"]["error"]
    # the run-wide option, replaced by a variant's own
    res = bs.measure(["bf16", "bf16:recompute_ffn=false"], model="tiny", layers=1, batch=1, seq=16, steps=1,
                     warmup=0, compile_mode="none", device="cpu", recompute_ffn=True)
    assert [r["step_options"]["recompute_ffn"] for r in res["runs"].values()] == [True, False]


def test_bench_cli_checks_a_variants_model_options_before_the_gpu():
    import torch

    from train_helpers import one_line_error, run_main
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    # through mxtrain.cli.core.main in this process (test_bench_cli_refuses_without_a_gpu_in_one_line runs a subprocess)
    one_line_error(run_main("bench", "step", "--variants", "bf16,mxfp4-all:recompute_ffn=maybe"), "recompute_ffn='maybe'")
    # accepted (torchao's variants and recipes alike); then refused only for want of a GPU
    one_line_error(run_main("bench", "step", "--variants",
                           "torchao-tensorwise:recompute_ffn=true,mxfp4-all-dh16:recompute_ffn=on:wgrad_x=forward"),
                   "needs a CUDA GPU")
    # every option a variant may carry passes the check (static_launch was refused as an unknown setting there
    # once, after the GPU had started), and a bad value of each is refused before the GPU
    one_line_error(run_main("bench", "step", "--variants",
                           "mxfp4-all-dh16:static_launch=true,torchao-tensorwise:fast_accum=false"),
                   "needs a CUDA GPU")
    one_line_error(run_main("bench", "step", "--variants", "bf16:static_launch=maybe"), "static_launch='maybe'")
    one_line_error(run_main("bench", "step", "--variants", "mxfp4-all:fast_accum=true"), "fast_accum= is an option")


def test_torchao_variants_take_fast_accum_and_others_refuse_it():
    """``torchao-tensorwise:fast_accum=false``: the option is taken out of the settings and given to torchao's
    config (its forward GEMM's accumulation); on an mxtrain variant it fails that variant with a message naming
    mxtrain's own setting; a value that is not a boolean is refused."""
    over = {"fast_accum": "no", "wgrad_x": "forward"}
    assert bs.torchao_option("torchao-tensorwise", over) is False and over == {"wgrad_x": "forward"}
    assert bs.torchao_option("torchao-rowwise", {"fast_accum": "on"}) is True
    assert bs.torchao_option("torchao-tensorwise", {}) is None
    with pytest.raises(ValueError, match="fp8_fast_accum"):
        bs.torchao_option("fp8", {"fast_accum": "true"})
    with pytest.raises(ValueError, match="true or false"):
        bs.torchao_option("torchao-tensorwise", {"fast_accum": "fast"})
    res = bs.measure(["fp8:fast_accum=true"], model="tiny", layers=1, batch=1, seq=16, steps=1, warmup=0,
                     compile_mode="none", device="cpu")
    assert "fp8_fast_accum" in res["runs"]["fp8:fast_accum=true"]["error"]


def test_rounds_rotate_the_order_and_take_medians_of_each_rounds_ratios(monkeypatch):
    """``rounds=3``: every variant timed once a round, the order rotated so that none always runs first;
    a variant's ms is the median of its rounds' medians, its ratios the medians of the per-round ratios
    (against BF16 and against the FP8 variant with the lowest median, both of the same round), with their
    range; a variant failing in one round keeps the others' results."""
    times = {   # ms of each variant in rounds 1, 2, 3 (one round a slow GPU: every variant slower)
        "bf16": [100.0, 120.0, 104.0],
        "torchao-tensorwise": [80.0, 100.0, 82.0],
        "fp8": [81.0, 96.0, 86.0],
        "mxfp4-all-dh16": [None, 90.0, 75.0],   # failed in round 1
    }
    calls = []

    def fake(base, model, layers, batch, seq, steps, warmup, compile_mode, device, *a):
        n = sum(1 for c in calls if c == base)
        calls.append(base)
        ms = times[base][n]
        if ms is None:
            raise RuntimeError("CUDA out of memory")
        return {"ms": ms, "ms_all": [ms - 1, ms, ms + 1], "warmup_s": 1.0, "tokens_per_s": 1.0, "loss": 5.0,
                "params": 10, "peak_gib": {"bf16": 40.0}.get(base, 30.0) + n, "ms_back_to_back": ms - 2 * n}
    monkeypatch.setattr(bs, "_one_variant", fake)
    seen = []
    res = bs.measure(list(times), model="tiny", layers=1, batch=2, seq=8, steps=3, warmup=0, compile_mode="none",
                     device="cpu", rounds=3, on_variant=lambda v, r: seen.append(v))
    assert calls == ["bf16", "torchao-tensorwise", "fp8", "mxfp4-all-dh16",
                     "torchao-tensorwise", "fp8", "mxfp4-all-dh16", "bf16",
                     "fp8", "mxfp4-all-dh16", "bf16", "torchao-tensorwise"]
    assert seen[0] == "bf16 (round 1/3)" and seen[-1] == "torchao-tensorwise (round 3/3)"
    assert [rr["order"][0] for rr in res["rounds"]] == ["bf16", "torchao-tensorwise", "fp8"]
    runs = res["runs"]
    assert runs["fp8"]["ms"] == 86.0 and runs["fp8"]["ms_rounds"] == [81.0, 96.0, 86.0]
    assert res["best_fp8"] == "torchao-tensorwise"   # median 82 against fp8's 86
    # per-round ratios to BF16 (100/81, 120/96, 104/86): the median of the ratios (100/81), not the ratio of
    # the medians (104/86)
    assert runs["fp8"]["speed_vs_bf16"] == pytest.approx(100 / 81)
    assert runs["fp8"]["speed_vs_bf16_range"] == pytest.approx([104 / 86, 120 / 96])
    assert runs["fp8"]["speed_vs_best_fp8"] == pytest.approx(statistics.median([80 / 81, 100 / 96, 82 / 86]))
    m = runs["mxfp4-all-dh16"]
    assert m["rounds_timed"] == 2 and m["ms"] == pytest.approx(82.5)
    assert runs["fp8"]["ms_back_to_back"] == 82.0   # the median of the rounds' (81, 94, 82)
    assert m["speed_vs_best_fp8"] == pytest.approx(statistics.median([100 / 90, 82 / 75]))
    assert "error" in res["rounds"][0]["runs"]["mxfp4-all-dh16"]
    assert runs["bf16"]["peak_gib"] == 42.0 and m["memory_vs_bf16"] == pytest.approx(32.0 / 42.0)
    table = bs.format_table(res)
    assert "3 rounds" in table
    assert f"| {runs['fp8']['speed_vs_bf16']:.3f}x ({104 / 86:.3f}-{120 / 96:.3f}) |" in table
    with pytest.raises(ValueError, match="rounds"):
        bs.measure(["bf16"], model="tiny", device="cpu", rounds=0)


def test_bench_cli_refuses_a_bad_rounds_value_in_one_line():
    from train_helpers import one_line_error, run_main
    one_line_error(run_main("bench", "step", "--rounds", "0"), "--rounds")   # (in this process)


def test_user_model_with_fused_projections_converts_its_four_layers_a_block():
    """``--model 125m-fused`` / ``8b-fused``: a model written outside mxtrain (an ``nn.Linear`` subclass, fused
    q|k|v and gate|up): ``convert`` takes its 4 linear layers a block and leaves the head; the model trains in a
    measured step like mxtrain's own; the model options it does not offer are refused."""
    import mxtrain
    assert set(bs.USER_MODELS) == {"125m-fused", "8b-fused"}
    m = bs.UserLlama(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, n_layers=2, vocab=128, seq=32)
    bs._convert(m, "mxfp4-all-dh16")
    mx = [n for n, mod in m.named_modules() if isinstance(mod, mxtrain.linear.module.MXLayer)]
    assert mx == [f"layers.{i}.{n}" for i in range(2) for n in ("qkv", "o", "up", "down")]
    assert type(m.head) is torch.nn.Linear
    idx = torch.randint(0, 128, (2, 17))
    loss = m(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.parameters() if p.requires_grad)
    res = bs.measure(["bf16"], model="125m-fused", layers=1, batch=1, seq=32, steps=1, warmup=0,
                     compile_mode="none", device="cpu")
    assert res["runs"]["bf16"]["params"] > 30e6   # d768 and a 32k vocabulary: the 125M class's widths
    res = bs.measure(["bf16"], model="125m-fused", layers=1, batch=1, seq=32, steps=1, warmup=0,
                     compile_mode="none", device="cpu", recompute_ffn=True)
    assert "recompute_ffn" in res["runs"]["bf16"]["error"]


def test_hf_model_converts_the_same_layers_with_mxtrain_and_torchao_and_trains_in_a_step():
    """``--model hf-95m``: docs/library.md's Hugging Face Llama built from a config; ``convert`` and torchao's
    float8 conversion take the same 7 linear layers a block and leave ``lm_head``; the model's own loss trains in a
    measured step; mxtrain's activation-checkpoint options are refused for it."""
    pytest.importorskip("transformers")
    import mxtrain
    assert set(bs.HF_MODELS) == {"hf-95m"} and bs.HF_MODELS["hf-95m"]["hidden_size"] == 1024
    names = {}
    for variant in ("mxfp4-all-dh16", "torchao-tensorwise"):
        if variant.startswith("torchao"):
            pytest.importorskip("torchao.float8")
        m = bs.HFLlama(seq=32, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
        bs._convert(m, variant)
        names[variant] = [n for n, mod in m.named_modules()
                          if (isinstance(mod, mxtrain.linear.module.MXLayer) if variant.startswith("mx")
                              else type(mod).__name__ == "Float8Linear")]
        assert type(m.hf.lm_head) is torch.nn.Linear, variant
    proj = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")
    want = sorted(f"hf.model.layers.{i}.{p}" for i in range(2) for p in proj)
    assert sorted(names["mxfp4-all-dh16"]) == want
    assert sorted(names["torchao-tensorwise"]) == want
    idx = torch.randint(0, 128, (2, 17))
    loss = m(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    res = bs.measure(["bf16"], model="hf-95m", layers=1, batch=1, seq=32, steps=1, warmup=0, compile_mode="none",
                     device="cpu")
    assert 12e6 < res["runs"]["bf16"]["params"] < 13e6   # one block of hidden 1024 (11.8M) and the byte vocabulary
    res = bs.measure(["bf16"], model="hf-95m", layers=1, batch=1, seq=32, steps=1, warmup=0, compile_mode="none",
                     device="cpu", checkpoint_blocks=True)
    assert "checkpoint_blocks" in res["runs"]["bf16"]["error"]


def test_static_launch_and_cpp_wrapper_patch_inductor_while_the_variant_runs():
    """``name:static_launch=true`` and ``name:cpp_wrapper=true``: inductor's
    ``static_launch_user_defined_triton_kernels`` / ``cpp_wrapper`` is on while that variant is built, compiled
    and timed (and recorded with it), off again after; not settings; a value that is not a boolean fails that
    variant alone."""
    import torch._inductor.config as ic
    before = (ic.static_launch_user_defined_triton_kernels, ic.cpp_wrapper)
    seen = []
    res = bs.measure(["bf16", "bf16:static_launch=true", "bf16:static_launch=maybe", "bf16:cpp_wrapper=true"],
                     model="tiny", layers=1, batch=1, seq=16, steps=1, warmup=0, compile_mode="none", device="cpu",
                     on_variant=lambda v, r: seen.append((v, ic.static_launch_user_defined_triton_kernels,
                                                          ic.cpp_wrapper)))
    assert seen == [("bf16", *before), ("bf16:static_launch=true", True, before[1]),
                    ("bf16:static_launch=maybe", *before), ("bf16:cpp_wrapper=true", before[0], True)]
    assert (ic.static_launch_user_defined_triton_kernels, ic.cpp_wrapper) == before == (False, False)
    runs = res["runs"]
    assert runs["bf16:static_launch=true"]["inductor"] == {"static_launch_user_defined_triton_kernels": True}
    assert runs["bf16:cpp_wrapper=true"]["inductor"] == {"cpp_wrapper": True}
    assert runs["bf16:static_launch=true"]["settings"] == {} and "inductor" not in runs["bf16"]
    assert "static_launch='maybe'" in runs["bf16:static_launch=maybe"]["error"]


def test_host_profile_counts_a_calls_operators_per_call():
    """``bench host --profile``'s breakdown: operators' host time and counts are per call (3 calls of a layer whose
    forward and backward make 3 matrix products: one ``aten::mm`` in the forward, two in the backward), and a CPU
    has no kernel launches."""
    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    calls = []

    def fn():
        calls.append(1)
        lin(x).sum().backward()
    pr = bs.host_profile(fn, calls=3, top=50, device="cpu")
    assert len(calls) == 4 and pr["calls"] == 3   # one call before the profile, 3 in it
    assert pr["launches"] == 0 and pr["kernels"] == 0
    rows = {name: (count, us) for name, count, us in pr["host"]}
    assert rows["aten::mm"][0] == 3 and rows["aten::mm"][1] > 0
    assert [r[2] for r in pr["host"]] == sorted((r[2] for r in pr["host"]), reverse=True)


def test_bench_experts_measures_every_variant_on_one_set_of_inputs(monkeypatch):
    """``bench experts``' measuring part on CPU at tiny shapes with a stand-in timer (one call each): Hugging
    Face's MixtralExperts in both implementations and each recipe through the loop and as dispatched, in that
    order, the ratios against the grouped_mm row (without torchao: no peer row); the routing sends each token to
    distinct experts, blocks of 16 tokens alike, so that every expert's group is a multiple of 16."""
    pytest.importorskip("transformers")
    from mxtrain.bench import experts as BE
    monkeypatch.setattr(BE, "torchao_grouped_mm", lambda: None)
    calls = []

    def once(fn):
        fn()
        calls.append(fn)
        return float(len(calls))
    res = BE.measure(["mxfp4-all"], 16, {"experts": 4, "hidden": 32, "width": 32, "top_k": 2}, "cpu",
                     torch.float32, once)
    assert res["errors"] == {}, res["errors"]
    assert list(res["ms"]) == ["bf16 grouped_mm", "bf16 eager", "mxfp4-all loop", "mxfp4-all auto"]
    assert res["vs_grouped_mm"]["bf16 eager"] == 0.5 and res["path"]["mxfp4-all loop"] == "loop"
    idx, w = BE.routing(64, 8, 2, "cpu")
    assert all(len(set(r.tolist())) == 2 for r in idx) and torch.allclose(w.sum(1), torch.ones(64))
    assert all(n % 16 == 0 for n in torch.bincount(idx.flatten(), minlength=8).tolist())
    assert len({tuple(r.tolist()) for r in idx}) > 1 and (idx[:16] == idx[0]).all()
    assert "| mxfp4-all auto |" in BE.format_table(res)


def _reference_grouped_mm(input, weight, offs):
    """A grouped GEMM in plain PyTorch (rows ``offs[e-1]:offs[e]`` times ``weight[e]``), differentiable."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(input[start:end] @ weight[e])
        start = end
    return torch.cat(out)


def test_bench_experts_times_the_peer_grouped_gemm_in_transformers_forward_and_checks_it_ran(monkeypatch):
    """The torchao row puts the peer's grouped GEMM (a stand-in here: torchao's FP8 kernels need a GPU) in place of
    ``transformers``' grouped-GEMM helper for both projections, timed with the others on the same inputs; its
    output equals the ``grouped_mm`` module's (the stand-in is exact). Where ``transformers`` would not call the
    helper (here: the patch aimed at another module), the row fails loudly instead of timing BF16 as the peer."""
    pytest.importorskip("transformers")
    from mxtrain.bench import experts as BE
    seen = []

    def peer():
        def gmm(input, weight, offs):
            seen.append(tuple(weight.shape))
            return _reference_grouped_mm(input, weight, offs)
        return gmm
    monkeypatch.setattr(BE, "torchao_grouped_mm", peer)
    shape = {"experts": 4, "hidden": 32, "width": 48, "top_k": 2}
    res = BE.measure([], 32, shape, "cpu", torch.float32, lambda fn: (fn(), 1.0)[1])
    assert res["errors"] == {}, res["errors"]
    assert list(res["ms"]) == ["bf16 grouped_mm", "bf16 eager", BE.TORCHAO_ROW]
    assert seen[:2] == [(4, 32, 96), (4, 48, 32)]          # gate_up (E, K, 2 I) and down (E, I, K), as B_t
    assert "| torchao fp8 rowwise grouped_mm |" in BE.format_table(res)
    # the peer's output is the module's: the same experts forward around another grouped GEMM
    m = BE.hf_experts(4, 32, 48, 2, "cpu", torch.float32)
    x = torch.randn(32, 32)
    idx, w = BE.routing(32, 4, 2, "cpu")
    m.config._experts_implementation = "grouped_mm"
    want = m(x, idx, w)
    from unittest import mock
    with mock.patch.object(BE._hf_moe(), "_grouped_mm", peer()):
        got = m(x, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    import types
    monkeypatch.setattr(BE, "_hf_moe", lambda: types.SimpleNamespace(_grouped_mm=None))
    res = BE.measure([], 32, shape, "cpu", torch.float32, lambda fn: (fn(), 1.0)[1])
    assert BE.TORCHAO_ROW not in res["ms"]
    assert "ran 0 times" in res["errors"][BE.TORCHAO_ROW] and "no torchao row" in res["errors"][BE.TORCHAO_ROW]


def test_the_table_names_variants_bound_by_the_host_and_what_lowers_host_time():
    """A variant whose host takes at least 90 % of a back-to-back step to issue one is named as bound by the host,
    with the levers (the C++ wrapper, CUDA graphs, more tokens a step); one whose GPU bounds it is not."""
    res = bs.summarize({"runs": {
        "bf16": {"ms": 15.0, "peak_gib": 3.7, "ms_back_to_back": 14.6, "host_ms": 10.7},
        "mxfp4-all-dh16": {"ms": 25.7, "peak_gib": 3.5, "ms_back_to_back": 22.2, "host_ms": 25.4,
                           "mx_layers": 56, "host_us_per_mx_layer_at_most": 454.0}}})
    table = bs.format_table(dict(res, model="hf-95m", layers=None, batch=16, seq=512, compile="default", steps=10))
    line = [x for x in table.splitlines() if x.startswith("bound by the host")]
    assert len(line) == 1 and ": mxfp4-all-dh16;" in line[0] and "bf16" not in line[0], table
    assert "cpp_wrapper=true" in line[0] and "reduce-overhead" in line[0]
