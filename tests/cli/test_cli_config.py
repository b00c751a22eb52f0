"""Config files (`mxtrain train --config`, `mxtrain study --config`), their precedence, re-running a run from its
folder, and the command listing: every bad input is one clear line."""

import json
import sys
from pathlib import Path

import pytest

from mxtrain.cli.core import build_config, main, make_parser
from mxtrain.errors import UserError
from mxtrain.train import TrainConfig, experiments
from mxtrain.train.config import apply_dict, check_init_from, load_train_config, read_config_file
from mxtrain.train.config import validate
from train_helpers import ROOT, one_line_error, run_cli, run_main, tiny_run_cfg

EXAMPLES = sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".toml", ".json", ".yaml", ".yml"))


def _train_args(*argv):
    argv = ["train", *argv]
    return make_parser(argv).parse_args(argv)


def _cfg(*argv) -> TrainConfig:
    return build_config(_train_args(*argv))


def _study_args(*argv):
    argv = ["study", *argv]
    return make_parser(argv).parse_args(argv)


# -- the example files ---------------------------------------------------------------------------------------

def test_docs_name_every_key():
    from mxtrain.train.config import valid_keys
    doc = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in valid_keys() if f"`{k}`" not in doc]
    assert not missing, f"docs/config.md does not describe {missing}"


def test_there_are_examples_of_both_kinds():
    names = {p.name for p in EXAMPLES}
    assert {"tiny.toml", "study.toml"} <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_validates(path):
    d = read_config_file(path)
    if "study" in d:
        from mxtrain.cli.study import apply_study_file
        from mxtrain.study.plan import StudySpec, build_config as study_run_config
        args = _study_args("--config", str(path))
        apply_study_file(args, args.config)
        spec = StudySpec.from_args(args)
        assert spec.arms == d["study"]["arms"] and spec.seeds == d["study"]["seeds"]
        for arm in spec.arms:
            cfg = study_run_config(spec, arm, 1, Path("/nonexistent/run"))
            validate(cfg)
            assert cfg.recipe == arm and cfg.train.seed == 1
            for sec, table in d.items():  # every value of the file's training tables reached the run's config
                if isinstance(table, dict) and sec != "study":
                    for k, v in table.items():
                        assert getattr(getattr(cfg, sec), k) == v, (sec, k)
    else:
        cfg = load_train_config(path)
        validate(cfg)
        for sec, table in d.items():
            if isinstance(table, dict) and sec != "recipe_overrides":
                for k, v in table.items():
                    got = getattr(getattr(cfg, sec), k)
                    assert got == (pytest.approx(v) if isinstance(v, float) else v), (sec, k)
        assert cfg.recipe == d["recipe"] and cfg.exp == d["exp"]


def test_yaml_example_reads_exponent_without_dot_as_number(tmp_path):
    f = tmp_path / "lr.yaml"
    f.write_text("optim:\n  lr: 3e-3\ntrain:\n  steps: 1e3\n  tokens: null\n")
    cfg = load_train_config(f)
    assert cfg.optim.lr == 3e-3 and cfg.train.steps == 1000 and isinstance(cfg.train.steps, int)


# -- formats, merging, precedence ----------------------------------------------------------------------------

def test_toml_json_yaml_and_dotted_keys_give_the_same_config(tmp_path):
    (tmp_path / "a.toml").write_text('recipe = "mxfp4-all"\n[recipe_overrides]\n"wgrad_dy.rounding" = "stochastic"\n'
                                     '[optim]\nlr = 1e-3\n[model]\ndim = 96\ninit_seed = "none"\n'
                                     '[train]\nsteps = 7\ncompile = "off"\n')
    (tmp_path / "a.json").write_text(json.dumps({"recipe": "mxfp4-all", "recipe_overrides": {"wgrad_dy": {"rounding": "stochastic"}},
                                                 "optim.lr": 0.001, "model": {"dim": 96, "init_seed": None},
                                                 "train": {"steps": 7, "compile": "off"}}))
    (tmp_path / "a.yaml").write_text("recipe: mxfp4-all\nrecipe_overrides:\n  wgrad_dy.rounding: stochastic\noptim:\n"
                                     "  lr: 1.0e-3\nmodel:\n  dim: 96\n  init_seed: null\ntrain:\n  steps: 7\n"
                                     "  compile: 'off'\n")
    dicts = []
    for f in ("a.toml", "a.json", "a.yaml"):
        cfg = load_train_config(tmp_path / f)
        assert cfg.exp == "a"  # labelled by the file's name
        assert cfg.resolved_recipe().wgrad_dy.rounding == "stochastic"
        dicts.append(cfg.to_dict())
    assert dicts[0] == dicts[1] == dicts[2]
    assert dicts[0]["optim"]["lr"] == 1e-3 and dicts[0]["model"]["dim"] == 96 and dicts[0]["train"]["steps"] == 7


def test_a_partial_section_keeps_the_experiments_other_fields(tmp_path):
    f = tmp_path / "f.toml"
    f.write_text('[model]\nn_layers = 3\n')
    cfg = _cfg("--exp", "debug", "--config", str(f))
    debug = experiments.get("debug")
    assert cfg.model.n_layers == 3
    assert (cfg.model.dim, cfg.model.n_heads, cfg.train.steps) == (debug.model.dim, debug.model.n_heads, debug.train.steps)


def test_precedence_defaults_experiment_file_flags_set(tmp_path):
    f = tmp_path / "f.toml"
    f.write_text('[train]\nsteps = 30\n[optim]\nlr = 0.01\n')
    assert TrainConfig().train.steps == 100 and experiments.get("debug").train.steps == 20
    assert _cfg("--exp", "debug").train.steps == 20                                     # experiment > defaults
    assert _cfg("--exp", "debug", "--config", str(f)).train.steps == 30                 # file > experiment
    assert _cfg("--exp", "debug", "--config", str(f), "--steps", "40").train.steps == 40   # flags > file
    assert _cfg("--exp", "debug", "--config", str(f), "--steps", "40",
                "--set", "train.steps=50").train.steps == 50                             # --set > flags
    cfg = _cfg("--exp", "debug", "--config", str(f), "--lr", "0.02")
    assert cfg.optim.lr == 0.02 and cfg.model.dim == experiments.get("debug").model.dim


def test_file_exp_names_the_base_experiment_or_labels_the_run(tmp_path):
    f = tmp_path / "f.json"
    f.write_text(json.dumps({"exp": "debug", "train": {"steps": 3}}))
    cfg = load_train_config(f)
    assert cfg.exp == "debug" and cfg.model.dim == experiments.get("debug").model.dim and cfg.train.steps == 3
    f.write_text(json.dumps({"exp": "my-run", "train": {"steps": 3}}))
    cfg = load_train_config(f)
    assert cfg.exp == "my-run" and cfg.model.dim is None  # a label: the file starts from the defaults


def test_underscore_keys_are_metadata_and_run_folders_read_config_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    d = experiments.get("debug").to_dict()
    d["_run"] = {"started": "2026-01-01", "mxtrain": "0.1.0"}
    (run / "config.json").write_text(json.dumps(d))
    cfg = load_train_config(run)  # a run folder: its config.json
    del d["_run"]
    assert cfg.to_dict() == d and cfg.exp == "debug"


def test_print_config_roundtrips(tmp_path):
    # (this and the other run_main calls: mxtrain.cli.core.main in this process, as run_cli runs it in a subprocess; the
    # subprocess path stays in the tests of the command listing, a rerun of a run and a bad study file)
    p = run_main("train", "--exp", "debug", "--steps", "9", "--set", "recipe.wgrad_dy.rounding=stochastic", "--print-config")
    assert p.returncode == 0, p.stderr
    (tmp_path / "c.json").write_text(p.stdout)
    assert _cfg("--config", str(tmp_path / "c.json")).to_dict() == json.loads(p.stdout)
    assert json.loads(p.stdout)["train"]["steps"] == 9


def test_exp_with_a_file_path_acts_as_config(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"exp": "debug", "train": {"steps": 4}}))
    assert _cfg("--exp", str(f)).to_dict() == _cfg("--config", str(f)).to_dict()
    assert _cfg("--exp", str(f)).train.steps == 4


# -- bad files: one line naming the file, the key and the nearest valid ones --------------------------------

BAD_FILES = [
    ("typo.toml", "[train]\nlr = 1e-3\n", ["typo.toml", "unknown key 'train.lr'", "did you mean optim.lr"]),
    ("section.toml", "[optimizer]\nlr = 1e-3\n", ["unknown key 'optimizer'", "did you mean optim"]),
    ("alias.json", '{"max_steps": 10}', ["unknown key 'max_steps'", "did you mean train.steps"]),
    ("field.yaml", "model:\n  n_layer: 2\n", ["unknown key 'model.n_layer'", "did you mean model.n_layers"]),
    ("type.json", '{"optim": {"lr": "fast"}}', ["type.json", "optim.lr", "expected a number"]),
    ("int.toml", "[train]\nsteps = 2.5\n", ["train.steps", "expected an integer"]),
    ("bool.yaml", "train:\n  compile: off\n", ["train.compile", "expected a string", "quote the value"]),
    ("notable.toml", 'model = "tiny"\n', ["model is a section"]),
    ("syntax.toml", "[train\nsteps = 1\n", ["syntax.toml", "not valid TOML", "line 1"]),
    ("syntax.json", '{"train": {"steps": 1,}}', ["syntax.json", "not valid JSON at line 1"]),
    ("syntax.yaml", "train: [steps\n", ["syntax.yaml", "not valid YAML"]),
    ("list.yaml", "- a\n- b\n", ["must hold a table of keys"]),
    ("suffix.ini", "[train]\n", ["unknown config file type '.ini'"]),
    ("recipe.toml", 'recipe = "mxfp3"\n', ["recipe.toml", "unknown recipe 'mxfp3'"]),
    ("partial_recipe.toml", '[recipe.wgrad_dy]\nrounding = "stochastic"\n', ["recipe_overrides"]),
    ("override.toml", '[recipe_overrides]\n"wgrad_dy.speed" = 1\n', ["unknown recipe field"]),
    ("study.toml", '[study]\narms = ["bf16"]\n', ["study config", "mxtrain study --config"]),
    ("twice.json", '{"optim.lr": 0.1, "optim": {"lr": 0.2}}', ["optim.lr is given twice"]),
    ("range.toml", "[optim]\nbeta2 = 1.5\n", ["optim.beta2 must be in [0, 1)"]),
]


@pytest.mark.parametrize("name,text,fragments", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_config_file_is_one_line(tmp_path, name, text, fragments):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(UserError) as e:
        cfg = _cfg("--config", str(f))
        validate(cfg)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for frag in fragments:
        assert frag in msg, msg


def _one_line(capsys, *argv) -> str:
    """``mxtrain ARGV`` in this process failed as promised: status 2, one ``mxtrain: error:`` line."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("mxtrain: error: "), err
    return err[0]


def test_bad_config_file_through_the_cli(tmp_path, capsys):
    f = tmp_path / "typo.toml"
    f.write_text("[train]\nlr = 1e-3\n")
    one_line_error(run_main("train", "--config", str(f)), "typo.toml", "unknown key 'train.lr'", "did you mean optim.lr")
    assert "config file not found" in _one_line(capsys, "train", "--config", str(tmp_path / "missing.toml"))
    assert "config file not found: missing.json" in _one_line(capsys, "train", "--exp", "missing.json")
    msg = _one_line(capsys, "train", "--exp", "debgu")
    assert "unknown experiment 'debgu'" in msg and "did you mean debug" in msg and "--config" in msg
    msg = _one_line(capsys, "train", "--config", str(f), "--resume", str(tmp_path))
    assert "--config cannot be combined with --resume" in msg
    msg = _one_line(capsys, "train", "--set", "train.lr=1")
    assert "unknown field 'lr'" in msg and "did you mean optim.lr" in msg


def test_yaml_without_pyyaml_says_how_to_install(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 3\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml -> ModuleNotFoundError
    with pytest.raises(UserError, match="pip install pyyaml"):
        read_config_file(f)


def test_toml_on_python_310_without_tomli_says_how_to_install(tmp_path, monkeypatch):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 3\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(UserError, match="pip install tomli"):
        read_config_file(f)


# -- re-running a run from its folder ------------------------------------------------------------------------

def _losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r and "val_loss" not in r]


def test_config_json_of_a_run_reruns_it_exactly(tmp_path):
    first = tmp_path / "first"
    cfg = tiny_run_cfg(first, steps=3)
    cfg.recipe_overrides = {"wgrad_dy.rounding": "stochastic"}  # a changed recipe must travel too
    cfg.optim.lr = 4e-3
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    p = run_cli("train", "--config", str(tmp_path / "cfg.json"))
    assert p.returncode == 0, p.stderr
    # the run folder's config.json, as is, into another folder
    p = run_cli("train", "--config", str(first / "config.json"), "--out", str(tmp_path / "again"))
    assert p.returncode == 0, p.stderr
    a, b = _losses(first), _losses(tmp_path / "again")
    assert [s for s, _ in a] == [1, 2, 3]
    assert a == b  # bit-identical losses on CPU
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (first, tmp_path / "again"))
    assert ca.pop("log")["out"] == str(first) and cb.pop("log")["out"] == str(tmp_path / "again")
    assert ca == cb
    # the run folder itself works as --config; without --out it names the old folder, which is refused
    one_line_error(run_cli("train", "--config", str(first)), "already holds a run")


# -- train.init_from -----------------------------------------------------------------------------------------

def test_init_from_flag_sets_the_field_and_checks_the_folder(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        _cfg("--init-from", str(hf))
    (hf / "config.json").write_text("{}")
    assert _cfg("--init-from", str(hf)).train.init_from == str(hf)
    assert TrainConfig().train.init_from is None
    f = tmp_path / "f.toml"
    f.write_text(f'[train]\ninit_from = "{tmp_path / "nope"}"\n')
    with pytest.raises(UserError, match="not found"):
        _cfg("--config", str(f))
    check_init_from(None)
    one_line_error(run_main("train", "--init-from", str(tmp_path / "nope")), "train.init_from", "not found")


# -- study --config ------------------------------------------------------------------------------------------

def _write(tmp_path, text, name="s.toml"):
    f = tmp_path / name
    f.write_text(text)
    return str(f)


def test_study_file_flags_win_and_set_comes_last(tmp_path):
    from mxtrain.cli.study import apply_study_file
    from mxtrain.study.plan import StudySpec, build_config as run_config
    f = _write(tmp_path, '[study]\narms = ["bf16", "mxfp4-all"]\nseeds = 2\nout = "x"\njobs = 2\n'
                         '[train]\nsteps = 16\nbatch_size = 8\n[optim]\nlr = 5e-3\n'
                         '[recipe_overrides]\n"wgrad_dy.rounding" = "stochastic"\n')
    args = _study_args("--config", f, "--seeds", "3", "--steps", "4", "--set", "optim.lr=1e-3")
    apply_study_file(args, f)
    spec = StudySpec.from_args(args)
    assert spec.arms == ["bf16", "mxfp4-all"] and spec.seeds == 3 and spec.out == "x" and args.jobs == 2
    cfg = run_config(spec, "mxfp4-all", 1, tmp_path / "r")
    assert cfg.train.steps == 4 and cfg.train.batch_size == 8 and cfg.optim.lr == 1e-3
    assert cfg.recipe_overrides["wgrad_dy.rounding"] == "stochastic" and cfg.recipe_overrides["seed"] == 1
    assert cfg.schedule.kind == "constant"  # the study's default schedule ...
    f2 = _write(tmp_path, '[study]\narms = ["bf16"]\n[schedule]\nkind = "wsd"\n', "s2.toml")
    args = _study_args("--config", f2)
    apply_study_file(args, f2)
    assert run_config(StudySpec.from_args(args), "bf16", 0, tmp_path / "r").schedule.kind == "wsd"  # ... or the file's


def test_study_settings_given_beat_the_preset(tmp_path):
    """Issue #47, 5: the smoke preset's own overrides (optim.lr=5e-3, model.dim=64, ...) came after the flags and
    replaced --lr and --model; its steps replaced a train.tokens given, its eval_every a log.eval_every given."""
    from mxtrain.study.plan import StudySpec, build_config as run_config

    def cfg(*argv):
        return run_config(StudySpec.from_args(_study_args("--preset", "smoke", *argv)), "bf16", 0, tmp_path / "r")

    assert cfg("--lr", "1e-3").optim.lr == 1e-3 and cfg().optim.lr == 5e-3
    c = cfg("--model", "30m")
    assert (c.model.name, c.model.dim, c.model.n_layers) == ("30m", None, None) and cfg().model.dim == 64
    c = cfg("--set", "model.name=30m")
    assert (c.model.name, c.model.dim) == ("30m", None)
    c = cfg("--set", "train.tokens=4096")
    assert (c.train.tokens, c.log.eval_every) == (4096, 2)
    assert cfg("--set", "log.eval_every=5").log.eval_every == 5
    assert cfg("--eval-every", "3", "--set", "log.eval_every=5").log.eval_every == 5   # --set comes last
    assert cfg("--set", "schedule.kind=wsd").schedule.kind == "wsd"
    assert cfg("--set", "log.tensorboard=false").log.tensorboard is False


STUDY_REFUSED = [   # a setting a study replaces for each run, or one that contradicts another: refused, not dropped
    (["--set", "data.seed=3"], "--set data.seed=3: data.seed is set by the study for each run (seeds are 0..seeds-1)"),
    (["--set", "train.seed=3"], "train.seed is set by the study for each run"),
    (["--set", "model.init_seed=3"], "model.init_seed is set by the study for each run"),
    (["--set", "recipe=bf16"], "recipe is set by the study for each run (the recipe is the arm"),
    (["--set", "log.out=x"], "log.out is set by the study for each run (runs go to OUT/runs/<arm>/seed<k>"),
    (["--set", "log.progress=true"], "log.progress is set by the study for each run"),
    (["--set", "deosc.enable=true"], "deosc.enable is set by the study for each run"),
    (["--steps", "4", "--set", "train.tokens=4096"],
     "steps 4 (--steps or [study] steps) and train.tokens=4096 (--set or the study file) both set the length of "
     "every run; give one"),
    (["--schedule", "constant", "--set", "schedule.kind=wsd"],
     "schedule.kind=wsd (--set or the study file) and --schedule constant both set every run's schedule"),
    (["--schedule", "long-cosine", "--set", "schedule.horizon_steps=50"],
     "--schedule long-cosine sets the horizon to --lr-horizon x the run's steps"),
    (["--budgets", "0.5,1", "--set", "train.keep_checkpoints_at=3"],
     "with --budgets every run is constant-LR with checkpoints at the branch points"),
    (["--lr-horizon", "5"], "--lr-horizon 5 is the horizon of --schedule long-cosine; add --schedule long-cosine"),
    (["--cooldown", "0.3"], "--cooldown is an option of a cooldown study: add --budgets"),
    (["--fit", "huber"], "--fit is an option of a cooldown study"),
    (["--n-boot", "50"], "--n-boot is an option of a cooldown study"),
]


@pytest.mark.parametrize("argv,msg", STUDY_REFUSED, ids=[" ".join(a) for a, _ in STUDY_REFUSED])
def test_study_refuses_settings_it_would_replace(tmp_path, capsys, argv, msg):
    line = _one_line(capsys, "study", "--preset", "smoke", *argv, "--out", str(tmp_path / "st"), "--dry-run")
    assert msg in line, line
    assert not (tmp_path / "st").exists()


def test_train_steps_given_take_effect_or_are_refused(tmp_path, capsys):
    """Issue #47, 5: --steps 2 --tokens 4096 printed 2 steps and trained 4 (tokens won, silently)."""
    line = _one_line(capsys, "train", "--exp", "debug", "--steps", "2", "--tokens", "4096", "--print-config")
    assert "--steps 2 and --tokens 4096 both set the run's length; give one of them" in line
    assert "--set train.steps=2 and --tokens 4096" in _one_line(
        capsys, "train", "--exp", "debug", "--set", "train.steps=2", "--tokens", "4096", "--print-config")
    f = _write(tmp_path, "exp = \"debug\"\n[train]\ntokens = 4096\n", "t.toml")
    c = _cfg("--config", f, "--steps", "2")   # the flag beats the file's length in tokens
    assert (c.train.steps, c.train.tokens) == (2, None)
    assert _cfg("--config", f).train.tokens == 4096


def test_study_dry_run_from_the_example():
    p = run_main("study", "--config", str(ROOT / "examples" / "study.toml"), "--seeds", "3", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "arms (3): bf16, mxfp4-all, mxfp4-all-dh16" in p.stdout and "9 runs" in p.stdout
    assert "model.n_layers=1" in p.stdout


BAD_STUDY = [
    ('[study]\narm = ["bf16"]\n', ["unknown key 'study.arm'", "did you mean study.arms"]),
    ('[study]\narms = "bf16,nope"\n', ["unknown recipe 'nope'"]),
    ('[study]\nseeds = "two"\n', ["study.seeds", "expected an integer"]),
    ('recipe = "bf16"\n[study]\narms = ["bf16"]\n', ["recipe is set by the study", "arms"]),
    ('[study]\narms = ["bf16"]\n[train]\nseed = 3\n', ["train.seed is set by the study"]),
    ('[study]\narms = ["bf16"]\n[train]\nstep = 3\n', ["unknown key 'train.step'", "did you mean train.steps"]),
    ('exp = "nope"\n[study]\narms = ["bf16"]\n', ["exp 'nope' is not an experiment"]),
    ('[study]\narms = ["bf16"]\n[optim]\nlr = -1\n', ["optim.lr must be in (0, inf)"]),
    ('[study]\narms = ["bf16"]\n[train]\ninit_from = "no/such/folder"\n', ["train.init_from", "not found"]),
]


@pytest.mark.parametrize("text,fragments", BAD_STUDY, ids=[b[1][0] for b in BAD_STUDY])
def test_bad_study_file_is_one_line(tmp_path, capsys, text, fragments):
    msg = _one_line(capsys, "study", "--config", _write(tmp_path, text), "--out", str(tmp_path / "st"), "--dry-run")
    for frag in fragments:
        assert frag in msg, msg
    assert not (tmp_path / "st").exists()


def test_bad_study_file_through_the_cli(tmp_path):
    p = run_cli("study", "--config", _write(tmp_path, '[study]\narm = ["bf16"]\n'), "--out", str(tmp_path / "st"))
    one_line_error(p, "unknown key 'study.arm'", "did you mean study.arms")
    assert not (tmp_path / "st").exists()


# -- the command listing -------------------------------------------------------------------------------------

ALL_COMMANDS = ["data", "train", "study", "report", "bench", "export", "generate", "eval"]


def test_mxtrain_alone_lists_every_command():
    p = run_cli()
    assert p.returncode == 2 and "Traceback" not in p.stderr
    for cmd in ALL_COMMANDS:
        assert any(line.split()[:1] == [cmd] and len(line.split()) > 1 for line in p.stdout.splitlines()), (cmd, p.stdout)
    help_ = run_main("--help")
    assert help_.returncode == 0 and all(f"    {c} " in help_.stdout for c in ALL_COMMANDS)


def test_unknown_command_lists_every_command(capsys):
    p = run_main("foo")
    one_line_error(p, "unknown command 'foo'", *ALL_COMMANDS)
    assert p.returncode == 2
    assert "did you mean train?" in _one_line(capsys, "trian")


# -- data prepare --eot-token --------------------------------------------------------------------------------

def test_eot_token_is_passed_to_prepare(monkeypatch, tmp_path, capsys):
    import mxtrain.data as data
    seen = {}

    def fake(sources, out, *, tokenizer=None, vocab_size=4096, val_fraction=0.01, text_field="text", force=False,
             progress=True, eot_token=None):
        seen.update(sources=sources, eot_token=eot_token)
        return Path(out)

    monkeypatch.setattr(data, "prepare", fake)
    assert main(["data", "prepare", "a.txt", "--out", str(tmp_path), "--eot-token", "</s>"]) == 0
    assert seen == {"sources": ["a.txt"], "eot_token": "</s>"}
    assert main(["data", "prepare", "a.txt", "--out", str(tmp_path)]) == 0
    assert seen["eot_token"] is None

    def old(sources, out, *, tokenizer=None, vocab_size=4096, val_fraction=0.01, text_field="text", force=False,
            progress=True):
        return Path(out)

    monkeypatch.setattr(data, "prepare", old)
    assert main(["data", "prepare", "a.txt", "--out", str(tmp_path)]) == 0  # not given: not passed
    assert main(["data", "prepare", "a.txt", "--out", str(tmp_path), "--eot-token", "</s>"]) == 2
    assert "--eot-token" in capsys.readouterr().err


def test_apply_dict_changes_only_the_given_keys():
    cfg = experiments.get("debug")
    before = cfg.to_dict()
    apply_dict(cfg, {"optim": {"lr": 1e-4}, "_comment": "ignored"})
    after = cfg.to_dict()
    assert after["optim"].pop("lr") == 1e-4
    before["optim"].pop("lr")
    assert after == before
    apply_dict(cfg, {"recipe_overrides.wgrad_dy.rounding": "stochastic", "model.n_layers": 3})
    assert cfg.recipe_overrides == {"wgrad_dy.rounding": "stochastic"} and cfg.model.n_layers == 3
    assert cfg.resolved_recipe().wgrad_dy.rounding == "stochastic"


def test_arm_learning_rate_option(tmp_path):
    """``RECIPE@lrVALUE`` sets that arm's peak learning rate over the study's ``--lr`` and ``--set``; the other
    arms keep the study's; bad values are refused with the option's spelling."""
    from mxtrain.errors import UserError
    from mxtrain.study import arms as A
    from mxtrain.study.plan import StudySpec, build_config as run_config
    spec = StudySpec(out=str(tmp_path / "s"), arms=["bf16", "bf16@lr1.5e-3", "mxfp4-all@lr0.002@deosc"], lr=3e-3,
                     overrides=["optim.lr=4e-3"], steps=8)
    assert run_config(spec, "bf16", 0, tmp_path / "a").optim.lr == 4e-3
    cfg = run_config(spec, "bf16@lr1.5e-3", 0, tmp_path / "b")
    assert cfg.optim.lr == 1.5e-3 and cfg.recipe == "bf16"
    cfg = run_config(spec, "mxfp4-all@lr0.002@deosc", 1, tmp_path / "c")
    assert cfg.optim.lr == 0.002 and cfg.deosc.enable and cfg.recipe == "mxfp4-all"
    assert A.describe_options("mxfp4-all@lr0.002@deosc").startswith("learning rate 0.002; weight de-osc")
    assert A.stable_base("bf16@lr1.5e-3") is None          # its stable run is its own
    for bad, msg in [("bf16@lr0", "positive number"), ("bf16@lr-1e-3", "positive number"),
                     ("bf16@lrx", "positive number"), ("bf16@lr1e-3@lr2e-3", "two learning rates")]:
        with pytest.raises(UserError, match=msg):
            A.check(bad)
