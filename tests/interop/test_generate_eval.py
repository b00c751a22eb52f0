"""Generation and held-out evaluation of a run (mxtrain.interop.generate, and the generate / eval commands): sampling
is reproducible, greedy decoding picks what transformers picks on the exported model, evaluation over a
prepared folder gives the trainer's own validation loss, over text files the loss of the windows training
would form."""

import argparse
import json
import math

import pytest
import torch

from mxtrain.cli import hf as hfcli
from mxtrain.errors import UserError
from mxtrain.interop.generate import evaluate, generate, generate_ids, load
from mxtrain.linear.module import MXLinear

from train_helpers import SENTENCES, ROOT, one_line_error, run_cli, small_data, tiny_run_cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mxtrain.train import train
    return train(tiny_run_cfg(tmp_path_factory.mktemp("gen") / "run", 2))


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="mxtrain")
    sub = parser.add_subparsers(dest="cmd")
    hfcli.add_parsers(sub)
    return parser.parse_args(list(argv))


def _text(path, n_paras=12, seed=1):
    import random
    rnd = random.Random(seed)
    path.write_text("\n\n".join(" ".join(rnd.choice(SENTENCES) for _ in range(6)) for _ in range(n_paras)))
    return path


def test_generate_is_reproducible_and_greedy_matches_transformers(run, tmp_path):
    ld = load(run, precision="fp32", device="cpu")
    tok = ld.tokenizer
    a = generate(ld.model, tok, "The quick brown", 12, temperature=1.0, top_k=20, seed=7, vocab_limit=ld.vocab_limit)
    b = generate(ld.model, tok, "The quick brown", 12, temperature=1.0, top_k=20, seed=7, vocab_limit=ld.vocab_limit)
    assert isinstance(a, str) and a == b
    ids = [tok.eot_id] + tok.encode_batch(["The quick brown"])[0]
    # sampled ids stay below the tokenizer's vocab (the MX padding rows are never picked), top-k 1 is greedy
    sampled = generate_ids(ld.model, ids, 16, temperature=5.0, top_k=0, seed=1, vocab_limit=ld.vocab_limit)
    assert sampled and max(sampled) < ld.vocab_limit <= ld.model.cfg.vocab_size
    greedy = generate_ids(ld.model, ids, 10, temperature=0)
    assert generate_ids(ld.model, ids, 10, temperature=3.0, top_k=1, seed=5) == greedy

    transformers = pytest.importorskip("transformers")
    from mxtrain.interop.export import export_hf
    out = export_hf(run, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=tok.eot_id)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), generation_config=gc)[0, len(ids):].tolist()
    assert theirs == greedy


def test_generate_runs_the_recipe_and_the_command_prints_the_text(run, capsys):
    ld = load(run, device="cpu")                                   # the run's recipe: mxfp4-all
    assert ld.precision == "mx" and any(isinstance(m, MXLinear) for m in ld.model.modules())
    assert isinstance(generate(ld.model, ld.tokenizer, "All that", 5, seed=0, vocab_limit=ld.vocab_limit), str)
    hp = load(run, precision="bf16", device="cpu")
    assert hp.amp_dtype == torch.bfloat16 and not any(isinstance(m, MXLinear) for m in hp.model.modules())

    args = _parse("generate", str(run), "--prompt", "To be or", "--max-tokens", "6", "--seed", "3")
    assert args.func(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("To be or")
    assert args.func(args) == 0 and capsys.readouterr().out == first   # same seed, same text
    args = _parse("generate", str(run), "--prompt", "To be or", "--max-tokens", "4", "--bf16", "--temperature", "0")
    assert args.func(args) == 0
    with pytest.raises(UserError, match="temperature"):
        generate(ld.model, ld.tokenizer, "x", 3, temperature=-1.0)
    with pytest.raises(UserError, match="top-k"):
        generate(ld.model, ld.tokenizer, "x", 3, top_k=-2)
    with pytest.raises(UserError, match="holds the checkpoint of step 2"):
        load(run, step=1)


def test_eval_of_the_prepared_folder_is_the_trainers_validation_loss(run):
    summary = json.loads((run / "summary.json").read_text())
    res = evaluate(run, small_data(), max_tokens=256, device="cpu", progress=False)   # the run's log.eval_tokens
    assert res["kind"] == "prepared" and res["windows"] == 256 // 32 and res["tokens"] == 256
    assert res["precision"] == "mx" and res["recipe"] == "mxfp4-all"
    assert abs(res["loss"] - summary["final_val_loss"]) < 1e-5
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]))


def test_eval_of_text_files_uses_the_training_windows(run, tmp_path):
    f = _text(tmp_path / "held_out.txt")
    res = evaluate(run, f, precision="fp32", device="cpu", progress=False)
    # the same loss computed by hand: documents + end-of-text, windows of seq_len + 1 at stride seq_len
    ld = load(run, precision="fp32", device="cpu")
    from mxtrain.data.sources import documents
    ids = []
    for _, text in documents([str(f)]):
        ids += ld.tokenizer.encode_batch([text])[0] + [ld.tokenizer.eot_id]
    T = 32
    n = (len(ids) - 1) // T
    win = torch.tensor([ids[i * T:i * T + T + 1] for i in range(n)])
    with torch.no_grad():
        want = ld.model(win[:, :-1], win[:, 1:]).item()
    assert res["kind"] == "text" and res["windows"] == n and res["tokens"] == n * T and res["documents"] == 1
    assert res["loss"] == pytest.approx(want, abs=1e-5)
    # a folder of text files: every file, in order
    d = tmp_path / "texts"
    d.mkdir()
    _text(d / "a.txt", seed=2)
    _text(d / "b.txt", seed=3)
    both = evaluate(run, d, precision="fp32", device="cpu", progress=False, max_tokens=5 * T)
    assert both["documents"] == 2 and both["windows"] == 5


def test_eval_refuses_data_it_cannot_measure(run, tmp_path):
    with pytest.raises(UserError, match="not found"):
        evaluate(run, tmp_path / "nope.txt", device="cpu")
    short = tmp_path / "short.txt"
    short.write_text("All that glitters.")
    with pytest.raises(UserError, match="fewer than one window of 33"):
        evaluate(run, short, device="cpu")
    # a prepared folder made with another tokenizer is refused; one made with the run's tokenizer is not
    from mxtrain.data import prepare
    src = _text(tmp_path / "other.txt", n_paras=150, seed=4)
    src.write_text(src.read_text().upper())            # another text: another BPE
    other = prepare([str(src)], tmp_path / "other", vocab_size=512, progress=False)
    with pytest.raises(UserError, match="another tokenizer than the run's|not the run's tokenizer"):
        evaluate(run, other, device="cpu")
    ours = json.loads((small_data() / "meta.json").read_text())["tokenizer"]
    same = prepare([str(src)], tmp_path / "same", tokenizer=str(small_data() / ours), progress=False)
    assert evaluate(run, same, device="cpu", progress=False)["kind"] == "prepared"


def test_eval_command_writes_json_and_progress_lines(run, tmp_path, capsys):
    f = _text(tmp_path / "held_out.txt")
    out = tmp_path / "eval.json"
    args = _parse("eval", str(run), "--data", str(f), "--json", str(out), "--batch-size", "2")
    assert args.func(args) == 0
    cap = capsys.readouterr()
    res = json.loads(out.read_text())
    assert {"loss", "perplexity", "windows", "tokens", "seq_len", "step", "precision"} <= set(res)
    assert f"loss {res['loss']:.4f}" in cap.out
    assert f"eval: {res['windows']}/{res['windows']} windows" in cap.err     # stderr is not a terminal here
    args = _parse("eval", str(run), "--data", str(f), "--json", "-", "--no-progress", "--fp32")
    assert args.func(args) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["precision"] == "fp32" and cap.err == ""


def test_generate_and_eval_commands_fail_in_one_line(run, tmp_path):
    one_line_error(run_cli("eval", str(run), "--data", str(tmp_path / "nope.txt")), "not found")
    one_line_error(run_cli("generate", str(run), "--prompt", "x", "--temperature", "-1"), "temperature")
    one_line_error(run_cli("generate", str(tmp_path), "--prompt", "x"), "holds no checkpoint")
    p = run_cli("generate", str(run), "--prompt", "All that", "--max-tokens", "3", "--temperature", "0")
    assert p.returncode == 0 and p.stdout.startswith("All that"), p.stderr
