"""Issue #47, a sweep of our own: hostile or careless CLI inputs that were a hang, a silent wrong result or a
misleading message, each now one ``mxtrain: error:`` line (in this process, no training, no model loaded).

Found by the sweep (each case: command, what happened before the fix):
* ``study --arms ""`` (and ``arms = []`` in a study file): planned and ran the default arms (silent wrong).
* ``train --nproc 99999999999999999999``: torchrun tried to start that many processes (a hang, growing memory).
* ``generate RUN --prompt hi --max-tokens 99999999999999``: ran for ever with no output (a hang).
* ``eval RUN --max-tokens -5``: "expected an integer >= 0", though 0 is refused too.
* ``eval RUN --json FOLDER``: evaluated the whole split, then failed to write the result.
"""

import pytest

from train_helpers import one_line_error, run_main


@pytest.mark.parametrize("arms", ["", ",", " , "])
def test_study_arms_naming_no_arm_is_refused(arms):
    one_line_error(run_main("study", "--exp", "debug", "--arms", arms, "--dry-run"), "--arms", "names no arm")


def test_study_file_with_empty_arms_is_refused(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[study]\narms = []\n")
    one_line_error(run_main("study", "--exp", "debug", "--config", str(f), "--dry-run"), "--arms", "names no arm")


def test_nproc_beyond_one_machine_is_refused_before_torchrun():
    one_line_error(run_main("train", "--exp", "debug", "--print-config", "--nproc", "9" * 20), "--nproc", "at most")


def test_generate_max_tokens_has_an_upper_bound():
    one_line_error(run_main("generate", "nope", "--prompt", "hi", "--max-tokens", str(10 ** 14)),
                   "--max-tokens", "at most")


@pytest.mark.parametrize("v", ["-5", "0"])
def test_eval_max_tokens_message_says_positive(v):
    one_line_error(run_main("eval", "nope", "--data", "builtin", "--max-tokens", v), "--max-tokens", ">= 1")


def test_eval_json_into_a_folder_fails_before_evaluating(tmp_path):
    # the run does not exist: the --json check comes first, before any model is loaded or evaluated
    one_line_error(run_main("eval", str(tmp_path / "nope"), "--data", "builtin", "--json", str(tmp_path)),
                   "--json", "is a folder")
    one_line_error(run_main("eval", str(tmp_path / "nope"), "--data", "builtin", "--json",
                            str(tmp_path / "no" / "such" / "e.json")), "--json", "does not exist")


def test_report_of_a_run_with_one_logged_step_prints_no_matplotlib_warning(tmp_path):
    """A run folder killed after its first step (metrics.jsonl: one record, then a torn line): report wrote
    matplotlib's "No artists with labels found to put in legend" warning (a source line) to stderr."""
    import warnings
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tokens": 512, "loss": 8.34, "lr": 0.0006, "grad_norm": 0.6}\n'
                                            '{"step": 2, "tokens": 1024, "lo')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = run_main("report", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert not [x for x in w if "legend" in str(x.message)], [str(x.message) for x in w]
    assert (tmp_path / "report.md").is_file()


def test_study_out_that_is_a_run_folder_is_refused_and_untouched(tmp_path):
    """``study --out RUN`` wrote the study's summary.json over the run's and its report next to the run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')
    (run / "summary.json").write_text('{"the run": 1}')
    one_line_error(run_main("study", "--exp", "debug", "--arms", "bf16", "--seeds", "1", "--steps", "2",
                            "--out", str(run)), "not a study folder", "metrics.jsonl")
    assert (run / "summary.json").read_text() == '{"the run": 1}'
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_a_path_too_long_or_with_a_nul_is_one_line(tmp_path):
    """``OSError: [Errno 36] File name too long`` (export, data prepare, study --out) and ``ValueError: embedded
    null byte`` (a NUL in a path, e.g. from a config file's string) were tracebacks."""
    one_line_error(run_main("study", "--exp", "debug", "--arms", "bf16", "--seeds", "1", "--steps", "1",
                            "--out", str(tmp_path / ("q" * 300))), "too long", "shorter path")
    one_line_error(run_main("study", "--exp", "debug", "--arms", "bf16", "--out", str(tmp_path / "a\x00b")), "NUL")


def test_generate_prompt_that_is_not_utf8_is_one_line():
    """``generate --prompt $'\\xff'``: the byte arrives as a lone surrogate, which the tokenizer refused with a
    TypeError traceback."""
    import pytest as _pytest

    from mxtrain.errors import UserError
    from mxtrain.interop.generate import generate

    class Tok:
        eot_id, vocab_size = 0, 64

        def encode_batch(self, texts):
            raise AssertionError("not reached: the prompt is checked first")
    with _pytest.raises(UserError, match="not valid UTF-8"):
        generate(None, Tok(), "a\udcffb", 2)


def test_eval_json_never_replaces_another_file(tmp_path):
    """``eval --json notes.txt`` wrote the result over the user's file; an earlier result is still replaced."""
    import json
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    one_line_error(run_main("eval", str(tmp_path / "nope"), "--data", "builtin", "--json", str(notes)),
                   "--json", "not an earlier result")
    assert notes.read_text() == "hello"
    old = tmp_path / "e.json"
    old.write_text(json.dumps({"loss": 1.0, "perplexity": 2.7, "windows": 3}))
    p = run_main("eval", str(tmp_path / "nope"), "--data", "builtin", "--json", str(old))
    one_line_error(p, "run folder not found")   # past the --json check: an earlier result may be replaced


def test_report_refuses_a_finished_run_with_an_emptied_metrics_file(tmp_path):
    """A finished study run whose metrics.jsonl was emptied was reported as "did not reach (> -100.0 %)" with
    exit 0: a claim about the recipe from a damaged file."""
    import json
    for arm, val in (("bf16", True), ("mxfp4-all", False)):
        sd = tmp_path / "runs" / arm / "seed0"
        sd.mkdir(parents=True)
        rows = [{"step": s, "tokens": 512 * s, "loss": 8.0 - 0.1 * s} for s in (1, 2, 3, 4)]
        rows += [{"step": s, "tokens": 512 * s, "val_loss": 8.0 - 0.1 * s} for s in (2, 4)] if val else []
        (sd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) if val else "")
        (sd / "study_status.json").write_text('{"state": "done"}')
    one_line_error(run_main("report", str(tmp_path)), "mxfp4-all/seed0/metrics.jsonl", "no validation loss")


def test_config_files_refuse_a_key_given_twice(tmp_path):
    """JSON and YAML keep the last of two equal keys silently (TOML refuses them): a config file whose `steps`
    appears twice is refused in one line instead of training with the second value."""
    from mxtrain.errors import UserError
    from mxtrain.train.config import load_train_config
    j = tmp_path / "d.json"
    j.write_text('{"train": {"steps": 3, "steps": 5}}')
    y = tmp_path / "d.yaml"
    y.write_text("train:\n  steps: 3\n  steps: 7\n")
    for p in (j, y):
        with pytest.raises(UserError, match="'steps' is given twice"):
            load_train_config(p, exp="debug")
    y.write_text("train:\n  steps: 3\nmodel:\n  steps: 3\n")   # the same key in two tables is fine here
    with pytest.raises(UserError) as e:
        load_train_config(y, exp="debug")
    assert "given twice" not in str(e.value)


def test_print_config_checks_the_dtype_training_would_refuse():
    from mxtrain.errors import UserError
    from mxtrain.train.config import TrainConfig, _check
    cfg = TrainConfig()
    cfg.train.dtype = "int8"
    with pytest.raises(UserError, match="train.dtype must be auto, bf16 or fp32"):
        _check(cfg)   # (what --print-config runs, as training does)


def test_bench_limits_layers_zero_and_nan_rates_are_refused():
    import subprocess
    import sys
    for extra, msg in ((["--layers", "0"], "--layers must be positive"),
                       (["--rates", "bf16_tflops=nan"], "must be a positive finite number"),
                       (["--model", "hf-95m", "--seq", "-512"], "must be positive")):
        p = subprocess.run([sys.executable, "-m", "mxtrain", "bench", "limits", *extra], capture_output=True,
                           text=True)
        assert p.returncode != 0 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
