"""Issue #47, third round: settings that take effect or are refused the same way in ``train`` and ``study``,
names that render literally in report.md, an export refused at once while another process writes its output,
and a sweep of our own (bad values in flags, ``--set`` and files, hostile names, read-only folders), each case
in this process through ``cli.main`` (no training unless said).

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

from mxtrain.cli import build_config, make_parser
from train_helpers import one_line_error, run_main


# -- 1. a model size with shape keys: the same in train and study ----------------------------------------------

def _train_model(*argv) -> dict:
    argv = ["train", *argv]
    cfg = build_config(make_parser(argv).parse_args(argv))
    return {k: v for k, v in cfg.to_dict()["model"].items() if v is not None}


def _study_model(tmp_path, *argv) -> dict:
    from mxtrain.study.cli import apply_study_file
    from mxtrain.study.plan import StudySpec, build_config as run_config
    argv = ["study", "--arms", "bf16", *argv]
    args = make_parser(argv).parse_args(argv)
    if args.config:
        apply_study_file(args, args.config)
    cfg = run_config(StudySpec.from_args(args), "bf16", 0, tmp_path / "r")
    return {k: v for k, v in cfg.to_dict()["model"].items() if v is not None and k != "init_seed"}


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
    from mxtrain.model import SIZES
    p = run_main("train", "--help")
    assert all(name in " ".join(p.stdout.split()) for name in SIZES), p.stdout


# -- 4. names in report.md render as themselves ------------------------------------------------------------------

HOSTILE_ARMS = ("# h1", "- item", "1. first", "2) second", "a$x^2$b", "tail ##", "    code", "===", "---",
                "q\n\n# w", "*a* _b_ `c`")


def test_report_md_names_with_markdown_block_syntax_render_literally(tmp_path, monkeypatch):
    """Arm folders named like a heading, a list item, math, an indented code block, a rule or a blank line
    inside the HTML block of the configurations: each is shown as itself where report.md names it (rendered
    with markdown-it, CommonMark with tables), and makes no heading, list, rule or code block of its own."""
    import html

    markdown_it = pytest.importorskip("markdown_it")
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
    out = markdown_it.MarkdownIt("commonmark").enable("table").render(md)
    body = out.split("<h2>Environment</h2>")[0]
    for arm in HOSTILE_ARMS:
        shown = html.escape(re.sub(r"[\r\n]+", " ", arm), quote=False)
        assert shown in out, arm
    headings = re.findall(r"<h\d>(.*?)</h\d>", body)
    assert not [h for h in headings if any(a.strip("# \n") in h for a in HOSTILE_ARMS)], headings
    assert "<hr" not in out and "<ol" not in out and "<pre>" not in body   # (no rule, ordered list, code block)
    items = re.findall(r"<li>(.*?)</li>", body, re.S)
    assert not [i for i in items if i.startswith(("item", "h1", "first"))], items
    assert "a\\$x^2\\$b" in md and "tail \\#\\#" in md          # (GitHub's math and a heading's closing #s)
    assert "<summary>q # w seed 0: config.json</summary>" in md   # (a blank line would end the HTML block)
