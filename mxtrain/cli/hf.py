"""The ``export``, ``generate`` and ``eval`` subcommands (``mxtrain.cli.core`` adds them with ``add_parsers``).

    mxtrain export RUN --format hf --out DIR [--step N] [--dtype float32|bfloat16|float16] [--force]
    mxtrain generate RUN --prompt TEXT [--max-tokens N --temperature T --top-k K --seed S --bf16 | --fp32]
    mxtrain eval RUN --data FILE-or-FOLDER [--json OUT] [--max-tokens N --batch-size B --bf16 | --fp32]

Handlers return the exit status; bad input raises ``UserError``, which ``mxtrain.cli.core.main`` prints as one
line ``mxtrain: error: ...`` (exit status 2). ``python -m mxtrain.cli.hf ...`` runs these three commands alone,
with the same error handling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .._io import check_writable, write_text
from ..errors import UserError, number_flag
from .core import check_text_field

__all__ = ["add_parsers", "register", "cmd_export", "cmd_generate", "cmd_eval", "main"]


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _pos_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:   # not the ">= 0" of _nonneg_int: 0 is refused too (#47)
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


MAX_NEW_TOKENS = 1_000_000   # no KV cache: each new token is a forward pass over the context


def _new_tokens(text: str) -> int:
    """generate --max-tokens: 0 .. MAX_NEW_TOKENS (printed at the end: a count of any size ran for ever, #47)."""
    v = _nonneg_int(text)
    if v > MAX_NEW_TOKENS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_NEW_TOKENS:,} new tokens, got {v:,}")
    return v


def _temperature(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0: greedy), got {text}")
    return v


def _precision_flags(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bf16", action="store_true",
                   help="run in high precision: no MX quantization, bf16 autocast (default: the run's recipe)")
    g.add_argument("--fp32", action="store_true", help="run in float32, no MX quantization")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--step", type=_nonneg_int, help="the step the run's checkpoint must be at")


def _precision(args) -> str:
    return "bf16" if args.bf16 else "fp32" if args.fp32 else "mx"


def add_parsers(sub) -> None:
    """Add ``export``, ``generate`` and ``eval`` to an argparse subparsers object (``mxtrain``'s)."""
    p = sub.add_parser("export", help="export a run's checkpoint as a Hugging Face Llama folder (a Mixtral for a "
                                      "mixture of experts)",
                       description="Write a folder transformers.AutoModelForCausalLM.from_pretrained loads offline: "
                                   "model.safetensors, config.json, generation_config.json and the run's tokenizer.")
    p.add_argument("run", metavar="RUN", help="run folder (or its checkpoint)")
    p.add_argument("--format", default="hf", help="output format: hf (Hugging Face transformers; the only one)")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--step", type=_nonneg_int, help="the step the run's checkpoint must be at")
    p.add_argument("--dtype", default="float32",
                   help="weight dtype in model.safetensors: float32 (default: the master weights exactly), bfloat16 "
                        "or float16")
    p.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    p.set_defaults(func=cmd_export)

    g = sub.add_parser("generate", help="sample text from a run's model",
                       description="Continue a prompt with a run's model (by default through its MX recipe, as in "
                                   "training). No KV cache: fine for small models.")
    g.add_argument("run", metavar="RUN", help="run folder (or its checkpoint)")
    g.add_argument("--prompt", required=True, help="text to continue ('' starts a new document)")
    g.add_argument("--max-tokens", type=_new_tokens, default=64, help="new tokens at most (default 64)")
    g.add_argument("--temperature", type=_temperature, default=0.8,
                   help="sampling temperature; 0: greedy (default 0.8)")
    g.add_argument("--top-k", type=_nonneg_int, default=50,
                   help="sample among the K likeliest tokens; 0: all (default 50)")
    g.add_argument("--seed", type=number_flag(lo=0, integer=True), default=0, help="sampling seed (default 0)")
    _precision_flags(g)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="loss and perplexity of a run's model on held-out text",
                       description="Validation loss over windows of the run's seq_len, as training evaluates: a "
                                   "prepared data folder's validation split, or text files tokenized with the run's "
                                   "tokenizer.")
    e.add_argument("run", metavar="RUN", help="run folder (or its checkpoint)")
    e.add_argument("--data", required=True,
                   help="a text/JSONL/Parquet file, a folder of them, a prepared data folder, or 'builtin' (the "
                        "built-in corpus's validation split, as training uses it)")
    e.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT ('-': standard output)")
    e.add_argument("--max-tokens", type=_pos_int, help="evaluate the first N // seq_len windows only")
    e.add_argument("--batch-size", type=_pos_int, help="windows per forward pass (default: the run's micro-batch)")
    e.add_argument("--text-field", default="text", help="JSON/Parquet field holding the text (default: text)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    _precision_flags(e)
    e.set_defaults(func=cmd_eval)


register = add_parsers   # the name mxtrain.cli.core's EXTERNAL modules expose


def cmd_export(args) -> int:
    from ..interop.export import export_hf  # startup
    if args.format != "hf":
        raise UserError(f"export --format {args.format!r} is not supported; the format is hf (a Hugging Face "
                        f"transformers folder)")
    out = export_hf(args.run, args.out, args.step, dtype=args.dtype, force=args.force)
    meta = json.loads((out / "mxtrain_export.json").read_text())
    tok = "with its tokenizer" if meta.get("tokenizer") else "without a tokenizer"
    print(f"exported step {meta['step']} of {meta['run']} ({meta['dtype']}, {tok}) to {out}")
    print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_generate(args) -> int:
    from ..interop.generate import generate, load  # startup
    ld = load(args.run, args.step, _precision(args), args.device)
    text = generate(ld.model, ld.tokenizer, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed,
                    amp_dtype=ld.amp_dtype, vocab_limit=ld.vocab_limit)
    sys.stdout.write(args.prompt + text + "\n")
    sys.stdout.flush()
    return 0


def _json_safe(obj):
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in obj.items()}


def _is_eval_json(p: Path) -> bool:
    """Whether ``p`` holds what ``eval --json`` writes (a JSON object with its loss and perplexity)."""
    try:   # (a regular file of at most 1 MiB: /dev/zero would be read until the memory is full)
        if not p.is_file() or p.stat().st_size > 1 << 20:
            return False
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and {"loss", "perplexity", "windows"} <= d.keys()


def cmd_eval(args) -> int:
    from ..interop.generate import evaluate  # startup
    if Path(args.data).exists() or args.data == "builtin":   # (a missing one: evaluate says so)
        check_text_field(args.text_field, [args.data])
    if args.json and args.json != "-":   # before the evaluation, not after it (#47)
        jp = Path(args.json)
        if jp.is_dir():
            raise UserError(f"--json {args.json} is a folder; give a file name for the results, e.g. {jp / 'eval.json'}")
        if not jp.parent.is_dir():
            raise UserError(f"--json {args.json}: folder {jp.parent} does not exist; create it or give another file")
        if jp.exists() and not _is_eval_json(jp):   # replace an earlier result, never another file (#47)
            raise UserError(f"--json {args.json} exists and is not an earlier result of mxtrain eval; give a new file "
                            "name (or remove that file)")
        check_writable(jp.parent, f"--json {args.json}")   # (a read-only or full folder: now, not after it)
    res = evaluate(args.run, args.data, step=args.step, precision=_precision(args), device=args.device,
                   batch_size=args.batch_size, max_tokens=args.max_tokens, text_field=args.text_field,
                   progress=False if args.no_progress else None)
    text = json.dumps(_json_safe(res), indent=2, allow_nan=False) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        print(f"loss {res['loss']:.4f} | perplexity {res['perplexity']:.2f} | {res['windows']} windows x "
              f"{res['seq_len']} tokens ({res['tokens']:,} tokens) | step {res['step']} | {res['precision']}"
              f"{' (' + res['recipe'] + ')' if res['precision'] == 'mx' else ''}")
        if args.json:   # (whole or not at all: a crash leaves an earlier result as it was)
            write_text(Path(args.json), text)
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block (as mxtrain.cli.core)
        raise UserError(f"{self.prog.split(' ', 1)[-1] + ': ' if ' ' in self.prog else ''}{message}")


def main(argv: list[str] | None = None) -> int:
    """``python -m mxtrain.cli.hf export|generate|eval ...``: these commands alone, errors as one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = _Parser(prog="mxtrain")
        sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
        sub.required = True
        add_parsers(sub)
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except UserError as e:
        sys.stderr.write(f"mxtrain: error: {' '.join(str(e).splitlines())}\n")
        sys.stderr.flush()
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("mxtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
