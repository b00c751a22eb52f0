"""Issue #47, third round: settings that take effect or are refused the same way in ``train`` and ``study``,
names that render literally in report.md, an export refused at once while another process writes its output,
and a sweep of our own (bad values in flags, ``--set`` and files, hostile names, read-only folders), each case
in this process through ``cli.core`` (no training unless said).

Found by the sweep (each case: command, what happened before the fix):
* ``study --config F --model 30m`` with ``[model] dim = 576`` in F: 30m 576 wide, where ``train`` refuses the
  same flag over a config file's shape (two commands, two answers).
* ``study`` with ``[study] model = "30m"`` and ``[model] name = "125m"`` (or ``[study] steps`` and
  ``[train] steps``) in one file: the table's value dropped silently.
* ``study --preset smoke --set model.n_heads=3``: "model.dim=64 must be a multiple of model.n_heads=3", not
  saying that 64 came from the preset (``train`` names where each value came from).
* ``--preset P --model M`` dropped only five of the preset's shape keys (``train`` drops ten).
"""

import json
import re

import pytest

from mxtrain.cli.core import build_config, make_parser
from train_helpers import study_model as _study_model, one_line_error, run_main


# -- 1. a model size with shape keys: the same in train and study ----------------------------------------------

def _train_model(*argv) -> dict:
    argv = ["train", *argv]
    cfg = build_config(make_parser(argv).parse_args(argv))
    return {k: v for k, v in cfg.to_dict()["model"].items() if v is not None}


@pytest.mark.parametrize("argv", [("--model", "30m", "--set", "model.dim=576"), ("--exp", "debug", "--model", "30m"),
                                  ("--set", "model.n_layers=3", "--model", "30m"),
                                  ("--exp", "debug", "--set", "model.n_layers=3", "--set", "model.name=30m"),
                                  ("--exp", "debug", "--set", "model.n_layers=3")])
def test_size_and_shape_keys_give_the_same_model_in_train_and_study(argv, tmp_path):
    assert _train_model(*argv) == _study_model(tmp_path, *argv)
    assert _train_model("--model", "30m", "--set", "model.dim=576") == {"name": "30m", "dim": 576}


def test_contradictory_shape_in_a_study_names_where_each_value_came_from(tmp_path):
    out = str(tmp_path / "st")
    for cmd in ("train", "study"):
        one_line_error(run_main(cmd, "--model", "30m", "--set", "model.dim=512", "--out", out,
                                *(["--dry-run"] if cmd == "study" else ["--print-config"])),
                       "model.dim=512 must be a multiple of model.n_heads=6", "named size '30m'",
                       "--set model.dim=512", "30m's model.n_heads=6")
    one_line_error(run_main("study", "--preset", "smoke", "--set", "model.n_heads=3", "--dry-run", "--out", out),
                   "model.dim=64 (preset smoke)", "--set model.n_heads=3")
    f = tmp_path / "s.toml"
    f.write_text("[study]\narms = ['bf16']\n[model]\nn_heads = 5\n")
    one_line_error(run_main("study", "--config", str(f), "--dry-run", "--out", out),
                   f"model.n_heads=5 (study file {f})")
    assert not (tmp_path / "st").exists()


def test_flag_size_over_a_study_files_shape_is_refused_as_for_train(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[study]\narms = ['bf16']\n[model]\ndim = 576\n")
    t = tmp_path / "t.toml"
    t.write_text("[model]\ndim = 576\n")
    one_line_error(run_main("train", "--config", str(t), "--model", "30m", "--print-config"),
                   "--model 30m names a model size", "--set model.dim=576")
    one_line_error(run_main("study", "--config", str(f), "--model", "30m", "--dry-run", "--out", str(tmp_path / "x")),
                   "--model 30m names a model size, and the study file", "sets model.dim of the shape",
                   "add --set model.dim=576")
    f2 = tmp_path / "s2.toml"   # (a [study] overrides list sets the shape as well)
    f2.write_text("[study]\narms = ['bf16']\noverrides = ['model.n_layers=2']\n")
    one_line_error(run_main("study", "--config", str(f2), "--model", "30m", "--dry-run"), "--set model.n_layers=2")
    # kept when asked (the --set repeats it), and when the file names the size itself
    assert _study_model(tmp_path, "--config", str(f), "--model", "30m", "--set", "model.dim=576") == \
        {"name": "30m", "dim": 576}
    f.write_text("[study]\narms = ['bf16']\nmodel = '30m'\n[model]\ndim = 576\n")
    assert _study_model(tmp_path, "--config", str(f)) == {"name": "30m", "dim": 576}
    assert _study_model(tmp_path, "--config", str(f2)) == {"name": "tiny", "n_layers": 2}


@pytest.mark.parametrize("text,fragment", [
    ("[study]\narms = ['bf16']\nmodel = '30m'\n[model]\nname = '125m'\n",
     "[study] model = 30m and model.name = 125m both set model.name of every run; give one of them"),
    ("[study]\narms = ['bf16']\nsteps = 10\n[train]\nsteps = 20\n", "[study] steps = 10 and train.steps = 20"),
    ("[study]\narms = ['bf16']\nlr = 1e-3\n[optim]\nlr = 2e-3\n", "[study] lr = 0.001 and optim.lr = 0.002"),
])
def test_a_study_file_setting_one_key_twice_is_refused(tmp_path, text, fragment):
    f = tmp_path / "s.toml"
    f.write_text(text)
    one_line_error(run_main("study", "--config", str(f), "--dry-run"), fragment)
    f.write_text(text.replace("'125m'", "'30m'").replace("20", "10").replace("2e-3", "1e-3"))   # the same: fine
    assert run_main("study", "--config", str(f), "--dry-run", "--out", str(tmp_path / "x")).returncode == 0


def test_a_named_size_drops_every_shape_key_of_a_preset():
    from mxtrain.study.plan import model_shape_keys
    from mxtrain.train.config import MODEL_SHAPE_FIELDS
    assert model_shape_keys() == tuple(f"model.{k}" for k in MODEL_SHAPE_FIELDS)
    assert {"model.rope_theta", "model.tie_embeddings", "model.n_experts"} <= set(model_shape_keys())


def test_train_help_names_every_model_size():
    from mxtrain.model.llama import SIZES
    p = run_main("train", "--help")
    assert all(name in " ".join(p.stdout.split()) for name in SIZES), p.stdout


# -- 4. names in report.md render as themselves ------------------------------------------------------------------

HOSTILE_ARMS = ("# h1", "- item", "1. first", "2) second", "a$x^2$b", "tail ##", "    code", "===", "---",
                "q\n\n# w", "*a* _b_ `c`")


def test_report_md_names_with_markdown_block_syntax_render_literally(tmp_path, monkeypatch):
    """Arm folders named like a heading, a list item, math, an indented code block, a rule or a blank line
    inside the HTML block of the configurations: where report.md starts a line or a list item with a name (its
    verdict and noise lists), it is escaped so that it makes no heading, list, rule or code block of its own and
    shows as itself (CommonMark shows a backslash-escaped character as the character, an entity as its text)."""
    from mxtrain.study import metrics as M
    from mxtrain.study import report
    from test_study import curve, write_run
    monkeypatch.setattr(report, "plots_available", lambda: False)
    toks = [1000.0 * i for i in range(1, 21)]
    arms = ("bf16",) + HOSTILE_ARMS
    for i, arm in enumerate(arms):
        for s in range(2):
            write_run(tmp_path / "runs" / arm / f"seed{s}", toks, [curve(t / (1 + 0.01 * i), 2.0 + 0.01 * s)
                                                                   for t in toks])
            (tmp_path / "runs" / arm / f"seed{s}" / "config.json").write_text(json.dumps({"recipe": "x"}))
    runs = M.load_study_runs(tmp_path)
    assert set(runs) == set(arms)
    summary = M.sanitize(M.summarize(runs, "bf16", smooth_k=2))
    _, mp = report.write_report(tmp_path, summary)
    md = mp.read_text()
    prose = md.split("## Environment")[0]
    lines = prose.splitlines()
    for arm in HOSTILE_ARMS:
        raw = re.sub(r"[\r\n]+", " ", arm)
        assert not [ln for ln in lines if ln.startswith((raw, "* " + raw))], arm   # (no block of its own)
        assert report._md_text(arm) in prose, arm                                     # (named, escaped)
    assert "* \\# h1" in prose and "* \\- item" in prose and "* 1\\. first" in prose and "* \\---" in prose
    assert "* &#32;&#32;&#32;&#32;code" in prose and "\\# w" in prose
    assert "a\\$x^2\\$b" in md and "tail \\#\\#" in md          # (GitHub's math and a heading's closing #s)
    assert "<summary>q # w seed 0: config.json</summary>" in md   # (a blank line would end the HTML block)


# -- 3. an export while another process holds its output's lock ------------------------------------------------

def test_export_is_refused_at_once_while_another_process_writes_its_output(tmp_path):
    """Another process holding the flock on --out's lock file (``.NAME.lock`` beside it, as an export takes it
    before reading anything): this export is refused at once, naming that pid, before it looks at the run folder
    (here there is none); once that process ends, the same command gets as far as the run folder, and leaves no
    lock file, no temporary folder and no --out behind."""
    import subprocess
    import sys
    import time
    out = tmp_path / "hf"
    holder = ("import fcntl, os, sys\nf = open(sys.argv[1], 'a+')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
              "f.write(f'{os.getpid()}\\n'); f.flush()\nprint('locked', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-I", "-c", holder, str(tmp_path / ".hf.lock")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        one_line_error(run_main("export", str(tmp_path / "no-run"), "--format", "hf", "--out", str(out)),
                       f"output folder {out} is being written by another mxtrain export (pid {p.pid})")
        assert time.monotonic() - t0 < 5
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    one_line_error(run_main("export", str(tmp_path / "no-run"), "--format", "hf", "--out", str(out)),
                   "run folder not found")
    assert sorted(q.name for q in tmp_path.iterdir()) == []


# -- 5. the sweep: values, files and folders -------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 2-step run (debug model on the small corpus), with its checkpoint."""
    from mxtrain.train import train
    from train_helpers import tiny_run_cfg
    return train(tiny_run_cfg(tmp_path_factory.mktemp("r3") / "run", 2))


def _files(d) -> dict:
    from pathlib import Path
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in Path(d).rglob("*")}


ZERO_SHAPE = [(("train", "--print-config", "--set", "model.n_heads=0"), "model.n_heads must be in [1, inf), got 0"),
              (("train", "--print-config", "--set", "model.n_kv_heads=0"), "model.n_kv_heads must be in [1, inf)"),
              (("study", "--arms", "bf16", "--dry-run", "--set", "model.n_heads=0"), "model.n_heads must be in")]


@pytest.mark.parametrize("argv,fragment", ZERO_SHAPE, ids=[" ".join(a[-2:]) for a, _ in ZERO_SHAPE])
def test_a_zero_head_count_is_one_line_not_a_division_by_zero(argv, fragment):
    one_line_error(run_main(*argv), fragment)


EMPTY = [   # an unset shell variable: `--out "$OUT"` was read as "not given" (a default folder, the default
    # experiment, the working folder as data)
    (("train", "--print-config", "--out", ""), "--out '': an empty value"),
    (("train", "--print-config", "--exp", ""), "--exp '': an empty value"),
    (("train", "--print-config", "--data="), "--data '': an empty value"),
    (("eval", "RUN", "--data", ""), "--data '': an empty value"),
    (("eval", "", "--data", "builtin"), "an empty argument ('') after `eval`"),
    (("report", "DIR", "--arms", ""), "--arms '': an empty value"),
    (("report", "DIR", "--baseline", ""), "--baseline '': an empty value"),
    (("study", "--arms", "bf16", "--out", "", "--dry-run"), "--out '': an empty value"),
    (("study", "--arms", "bf16", "--config", "", "--dry-run"), "--config '': an empty value"),
    (("data", "prepare", "", "--out", "x"), "an empty argument ('') after `data prepare`"),
    (("export", "RUN", "--format", "hf", "--out", ""), "--out '': an empty value"),
]


@pytest.mark.parametrize("argv,fragment", EMPTY, ids=[" ".join(a) for a, _ in EMPTY])
def test_an_empty_value_is_refused_not_read_as_not_given(argv, fragment, tmp_path):
    one_line_error(run_main(*argv, cwd=tmp_path), fragment)
    assert not any(tmp_path.iterdir())


def test_empty_values_that_mean_something_stay_allowed():
    from mxtrain.cli.core import _refuse_empty
    _refuse_empty(["generate", "RUN", "--prompt", ""], "generate")          # an empty prompt
    _refuse_empty(["study", "--preset", "headline", "--references", ""], "study")   # no reference arms
    _refuse_empty(["train", "--set", "log.out="], "train")                   # --set's own rule (unset)


@pytest.mark.parametrize("name,text,ok", [
    ("null.json", "null", False), ("null.yaml", "~\n", False), ("n.yaml", "null\n", False),
    ("bom.toml", "\ufeff[train]\nsteps = 3\n", True), ("bom.json", "\ufeff{\"train\": {\"steps\": 3}}", True),
    ("empty.yaml", "", True), ("comments.yaml", "# nothing yet\n---\n", True), ("empty.toml", "", True)])
def test_config_files_null_refused_bom_and_empty_read(tmp_path, name, text, ok):
    f = tmp_path / name
    f.write_text(text, encoding="utf-8")
    p = run_main("train", "--exp", "debug", "--config", str(f), "--print-config")
    if not ok:
        one_line_error(p, f"{f}: the file must hold a table of keys", "not null")
    else:
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["train"]["steps"] == (3 if "steps" in text else 20)


def test_study_file_values_given_empty_or_unknown_are_refused_even_under_a_flag(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[study]\narms = ['bf16']\nout = ''\n")
    one_line_error(run_main("study", "--config", str(f), "--dry-run"), "study.out = '': an empty value")
    f.write_text("[study]\narms = ['bf16']\nexp = 'nope'\n")
    one_line_error(run_main("study", "--config", str(f), "--exp", "debug", "--dry-run"),
                   "study.exp: 'nope' is not an experiment")


def test_a_text_field_with_no_json_or_parquet_data_is_refused(tmp_path):
    """--text-field names the text of JSON / Parquet / datasets sources; with plain text, the built-in corpus or a
    prepared folder it was dropped silently."""
    from mxtrain.cli.core import check_text_field
    from mxtrain.errors import UserError
    txt, jl = tmp_path / "a.txt", tmp_path / "b.jsonl"
    txt.write_text("plain text\n")
    jl.write_text('{"body": "hello"}\n')
    one_line_error(run_main("data", "prepare", str(txt), "--out", str(tmp_path / "d"), "--text-field", "body"),
                   "--text-field body: none of the data is JSON, Parquet or a datasets folder")
    one_line_error(run_main("eval", "nope", "--data", "builtin", "--text-field", "body"), "--text-field body")
    check_text_field("body", [str(txt), str(jl)])   # one JSON source among them: the field is used
    check_text_field("text", [str(txt)])            # the default: nothing given
    check_text_field("x", [str(tmp_path)])            # (a folder of a .txt and a .jsonl: the .jsonl)
    with pytest.raises(UserError, match="--text-field x"):
        check_text_field("x", [str(txt), "builtin"])
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("kind", ["study", "data", "user"])
def test_train_into_another_commands_folder_is_refused_and_writes_nothing(tmp_path, kind):
    """`train --out STUDY` replaced the study's summary.json; `--out DATA` mixed a run into a data folder (which a
    later `data prepare --force` deletes); `--out /` wrote a run into the root. A folder holding anything a run
    does not write is refused before anything is built (a run's own folder and an empty one are not)."""
    from train_helpers import small_data
    d = tmp_path / "out"
    d.mkdir()
    name = {"study": "study.json", "data": "meta.json", "user": "notes.txt"}[kind]
    (d / name).write_text("{}")
    (d / "summary.json").write_text('{"mine": 1}')
    before = _files(d)
    one_line_error(run_main("train", "--exp", "debug", "--data", str(small_data()), "--steps", "1", "--out", str(d)),
                   f"output folder {d} holds files a run does not write ({name})", "give a new or empty --out")
    assert _files(d) == before and (d / "summary.json").read_text() == '{"mine": 1}'


def test_resuming_a_run_with_damaged_files_is_one_line(run_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    with open(bad / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\x00garbage\x95\n")
    one_line_error(run_main("train", "--resume", str(bad), "--steps", "3"),
                   f"{bad}/metrics.jsonl is damaged (bytes that are not UTF-8 text at byte")
    shutil.copy(run_dir / "metrics.jsonl", bad / "metrics.jsonl")
    (bad / "config.json").write_bytes(b"\x95\x00binary")
    one_line_error(run_main("train", "--resume", str(bad), "--steps", "3"), f"cannot read {bad}/config.json to resume")


_DEVICE_CASES = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # (reading /dev/zero whole fails fast, not the host)
sys.path.insert(0, sys.argv[1])
from train_helpers import run_main
out = []
for argv in json.loads(sys.argv[2]):
    p = run_main(*argv)
    out.append([p.returncode, p.stderr])
print(json.dumps(out))
"""


def test_devices_and_pipes_given_as_files_are_refused_unread(run_dir, tmp_path):
    """A config file, a run's config.json or eval --json that is /dev/zero (a link to it) or a pipe: read until
    the memory was full (eval --json /dev/full took 23 GB before the kernel killed it) or waited on for ever."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "pipe.toml")
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "config.json").unlink()
    (run / "config.json").symlink_to("/dev/zero")
    cases = [["train", "--config", str(tmp_path / "zero.json"), "--print-config"],
             ["train", "--config", str(tmp_path / "pipe.toml"), "--print-config"],
             ["study", "--config", str(tmp_path / "zero.json"), "--dry-run"],
             ["train", "--resume", str(run), "--steps", "3"],
             ["eval", str(run_dir), "--data", "builtin", "--json", "/dev/full"]]
    tests = str(Path(__file__).resolve().parents[1])   # (train_helpers)
    p = subprocess.run([sys.executable, "-c", _DEVICE_CASES, tests, json.dumps(cases)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, MXTRAIN_DATA=str(tmp_path)))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.splitlines()[-1])
    for (rc, err), frag in zip(res, ["zero.json is not a regular file (a device, a pipe or a socket)",
                                     "pipe.toml is not a regular file", "zero.json is not a regular file",
                                     "config.json is not a regular file",
                                     "--json /dev/full exists and is not an earlier result of mxtrain eval"]):
        assert rc == 2 and err.startswith("mxtrain: error: ") and frag in err and err.count("\n") == 1, err


# -- read-only folders, as root too (a read-only bind mount: root ignores a folder's mode) ----------------------

@pytest.fixture
def read_only(tmp_path):
    """``make(src)`` -> a read-only view of folder ``src`` (a bind mount remounted read-only; where mounting is not
    allowed and this is not root: the folder's mode), undone at the end."""
    import os
    import subprocess
    mounts, chmods = [], []

    def make(src):
        view = tmp_path / f"ro-{len(mounts) + len(chmods)}"
        view.mkdir()
        ok = subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True).returncode == 0
        if ok:
            mounts.append(view)
            if subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode == 0:
                return view
        if os.geteuid() == 0:
            pytest.skip("root, and no read-only bind mount here")
        view.rmdir() if not ok else None
        for p in [src, *[q for q in src.rglob("*") if q.is_dir()]]:
            p.chmod(0o555)
            chmods.append(p)
        return src
    yield make
    import subprocess as sp
    for m in mounts:
        sp.run(["umount", str(m)], capture_output=True)
    for p in chmods:
        p.chmod(0o755)


def test_read_only_folders(run_dir, tmp_path, read_only, monkeypatch):
    """Reading commands read a read-only run folder and write nothing there; writing ones are refused in one line
    before any work, naming the folder (a report, an export, prepared data can go elsewhere with --out); eval
    --json into a read-only folder is refused before the evaluation (it evaluated the whole split first)."""
    import shutil

    import mxtrain.interop.generate as G
    from train_helpers import small_data
    src = tmp_path / "src"
    shutil.copytree(run_dir, src / "run")
    (src / "empty").mkdir()
    txt = tmp_path / "a.txt"
    txt.write_text("Some text to prepare, in a file of its own.\n" * 200)
    ro = read_only(src)
    run = ro / "run"
    before = _files(src)
    for argv, frag in [
            (("train", "--exp", "debug", "--data", str(small_data()), "--steps", "1", "--out", str(ro / "empty" / "new")),
             f"cannot write to output folder {ro / 'empty' / 'new'}"),
            (("train", "--resume", str(run), "--steps", "3"), f"cannot write to output folder {run}"),
            (("report", str(run)), f"cannot write the report into {run}"),
            (("export", str(run), "--format", "hf", "--out", str(ro / "empty" / "hf")), f"cannot write to {ro / 'empty'}"),
            (("study", "--exp", "debug", "--arms", "bf16", "--seeds", "1", "--steps", "1", "--out", str(ro / "st")),
             f"cannot write to study folder {ro / 'st'}"),
            (("data", "prepare", str(txt), "--out", str(ro / "empty" / "d")),
             f"cannot write to {ro / 'empty'}")]:
        one_line_error(run_main(*argv), frag)
    called = []
    monkeypatch.setattr(G, "evaluate", lambda *a, **k: called.append(1))
    one_line_error(run_main("eval", str(run), "--data", "builtin", "--json", str(run / "e.json")),
                   f"--json {run / 'e.json'}: cannot write to {run}")
    assert not called
    monkeypatch.undo()
    assert run_main("generate", str(run), "--prompt", "a", "--max-tokens", "2").returncode == 0
    assert run_main("report", str(run), "--out", str(tmp_path / "rep")).returncode == 0
    assert run_main("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")).returncode == 0
    assert _files(src) == before   # (the read-only folder as it was)


def test_data_prepare_is_refused_at_once_while_another_prepares_its_output(tmp_path):
    """As an export (above): ``data prepare`` takes ``.NAME.lock`` beside its new --out before any work, so a second
    prepare to the same folder is refused at once, naming the holder's pid, instead of after tokenizing everything
    (the sweep found it refused only at the end); afterwards the same command prepares the folder and leaves no
    lock file behind."""
    import subprocess
    import sys
    src = tmp_path / "c.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "prep"
    holder = ("import fcntl, os, sys\nf = open(sys.argv[1], 'a+')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
              "f.write(f'{os.getpid()}\\n'); f.flush()\nprint('locked', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-I", "-c", holder, str(tmp_path / ".prep.lock")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        one_line_error(run_main("data", "prepare", str(src), "--out", str(out), "--vocab-size", "512"),
                       f"output folder {out} is being prepared by another mxtrain data prepare (pid {p.pid})")
        assert sorted(x.name for x in tmp_path.iterdir()) == [".prep.lock", "c.txt"]   # (nothing made)
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    r = run_main("data", "prepare", str(src), "--out", str(out), "--vocab-size", "512")
    assert r.returncode == 0, r.stderr
    assert (out / "meta.json").is_file() and not (tmp_path / ".prep.lock").exists()
