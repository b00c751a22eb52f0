"""The ``mxtrain`` command line: ``data prepare``, ``train``, and the subcommands of other modules
(``bench`` from ``mxtrain.bench``; ``study`` and ``report`` from ``mxtrain.study.cli``), which are
imported only when asked for and simply absent while their module does not exist.

Every bad input prints one line ``mxtrain: error: ...`` to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UserError

# subcommand -> module exposing register(subparsers)
EXTERNAL = {"bench": "mxtrain.bench", "study": "mxtrain.study.cli", "report": "mxtrain.study.cli"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise UserError(f"{self.prog.split(' ', 1)[-1] + ': ' if ' ' in self.prog else ''}{message}")


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="prepare tokenized data")
    dsub = p.add_subparsers(dest="data_cmd", metavar="{prepare}")
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
    q.add_argument("--text-field", default="text", help="JSON/Parquet field holding the text (default: text)")
    q.add_argument("--force", action="store_true", help="overwrite an existing output folder")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args) -> int:
    from .data import default_builtin_dir, prepare
    out = args.out
    if out is None:
        out = default_builtin_dir(args.vocab_size) if args.sources == ["builtin"] and not args.tokenizer else "data/prepared"
    path = prepare(args.sources, out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   val_fraction=args.val_fraction, text_field=args.text_field, force=args.force,
                   progress=not args.no_progress)
    print(f"data folder: {path}")
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="pretrain a model (no arguments: the tiny-main experiment)",
                       description="Train a Llama-style model with a quantization recipe. Flags override the "
                                   "experiment config (--exp, default tiny-main); --set reaches every field.")
    a = p.add_argument
    a("--exp", help="named experiment config (see --list); default tiny-main")
    a("--model", help="model size: tiny, 30m, 125m, 350m, 1b, llama3-8b")
    a("--recipe", help="quantization recipe (mxtrain.recipes.names())")
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
    a("--nproc", type=int, help="processes (GPUs) on this machine: re-runs this command under "
                                "torchrun --nproc-per-node N (docs/distributed.md)")
    a("--parallel", choices=["auto", "none", "ddp", "fsdp2"], help="multi-process mode (parallel.mode; default auto: ddp)")
    a("--resume", nargs="?", const=True, default=None, metavar="RUN",
      help="continue from a run folder or checkpoint file (no value: the --out folder)")
    a("--set", action="append", default=[], metavar="KEY=VALUE",
      help="override any config field, e.g. --set optim.weight_decay=0 --set recipe.wgrad_dy.rounding=stochastic")
    a("--cuda-graphs", action="store_true", help="replay each micro-step from a CUDA graph (train.cuda_graphs: one GPU; "
                                                 "stochastic rounding and per-step signs on the fast path only)")
    a("--no-progress", action="store_true", help="no progress bar (plain log lines)")
    a("--list", action="store_true", help="list experiments, models and recipes, then exit")
    p.set_defaults(func=_cmd_train)


_FLAG_KEYS = {"model": "model.name", "recipe": "recipe", "data": "data.path", "steps": "train.steps",
              "tokens": "train.tokens", "batch_size": "train.batch_size", "micro_batch_size": "train.micro_batch_size",
              "seq_len": "data.seq_len", "lr": "optim.lr", "out": "log.out", "seed": "train.seed",
              "init_seed": "model.init_seed", "data_seed": "data.seed", "eval_every": "log.eval_every",
              "eval_tokens": "log.eval_tokens", "device": "train.device", "parallel": "parallel.mode"}


def build_config(args):
    """Experiment (or the resumed run's config) + flags + --set overrides -> TrainConfig."""
    import json

    from .train import TrainConfig, apply_overrides, experiments
    from .train import checkpoint as ckpt
    if args.resume is not None:
        src = args.out if args.resume is True else args.resume
        if src is None:
            raise UserError("--resume needs a run folder (--resume RUN, or --resume with --out RUN)")
        from .distributed import find_dcp  # [distributed] a multi-process run's checkpoint.dcp folder
        path = find_dcp(src) or ckpt.find(src)
        cfg_file = path.parent / "config.json"
        try:
            cfg = TrainConfig.from_dict(json.loads(cfg_file.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {cfg_file} to resume ({e})") from None
        if args.exp:
            raise UserError("--exp cannot be combined with --resume (the run's own config is used)")
        # the run continues where its checkpoint is (a copied or moved run stays in its new place), unless
        # --out names another folder (applied below with the other flags)
        cfg.log.out = str(path.parent.resolve())
        args.resume = str(path)
    else:
        cfg = experiments.get(args.exp or experiments.DEFAULT)
    items = [f"{_FLAG_KEYS[k]}={v}" for k, v in vars(args).items() if k in _FLAG_KEYS and v is not None]
    if args.no_progress:
        items.append("log.progress=false")
    if getattr(args, "cuda_graphs", False):
        items.append("train.cuda_graphs=true")
    apply_overrides(cfg, items + list(args.set))
    if args.model is not None:
        from .model import ModelConfig
        ModelConfig.named(args.model)  # unknown name -> clear error now
    cfg.resolved_recipe()
    return cfg


def _cmd_train(args) -> int:
    if args.list:
        from . import recipes
        from .model import size_names
        from .train import experiments
        print("experiments:", ", ".join(experiments.names()))
        print("models:     ", ", ".join(size_names()))
        print("recipes:    ", ", ".join(recipes.names()))
        return 0
    import os
    if args.nproc is not None and args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # [distributed] --nproc N
        from .distributed import launch, strip_nproc
        return launch(args.nproc, strip_nproc(list(getattr(args, "argv", None) or sys.argv[1:]))[1])
    from .train import train
    cfg = build_config(args)
    out = train(cfg, resume=args.resume)
    if int(os.environ.get("RANK", "0")) != 0:  # [distributed] rank 0 reports
        return 0
    import json
    s = json.loads((out / "summary.json").read_text())
    if s.get("final_val_loss") is not None:
        print(f"final validation loss {s['final_val_loss']:.4f} (perplexity {s['final_val_ppl']:.2f}) after "
              f"{s['tokens']:,} tokens")
    print(f"run folder: {out}")
    return 0


def _wanted_external(argv: list[str]) -> set[str]:
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in EXTERNAL:
        return {first}
    if first is None and any(a in ("-h", "--help") for a in argv):
        return set(EXTERNAL)
    return set()


def make_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="mxtrain", description="Pretrain LLMs with microscaling (MX) numbers.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    _add_data(sub)
    _add_train(sub)
    done = set()
    for cmd in sorted(_wanted_external(argv or [])):
        mod_name = EXTERNAL[cmd]
        if mod_name in done:
            continue
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
                continue  # not written yet: the subcommand is simply absent
            raise
        mod.register(sub)
        done.add(mod_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = make_parser(argv)
        args = parser.parse_args(argv)
        args.argv = argv  # [distributed] for train --nproc N, which re-runs the command under torchrun
        if args.version:
            from . import __version__
            print(f"mxtrain {__version__}")
            return 0
        if not getattr(args, "func", None):
            parser.print_help()
            return 0 if not args.cmd else 2
        return int(args.func(args) or 0)
    except UserError as e:
        msg = " ".join(str(e).split("\n"))
        sys.stderr.write(f"mxtrain: error: {msg}\n")  # one write: ranks of a launch print whole lines
        sys.stderr.flush()
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("mxtrain: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
