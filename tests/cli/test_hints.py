"""What the commands print for the user to read and do next: `data prepare`'s progress in a log file (plain
lines, no carriage returns) and its summary line with --no-progress; the next commands after `train`; the
`data corpus` hint naming the training files (not the folder docs/data.md warns against); a hint for
torchtitan's config sections."""

import importlib
import io
import json
import sys

import pytest

from mxtrain.cli import core as cli
from mxtrain.errors import UserError
from mxtrain.train.config import load_train_config

from train_helpers import small_data

P = importlib.import_module("mxtrain.data.prepare")   # (mxtrain.data.prepare is also the function's name)


def _corpus(tmp_path):
    src = tmp_path / "text.jsonl"
    src.write_text("".join(json.dumps({"text": f"Sentence {i % 7} is about topic {i % 5}. " * 12}) + "\n"
                           for i in range(300)))
    return src


def test_progress_in_a_log_file_is_plain_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(P._Progress.__init__, "__defaults__", (0.0,))   # a line at every batch
    P.prepare([str(_corpus(tmp_path))], tmp_path / "p", vocab_size=512, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "tokenizing: 300 documents" in err.splitlines()[-1]


def test_progress_lines_come_at_a_low_rate():
    bar, out = P._Progress(None, every=3600), io.StringIO()
    saved, sys.stderr = sys.stderr, out
    try:
        for _ in range(100):
            bar.update(10, 1000, 200)
    finally:
        sys.stderr = saved
    assert out.getvalue() == ""


def test_no_progress_keeps_the_summary_line(tmp_path, capsys):
    assert cli.main(["data", "prepare", str(_corpus(tmp_path)), "--out", str(tmp_path / "p"), "--vocab-size", "512",
                     "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "tokenizing" not in err
    assert out.startswith(f"prepared {tmp_path / 'p'}: ") and "train + " in out
    from mxtrain.data.shards import fingerprint   # (the line names it: what a study checks before resuming)
    assert f"; fingerprint {fingerprint(tmp_path / 'p')} (" in out.splitlines()[0]
    assert out.splitlines()[-1] == f"data folder: {tmp_path / 'p'}"


def test_corpus_hint_names_the_training_files_code_last():
    m = {"domains": {"code": {}, "prose": {}, "books": {}}}
    hint = cli.corpus_prepare_hint("/c", m)
    assert hint == ("mxtrain data prepare /c/train/prose.jsonl /c/train/books.jsonl /c/train/code.jsonl "
                    "--val /c/val --out DATA")


def test_train_ends_with_the_next_commands(tmp_path, capsys):
    out = tmp_path / "my run"
    assert cli.main(["train", "--exp", "debug", "--recipe", "bf16", "--data", str(small_data()), "--seq-len", "32",
                     "--batch-size", "4", "--steps", "1", "--eval-tokens", "128", "--out", str(out), "--no-progress",
                     "--set", "schedule.horizon_steps=2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"run folder: {out}"
    q = f"'{out}'"   # (quoted for the shell: the folder has a space)
    nxt = "\n".join(lines[lines.index("next:"):])
    for cmd in (f"mxtrain report {q}", f"mxtrain generate {q} --prompt", f"mxtrain eval {q} --data {small_data()}",
                f"mxtrain export {q} --format hf --out '{out}-hf'"):
        assert cmd in nxt, nxt
    assert "--data builtin" in cli.next_commands("runs/a", "builtin")


@pytest.mark.parametrize("section, want", [("job", "did you mean log?"), ("training", "steps -> train.steps")])
def test_torchtitan_sections_get_a_hint(tmp_path, section, want):
    f = tmp_path / "titan.toml"
    f.write_text(f"[{section}]\nsteps = 10\n")
    with pytest.raises(UserError) as e:
        load_train_config(f)
    msg = str(e.value)
    assert "\n" not in msg and f"[{section}] is a torchtitan section" in msg and want in msg
    assert "model, data, optim, schedule, train, log" in msg
