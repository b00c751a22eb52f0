"""Issue #47, "one line, never a traceback": numbers beyond range, config files nested too deeply or referring
to themselves, lone surrogates in JSONL, full disks, host memory exhausted, a tokenizer that makes the
``tokenizers`` library panic, stray seed folders in a study, non-finite study values. Each case runs
``mxtrain.cli.core.main`` in this process (tiny inputs, no training): a non-zero exit, exactly one line on stderr,
no traceback, and no temporary file left where a write failed."""

import errno
import json

import pytest

from train_helpers import run_main, small_data, tmpdir


def _one_line(p, *fragments):
    assert p.returncode not in (0, None), p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mxtrain: error: "), p.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


TRAIN = ["train", "--exp", "debug", "--recipe", "bf16", "--seq-len", "32", "--batch-size", "4", "--print-config"]


@pytest.mark.parametrize("args,fragments", [
    (TRAIN + ["--steps", "9" * 400], ["train.steps", "400 digits"]),
    (TRAIN + ["--tokens", "9" * 400], ["train.tokens", "400 digits"]),
    (TRAIN + ["--seed", "-1"], ["train.seed", "got -1"]),
    (TRAIN + ["--set", f"train.seed={2**64}"], ["train.seed", str(2**64)]),
    (TRAIN + ["--init-seed", str(2**63)], ["model.init_seed"]),
    (TRAIN + ["--data-seed", "-5"], ["data.seed"]),
    (TRAIN + ["--set", "log.eval_every=" + "9" * 50], ["log.eval_every"]),
    (["study", "--schedule", "long-cosine", "--lr-horizon", "inf", "--dry-run"], ["--lr-horizon", "finite"]),
    (["study", "--target-loss", "nan", "--dry-run"], ["--target-loss", "finite"]),
    (["study", "--seeds", "9" * 30, "--dry-run"], ["--seeds"]),
    (["report", "x", "--target-loss", "inf"], ["--target-loss", "finite"]),
    (["generate", "x", "--seed", str(2**64)], ["--seed"]),
], ids=lambda v: " ".join(v)[-40:] if isinstance(v, list) else None)
def test_numbers_beyond_range(args, fragments):
    _one_line(run_main(*args), *fragments)


def test_study_file_values_are_checked_as_flags_are(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[study]\narms = ['bf16']\ntarget_loss = nan\n")
    _one_line(run_main("study", "--config", str(f), "--dry-run"), "--target-loss", "finite")


def test_a_tiny_temperature_samples_the_top_token():
    """--temperature 1e-45 was a nan in multinomial; now as greedy as the logits are apart."""
    import torch

    from mxtrain.interop.generate import generate_ids

    class M(torch.nn.Module):
        cfg = type("C", (), {"vocab_size": 64, "max_seq_len": 8})()

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-3, 3, 64))

        def forward(self, x):
            return self.w.expand(x.shape[0], x.shape[1], 64)
    for t in (1e-45, 1e-320):
        assert generate_ids(M(), [1], 3, temperature=t, top_k=0) == [63, 63, 63]


def _deep_files(d):
    d.mkdir(exist_ok=True)
    (d / "deep.json").write_text('{"a":' * 5000 + "1" + "}" * 5000)
    (d / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    (d / "deep.yaml").write_text("a: " + "[" * 300 + "]" * 300 + "\n")
    (d / "self.yaml").write_text("optim: &a\n  lr: *a\n")
    (d / "laughs.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
        + "recipe_overrides:\n  w: *i\n")
    return d


@pytest.mark.parametrize("name", ["deep.json", "deep.toml", "deep.yaml", "self.yaml", "laughs.yaml"])
@pytest.mark.parametrize("cmd", [["train", "--print-config"], ["study", "--dry-run"]])
def test_config_files_nested_too_deeply_or_aliased(name, cmd):
    pytest.importorskip("yaml")
    d = _deep_files(tmpdir() / "deep_cfg")
    _one_line(run_main(cmd[0], "--config", str(d / name), *cmd[1:]), name)


def test_a_run_folder_json_nested_too_deeply(tmp_path):
    (tmp_path / "study.json").write_text("[" * 5000 + "]" * 5000)
    from mxtrain.errors import UserError, read_json_object
    with pytest.raises(UserError, match="nested too deeply"):
        read_json_object(tmp_path / "study.json")


@pytest.mark.parametrize("text", ['{"text": "fine words"}\n{"text": "bad \\ud800 here"}\n',
                                  '[{"text": "fine"}, {"text": "bad \\udfff"}]'])
def test_lone_surrogates_in_json_input(tmp_path, text):
    src = tmp_path / ("in.jsonl" if text.startswith("{") else "in.json")
    src.write_text(text)
    _one_line(run_main("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--no-progress"),
              "lone surrogate", src.name)
    assert not (tmp_path / "out").exists()


def _full_disk(monkeypatch, after: int, module_open=None):
    """Writes to regular files fail with ENOSPC once ``after`` bytes went through ``open(...).write``."""
    import builtins
    import io
    real = builtins.open
    left = [after]

    class Full(io.BufferedWriter):
        pass

    def opener(file, mode="r", *a, **k):
        f = real(file, mode, *a, **k)
        if "w" not in mode and "a" not in mode:
            return f
        w = f.write

        def write(data):
            left[0] -= len(data)
            if left[0] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return w(data)
        try:
            f.write = write
        except AttributeError:
            return _Wrap(f, write)
        return f
    monkeypatch.setattr(builtins, "open", opener)


class _Wrap:
    def __init__(self, f, write):
        self._f, self.write = f, write

    def __getattr__(self, k):
        return getattr(self._f, k)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self._f.close()


def _leftovers(folder):
    return [p.name for p in folder.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("after", [0, 2000])
def test_full_disk_in_data_prepare(tmp_path, monkeypatch, after):
    src = small_data()   # a tokenizer to reuse: no BPE training here
    text = tmp_path / "t.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n\n") * 40)
    _full_disk(monkeypatch, after)
    p = run_main("data", "prepare", str(text), "--tokenizer", str(src / "tokenizer.json"), "--out",
                 str(tmp_path / "out"), "--no-progress")
    monkeypatch.undo()
    _one_line(p, "no space left", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_full_disk_in_report(tmp_path, monkeypatch):
    import shutil
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "tokens": 64 * s, "loss": 5.0 - s / 10})
                                               + "\n" for s in range(1, 4)))
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "report.md").write_text("old report")
    _full_disk(monkeypatch, 0)
    p = run_main("report", str(run), "--out", str(tmp_path / "rep"))
    monkeypatch.undo()
    _one_line(p, "No space left on device")
    assert (tmp_path / "rep" / "report.md").read_text() == "old report" and not _leftovers(tmp_path)
    shutil.rmtree(tmp_path / "rep")


def test_full_disk_in_corpus_manifest(tmp_path, monkeypatch):
    from mxtrain.data import corpus
    out = tmp_path / "c"
    out.mkdir()
    (out / corpus.MANIFEST).write_text("{}")
    m = {"domains": {}}
    import io
    from mxtrain import _io

    class Full(io.FileIO):
        def write(self, b):
            super().write(bytes(b)[:10])   # part of it, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(_io, "open", lambda p, mode="r", *a, **k: Full(p, "w") if ".tmp-" in str(p)
                        else open(p, mode, *a, **k), raising=False)   # (the module's name for the builtin)
    with pytest.raises(OSError, match="No space left"):
        corpus._write_manifest(out, m)
    monkeypatch.undo()
    assert (out / corpus.MANIFEST).read_text() == "{}" and not _leftovers(tmp_path)


def test_full_disk_in_study_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    """What the top-level handler says for an ENOSPC that reaches it from any command (here: a study's first
    write), and a MemoryError / a CPU allocation failure / a Rust panic likewise."""
    from mxtrain.cli import study as study_cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(study_cli, "study_main", full)
    _one_line(run_main("study", "--out", str(tmp_path / "s"), "--dry-run"), "no space left", str(tmp_path / "s"))


@pytest.mark.parametrize("exc", [MemoryError(),
                                 RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                                              "allocate memory: you tried to allocate 412316860416 bytes.")])
def test_host_memory_exhausted(monkeypatch, exc):
    from mxtrain.cli import core as cli

    def train(args):
        raise exc
    monkeypatch.setattr(cli, "_cmd_train", train)
    p = run_main("train", "--batch-size", "4096", "--seq-len", "512")
    _one_line(p, "out of host (CPU) memory", "--batch-size")
    assert p.returncode == 1


def test_a_tokenizer_whose_regex_panics(tmp_path):
    """pyo3's PanicException is a BaseException: one line naming the tokenizer, and not Rust's panic report."""
    pytest.importorskip("tokenizers")
    tok = json.loads((small_data() / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated",
                            "invert": False}
    (tmp_path / "tok.json").write_text(json.dumps(tok))
    (tmp_path / "a.txt").write_text(("a" * 30000 + "c\n\n") * 2)
    eot = next(t["content"] for t in tok["added_tokens"])
    p = run_main("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--eot-token", eot, "--out", str(tmp_path / "out"), "--no-progress")
    _one_line(p, "tok.json", "tokenizers library")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("stray", ["seed1 ", "seed01", "seed+1", " seed1"])
def test_a_stray_seed_folder_is_not_read_as_a_seed(tmp_path, stray):
    from mxtrain.study.metrics import load_study_runs
    row = json.dumps({"step": 1, "tokens": 64, "loss": 5.0, "val_loss": 5.0}) + "\n"
    bad = json.dumps({"step": 1, "tokens": 64, "loss": 9.0, "val_loss": 9.0}) + "\n"
    for name, text in (("seed1", row), (stray, bad)):
        d = tmp_path / "runs" / "bf16" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(text)
        (d / "study_status.json").write_text('{"state": "done"}')
    runs = load_study_runs(tmp_path)
    assert list(runs["bf16"]) == [1] and runs["bf16"][1].path.name == "seed1"
