"""The mxtrain command line: every bad input is one line on stderr, a non-zero exit and no traceback; a short
training run prints validation perplexity and the run folder. The bad-input cases run ``mxtrain.cli.core.main`` in
the test process (a process start costs more than the check; an exception escaping ``main`` fails the test as a
traceback would), and a few of every kind (data, argparse, checkpoint, bench) also as a subprocess."""

import json
import os
import pickle

import pytest
import torch

from train_helpers import one_line_error, run_cli, run_main, small_data, tmpdir




@pytest.fixture(scope="module")
def files():
    d = tmpdir() / "cli"
    d.mkdir(exist_ok=True)
    (d / "empty.txt").write_text("")
    (d / "bad.jsonl").write_text('{"text": "a fine line"}\n{"text": oops}\n')
    (d / "a_file").write_text("not a folder")
    run = d / "corrupt_run"
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text(json.dumps({"exp": "debug"}))
    (run / "checkpoint.pt").write_bytes(b"\x00garbage" * 100)
    trunc = d / "truncated_run"
    trunc.mkdir(exist_ok=True)
    (trunc / "config.json").write_text(json.dumps({"exp": "debug"}))
    buf = tmpdir() / "full.pt"
    torch.save({"format": "mxtrain-ckpt-v1", "model": {"w": torch.zeros(10000)}}, buf)
    (trunc / "checkpoint.pt").write_bytes(buf.read_bytes()[:20000])
    for name, data in (("crafted_run", pickle.dumps({"format": 1, "model": _Call()}, protocol=2)), ("empty_run", b"")):
        (d / name).mkdir(exist_ok=True)
        (d / name / "config.json").write_text(json.dumps({"exp": "debug"}))
        (d / name / "checkpoint.pt").write_bytes(data)
    row = json.dumps({"step": 1, "tokens": 64, "loss": 5.0})
    for name, files in (("list_cfg_run", {"metrics.jsonl": row + "\n", "config.json": "[1, 2, 3]"}),
                        ("bad_row_run", {"metrics.jsonl": row + '\n{"step": "a", "loss": "zz"}\n' + row + "\n"}),
                        ("bad_line_run", {"metrics.jsonl": row + '\n{"step": 2, "lo\n' + row + "\n"}),
                        ("bad_study", {"study.json": "{bad", "runs/bf16/seed0/metrics.jsonl": row + "\n",
                                      "runs/bf16/seed0/study_status.json": '{"state": "done"}'})):
        for rel, text in files.items():
            (d / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / name / rel).write_text(text)
    return d


class _Call:
    """A pickled call of a shell command (never run: checkpoints load with weights_only)."""

    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("case", [
    ("missing data file", ["data", "prepare", "nope.txt", "--out", "x"], ["data file not found", "nope.txt"]),
    ("empty data file", ["data", "prepare", "{d}/empty.txt", "--out", "x"], ["empty"]),
    ("unreadable JSON line", ["data", "prepare", "{d}/bad.jsonl", "--out", "x"], ["bad.jsonl:2", "unreadable JSON line"]),
    ("unknown recipe", ["train", "--recipe", "mxfp3", "--data", "{small}"], ["unknown recipe 'mxfp3'"]),
    ("unknown model", ["train", "--model", "gpt9", "--data", "{small}"], ["unknown model 'gpt9'"]),
    ("unknown experiment", ["train", "--exp", "nope"], ["unknown experiment"]),
    ("bad --set value", ["train", "--set", "optim.lr=fast"], ["optim.lr=fast", "expected a number"]),
    ("bad --set key", ["train", "--set", "optim.speed=1"], ["unknown field 'speed'"]),
    ("non-finite lr", ["train", "--exp", "debug", "--data", "{small}", "--set", "optim.lr=nan"],
     ["optim.lr must be finite"]),
    ("lr past float32", ["train", "--exp", "debug", "--data", "{small}", "--lr", "1e39"],
     ["optim.lr 1e+39 is too large", "overflows float32"]),
    ("beta out of range", ["train", "--exp", "debug", "--data", "{small}", "--set", "optim.beta2=1.5"],
     ["optim.beta2 must be in [0, 1)"]),
    ("infinite prescale", ["train", "--exp", "debug", "--data", "{small}", "--set", "recipe.wgrad_dy.prescale=inf"],
     ["prescale must be a positive finite"]),
    ("bad --set form", ["train", "--set", "optim.lr"], ["key=value"]),
    ("bad flag type", ["train", "--steps", "many"], ["invalid int value"]),
    ("unknown flag", ["train", "--frobnicate"], ["unrecognized arguments"]),
    ("missing data folder", ["train", "--data", "{d}/no_such_dir"], ["data folder not found"]),
    ("not a data folder", ["train", "--data", "{d}"], ["not a prepared data folder"]),
    ("corrupt checkpoint", ["train", "--resume", "{d}/corrupt_run"], ["corrupt or truncated"]),
    ("truncated checkpoint", ["train", "--resume", "{d}/truncated_run"], ["corrupt or truncated"]),
    ("no checkpoint", ["train", "--resume", "{d}/nothing_here"], ["no checkpoint"]),
    ("a file outside any run folder", ["train", "--resume", "{d}/a_file"],
     ["--resume {d}/a_file: no config.json beside the checkpoint", "give a run folder"]),
    ("zero processes", ["train", "--exp", "debug", "--data", "{small}", "--nproc", "0"],
     ["--nproc must be a number of processes >= 1, got 0"]),
    ("negative processes", ["train", "--exp", "debug", "--data", "{small}", "--nproc", "-2"],
     ["--nproc must be a number of processes >= 1, got -2"]),
    ("zero steps printed as a config", ["train", "--steps", "0", "--print-config"],
     ["train.steps must be positive, got 0"]),
    ("print-config: a micro-batch that does not divide", ["train", "--micro-batch-size", "5", "--print-config"],
     ["train.batch_size (16) must be a multiple of train.micro_batch_size (5)"]),
    ("print-config: a device name", ["train", "--device", "foo", "--print-config"], ["unknown device 'foo'"]),
    ("print-config: a recipe switch", ["train", "--set", "train.switch_recipe=1:nope", "--print-config"],
     ["unknown recipe 'nope'"]),
    ("print-config: the built-in vocab", ["train", "--set", "data.vocab_size=100", "--print-config"],
     ["multiple of 32", "got 100"]),
    ("print-config: negative tokens", ["train", "--tokens", "-100", "--print-config"], ["--tokens must be positive"]),
    ("output folder not writable", ["train", "--exp", "debug", "--data", "{small}", "--out", "{d}/a_file/run"],
     ["cannot write to output folder"]),
    ("cuda on a CPU machine", ["train", "--exp", "debug", "--data", "{small}", "--device", "cuda:0"], ["CUDA"]),
    ("CUDA graphs on a CPU", ["train", "--exp", "debug", "--data", "{small}", "--recipe",
                              "mxfp4-all-sr", "--cuda-graphs", "--device", "cpu"],
     ["train.cuda_graphs needs one GPU", "not a CUDA GPU"]),
    ("unknown benchmark", ["bench", "speed"], ["unknown benchmark 'speed'"]),
    ("unknown bench recipe", ["bench", "linear", "--presets", "tseng,mxfp5"], ["unknown recipe 'mxfp5'"]),
    ("bench on a CPU machine (cuda)", ["bench", "linear"], ["needs a CUDA GPU"]),
    ("crafted checkpoint", ["train", "--resume", "{d}/crafted_run"], ["holds objects other than tensors", "posix.system"]),
    ("empty checkpoint", ["train", "--resume", "{d}/empty_run"], ["corrupt or truncated (EOFError)"]),
    ("report: config.json not an object", ["report", "{d}/list_cfg_run"], ["config.json holds a JSON list"]),
    ("report: a metrics row not a number", ["report", "{d}/bad_row_run"], ["metrics.jsonl:2", "not a number"]),
    ("report: a metrics line not JSON", ["report", "{d}/bad_line_run"],
     ["metrics.jsonl:2: a line that is not valid JSON", "remove the line"]),
    ("report: study.json not JSON", ["report", "{d}/bad_study"], ["study.json is not valid JSON"]),
    ("report: --smooth-k", ["report", "{d}/bad_study", "--smooth-k", "-3"], ["--smooth-k", "must be in [1, inf), got -3"]),
    ("report: --target-frac", ["report", "{d}/bad_study", "--target-frac", "5"], ["--target-frac", "must be in (0, 1], got 5"]),
    ("report: --out a file", ["report", "{d}/bad_study", "--out", "{d}/a_file"], ["exists and is not a folder"]),
    ("report: --out a run folder", ["report", "{d}/bad_study", "--out", "{d}/corrupt_run"],
     ["holds other files (checkpoint.pt, config.json)", "would overwrite its summary.json"]),
    ("bench limits: --out under a file", ["bench", "limits", "--bf16-step-ms", "257.5", "--out", "{d}/a_file/x.json"],
     ["cannot write {d}/a_file/x.json", "Not a directory"]),
], ids=lambda c: c[0])
def test_bad_input_is_one_line(files, case):
    _, args, fragments = case
    if "cuda" in case[0] and torch.cuda.is_available():
        pytest.skip("has a GPU")
    args = [a.format(d=files, small=small_data()) for a in args]
    one_line_error(run_main(*args), *[f.format(d=files) for f in fragments])
    if case[0] in IN_A_PROCESS:
        one_line_error(run_cli(*args), *[f.format(d=files) for f in fragments])


# the cases also run as a subprocess: one of each kind of failure (data files, argparse, a checkpoint, --set,
# the output folder, a command needing a GPU)
IN_A_PROCESS = {"unreadable JSON line", "bad flag type", "corrupt checkpoint", "infinite prescale",
                "output folder not writable", "bench on a CPU machine (cuda)", "bench limits: --out under a file"}


def test_report_on_a_read_only_run_folder_is_one_line(tmp_path, monkeypatch):
    """``report`` writes into the run folder: a read-only one is one line that says to write it elsewhere, and
    ``--out`` does."""
    import builtins
    import errno
    import io
    from pathlib import Path
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens": 64 * i, "loss": 5.0 - i / 10}) + "\n"
                                               for i in range(1, 5))
                                       + json.dumps({"step": 4, "tokens": 256, "val_loss": 4.8}) + "\n")
    real = builtins.open

    def read_only(file, mode="r", *a, **k):   # root ignores the folder's mode: opening to write fails as it would
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") \
                and Path(file).resolve().parent == run.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, mode, *a, **k)
    run.chmod(0o555)
    try:
        monkeypatch.setattr(builtins, "open", read_only)
        monkeypatch.setattr(io, "open", read_only)
        one_line_error(run_main("report", str(run)),
                       f"cannot write the report into {run}: Permission denied", "--out DIR")
        assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
        assert run_main("report", str(run), "--out", str(tmp_path / "rep")).returncode == 0
    finally:
        run.chmod(0o755)
    assert (tmp_path / "rep" / "report.html").is_file()


def test_help_and_version():
    p = run_cli("--help")
    assert p.returncode == 0 and "train" in p.stdout and "data" in p.stdout
    p = run_main("--version")   # (--version and --list in this process: --help stays a subprocess)
    assert p.returncode == 0 and p.stdout.startswith("mxtrain ")
    p = run_main("train", "--list")
    assert p.returncode == 0 and "tiny-main" in p.stdout and "mxfp4-all-dh16" in p.stdout and "llama3-8b" in p.stdout


def test_prepare_then_train_and_resume(tmp_path):
    # in this process (mxtrain.cli.core.main, as run_cli runs it): no step needs a process of its own, and the
    # subprocess path of prepare, train and resume runs elsewhere (test_prepare_force, test_cli_config, test_run_folder)
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": f"Sentence {i % 7} is about topic {i % 5}. " * 12}) + "\n"
                           for i in range(300)))
    p = run_main("data", "prepare", str(src), "--out", str(tmp_path / "data"), "--vocab-size", "512", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "data" / "meta.json").is_file()
    out = tmp_path / "run"
    common = ["--exp", "debug", "--recipe", "bf16", "--data", str(tmp_path / "data"), "--seq-len", "32",
              "--batch-size", "4", "--eval-every", "2", "--eval-tokens", "128", "--out", str(out), "--no-progress",
              "--set", "schedule.horizon_steps=6"]
    p = run_main("train", *common, "--steps", "3")
    assert p.returncode == 0, p.stderr
    assert "val_ppl" in p.stdout and f"run folder: {out}" in p.stdout.strip().splitlines()[-1]
    # the same folder again without --resume is refused
    one_line_error(run_main("train", *common, "--steps", "3"), "already holds a run")
    p = run_main("train", "--resume", str(out), "--steps", "6", "--no-progress")
    assert p.returncode == 0, p.stderr
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x) and "val_loss" not in json.loads(x)]
    assert steps == [1, 2, 3, 4, 5, 6]
