"""A way out: Hugging Face folders from mxtrain runs, and the run folder read back as a model.

``export_hf(run_dir, out_dir)`` writes a folder that ``transformers.AutoModelForCausalLM.from_pretrained``
loads offline: ``model.safetensors``, ``config.json`` (a ``LlamaConfig`` with mxtrain's exact shapes, or a
Mistral, Qwen2 or Mixtral config for models of those types: ``mxtrain.model.hf_io``), ``generation_config.json``,
the run's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, when it is a Hugging Face ``tokenizers``
file) and ``mxtrain_export.json`` (where the weights came from). ``load_run(run_dir)`` rebuilds a run's model from
its newest complete checkpoint (``eval``, ``generate`` and the export read it), ``run_tokenizer`` its tokenizer.

The exported weights are the run's float32 master weights. A run trained with an MX recipe computed its
forward pass through MX-quantized GEMMs; in ``transformers`` the model runs in high precision (what
``mxtrain generate --bf16`` / ``mxtrain eval --bf16`` measure), not with the recipe's quantization.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import settings
from .._io import FolderLock, swap_in
from ..errors import UserError
from ..model import Llama, ModelConfig, SIZES
from ..model.hf_io import _expected_names, config_from_hf, hf_config, hf_state_dict, save_safetensors
from ..train.config import shape_overrides, TrainConfig
from ..train.parallel import is_checkpoint
from ..train import checkpoint as ckpt, parallel as D
from ..data import default_builtin_dir
from ..data.loader import bare_name
from ..data.tokenizer import load_tokenizer
from ..data.sources import warn
from .. import __version__

__all__ = ['export_hf', 'load_run', 'run_tokenizer', 'RunCheckpoint']


@dataclass
class RunCheckpoint:
    """What ``load_run`` found in a run folder."""
    run_dir: Path               # the run folder
    path: Path                  # its checkpoint: checkpoint.pt, or the checkpoint.dcp folder
    step: int                   # optimizer steps done
    tokens: int                 # training tokens seen
    config: object              # the run's TrainConfig (from the checkpoint)
    model_config: ModelConfig
    data_dir: Path | None       # the prepared data folder the run trained on, if it is still there

    @property
    def seq_len(self) -> int:
        return int(self.config.data.seq_len)

    @property
    def recipe(self):
        return self.config.resolved_recipe()


def _find_checkpoint(run_dir: Path) -> Path:
    """A checkpoint file or DCP folder, or a run folder's newest checkpoint (``checkpoint.latest``); read only."""
    if not run_dir.exists():
        raise UserError(f"run folder not found: {run_dir}")
    if run_dir.is_file() or is_checkpoint(run_dir):
        return ckpt.find(run_dir)
    path = ckpt.latest(run_dir)
    if path is not None:
        return path
    raise UserError(f"{run_dir} holds no checkpoint (no {ckpt.NAME} and no checkpoint.dcp/): a run writes one at its "
                    f"end and every train.checkpoint_every steps; pass the folder of a run that saved one")


def _model_config(cfg, vocab: int) -> ModelConfig:
    """The run's model shapes, as the trainer builds them (its vocab from the checkpoint's embedding)."""
    m = cfg.model
    if m.name not in SIZES:
        raise UserError(f"the run's model {m.name!r} is not one of mxtrain's Llama sizes ({', '.join(SIZES)}); "
                        f"only Llama models can be exported or loaded")
    over = shape_overrides(m)
    base = SIZES[m.name]
    return ModelConfig.named(m.name, **over, vocab_size=vocab, max_seq_len=max(base.max_seq_len, int(cfg.data.seq_len)))


def _run_model_config(state: dict, cfg, vocab: int, path: Path) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint: the one it records (``state["model_config"]``) if it does; for a
    run started from a Hugging Face folder (``train.init_from``), that folder's (as ``llama_from_hf`` builds
    it); else the named size with the config's overrides, as the trainer builds it."""
    from dataclasses import fields, replace
    mc = state.get("model_config")
    if isinstance(mc, dict):
        names = {f.name for f in fields(ModelConfig)}
        try:
            return ModelConfig(**{k: v for k, v in mc.items() if k in names})
        except TypeError as e:
            raise UserError(f"checkpoint {path}: cannot read its model_config ({e})") from None
    init_from = getattr(cfg.train, "init_from", None)
    if init_from:
        if not (Path(init_from) / "config.json").is_file():
            raise UserError(f"checkpoint {path}: the run started from the Hugging Face folder {init_from}, which is "
                            f"gone, and its checkpoint does not record the model's shapes; put the folder back")
        hc = config_from_hf(init_from, vocab_multiple=32, max_seq_len=int(cfg.data.seq_len))
        return replace(hc, vocab_size=vocab)
    return _model_config(cfg, vocab)


def _data_dir(run_dir: Path, cfg) -> Path | None:
    """The run's prepared data folder: run.json's resolved path, else the config's (built-in: the cache)."""
    cands = []
    try:
        info = json.loads((run_dir / "run.json").read_text())
        if isinstance(info, dict) and isinstance(info.get("data"), str):
            cands.append(Path(info["data"]))
    except (OSError, ValueError):
        pass
    path = getattr(cfg.data, "path", None)
    if path == "builtin":
        cands.append(default_builtin_dir(int(cfg.data.vocab_size)))
    elif isinstance(path, str):
        cands += [Path(path), run_dir / path]
    for c in cands:
        if (c / "meta.json").is_file():
            return c
    return None


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[Llama, RunCheckpoint]:
    """The model of a run folder's checkpoint (``checkpoint.pt`` or a multi-process run's ``checkpoint.dcp``),
    on the CPU in float32, in eval mode and not converted to MX layers; and what the run was.

    The checkpoint is read as the trainer reads it (``weights_only`` for ``checkpoint.pt``, the allow-list
    reader for DCP folders): nothing in the run folder is executed. ``step``: the step the checkpoint must be
    at (a run folder's checkpoint is its latest; kept ones are ``checkpoint-<step>.pt`` files). ``run_dir`` may
    also be a checkpoint file or DCP folder.
    """
    run_dir = Path(run_dir)
    path = _find_checkpoint(run_dir)
    is_dcp = path.is_dir()
    if is_dcp:
        state = D.read_extra(path)
        sd = None
    else:
        state = ckpt.load(path)
        sd = state["model"]
    cfg_dict = state.get("config") if isinstance(state, dict) else None
    if not isinstance(cfg_dict, dict):
        raise UserError(f"checkpoint {path} holds no run config; it was not written by mxtrain train")
    try:
        cfg = TrainConfig.from_dict(cfg_dict)
    except (TypeError, ValueError) as e:
        raise UserError(f"checkpoint {path}: cannot read its config ({e})") from None
    ck_step, tokens = int(state.get("step", 0)), int(state.get("tokens", 0))
    if step is not None and int(step) != ck_step:
        raise UserError(f"{run_dir} holds the checkpoint of step {ck_step}, not of step {step}; leave --step out, "
                        f"pass --step {ck_step}, or name a kept checkpoint file (RUN/checkpoint-<step>.pt, kept with "
                        f"train.keep_checkpoints_at)")
    folder = path.parent
    if is_dcp:
        vocab = _dcp_vocab(path)
    else:
        if not isinstance(sd, dict) or not isinstance(sd.get("embed_tokens.weight"), torch.Tensor):
            raise UserError(f"checkpoint {path} does not hold an mxtrain Llama (no embed_tokens.weight); "
                            f"only Llama models can be exported or loaded")
        vocab = int(sd["embed_tokens.weight"].shape[0])
    mcfg = _run_model_config(state, cfg, vocab, path)
    if sd is not None:
        want = set(_expected_names(mcfg))
        if mcfg.tie_embeddings and "lm_head.weight" not in sd:
            want.discard("lm_head.weight")
        got = set(sd)
        if got != want:
            extra, missing = sorted(got - want), sorted(want - got)
            what = ([f"unexpected {', '.join(extra[:3])}"] if extra else []) + \
                   ([f"missing {', '.join(missing[:3])}"] if missing else [])
            raise UserError(f"checkpoint {path} does not hold an mxtrain Llama of its config's shape "
                            f"({'; '.join(what)})")
    model = Llama(mcfg, device="meta", glue=settings.current().glue).to_empty(device="cpu")
    if mcfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if is_dcp:
        D.load_checkpoint(path, model, None, env=D.get_env())
    else:
        try:
            model.load_state_dict(sd, strict=not mcfg.tie_embeddings)
        except RuntimeError as e:
            why = str(e).splitlines()[-1].strip()[:200]
            raise UserError(f"checkpoint {path} does not fit its config's model ({why})") from None
    model.float().eval()
    return model, RunCheckpoint(run_dir=folder, path=path, step=ck_step, tokens=tokens, config=cfg, model_config=mcfg,
                                data_dir=_data_dir(folder, cfg))


def _dcp_vocab(path: Path) -> int:
    """The embedding's row count in a DCP folder's metadata (read through the allow-list unpickler)."""
    md = D._read_dcp_metadata(path)
    for key, item in getattr(md, "state_dict_metadata", {}).items():
        if key in ("model.embed_tokens.weight", "embed_tokens.weight") and hasattr(item, "size"):
            return int(item.size[0])
    raise UserError(f"checkpoint {path} does not hold an mxtrain Llama (no embed_tokens.weight); only Llama models "
                    f"can be exported or loaded")


def run_tokenizer(run: RunCheckpoint):
    """(tokenizer, None) for the run's tokenizer (``mxtrain.data.Tokenizer``), or (None, why it is not there)."""
    if run.data_dir is None:
        return None, (f"the run's data folder ({run.config.data.path}) is not there any more, and with it its "
                      f"tokenizer")
    try:
        meta = json.loads((run.data_dir / "meta.json").read_text())
        name = meta["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"cannot read {run.data_dir / 'meta.json'} ({e})"
    if not bare_name(name) or not (run.data_dir / name).is_file():
        return None, f"the tokenizer file {name!r} of {run.data_dir} is missing"
    eot_token = meta.get("eot_token") if isinstance(meta.get("eot_token"), str) else None
    tok = load_tokenizer(run.data_dir / name, eot_token=eot_token)
    if isinstance(meta.get("eot_id"), int):
        tok.eot_id = meta["eot_id"]
    return tok, None


_EXPORT_FILES = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "mxtrain_export.json"}


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _warn(msg: str) -> None:
    warn(msg)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is an existing file, not a folder")
    if out.is_dir():
        names = {p.name for p in out.iterdir()}
        if names and not force:
            raise UserError(f"output folder {out} already exists and is not empty (use --force to replace an earlier "
                            f"export)")
        foreign = sorted(names - _EXPORT_FILES)
        if foreign:
            raise UserError(f"output folder {out} holds files an export does not write ({', '.join(foreign[:3])}"
                            f"{' ...' if len(foreign) > 3 else ''}); --force only replaces an earlier export: "
                            f"choose an empty or new --out")


def export_hf(run_dir: str | Path, out_dir: str | Path, step: int | None = None, *, dtype: str = "float32",
              force: bool = False, tokenizer: bool = True) -> Path:
    """Export a run folder's checkpoint as a Hugging Face Llama folder at ``out_dir``; returns it.

    ``step``: the step the checkpoint must be at (a run keeps its latest checkpoint only). ``dtype``:
    ``float32`` (default: the master weights exactly), ``bfloat16`` or ``float16``. ``force``: replace an
    earlier export in ``out_dir`` (a folder holding anything else is refused). ``tokenizer``: copy the run's
    tokenizer when it is a ``tokenizers`` file (else a warning says why it was skipped).

    Refused with a ``UserError``: a folder without a checkpoint, a checkpoint that is not an mxtrain Llama,
    a non-empty ``out_dir``, an ``out_dir`` another export is writing (its lock, ``.NAME.lock`` beside it, is
    taken first: a second export is refused at once, naming the first one's pid). The folder is written under
    a temporary name and renamed at the end.
    """
    if dtype not in _DTYPES:
        raise UserError(f"unknown export dtype {dtype!r}; use float32, bfloat16 or float16")
    out = Path(out_dir)
    made = [d for d in reversed(out.parents) if not d.exists()]   # (removed again if the export fails)
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            lock = FolderLock(out.parent, lambda who: f"output folder {out} is being written by another mxtrain "
                              f"export{f' (pid {who})' if who else ''}; wait for it to finish or choose another --out",
                              name=f".{out.name}.lock", remove=True)
        except OSError as e:
            raise UserError(f"cannot write to {out.parent}: {e.strerror or e}") from None
        with lock:
            return _export(run_dir, out, step, dtype, force, tokenizer)
    except BaseException:
        for d in reversed(made):   # the folders this export made, if still empty
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _export(run_dir, out: Path, step, dtype: str, force: bool, tokenizer: bool) -> Path:
    """``export_hf``'s work, with the output's lock held."""
    tdtype = _DTYPES[dtype]
    dname = str(tdtype).replace("torch.", "")
    _check_out(out, force)
    model, run = load_run(run_dir, step)
    mcfg = model.cfg
    tok, why = (run_tokenizer(run) if tokenizer else (None, "not asked for"))
    eot = tok.eot_id if tok is not None else _eot_from_meta(run)
    try:
        config = hf_config(mcfg, eot, dname)   # (refuses a model no Hugging Face architecture computes, first)
    except UserError as e:
        raise UserError(f"{run_dir}: {e}") from None
    tensors = {k: t.detach().to(tdtype).contiguous() for k, t in hf_state_dict(model.state_dict(), mcfg).items()}

    try:
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"cannot write to {out.parent}: {e.strerror or e}") from None
    try:
        save_safetensors(tmp / "model.safetensors", tensors, {"format": "pt", "mxtrain_step": str(run.step)})
        if eot is None:
            _warn("the run's end-of-text id is unknown (its data folder is gone): config.json has no bos/eos token "
                  "id; set them before generating with transformers")
        _write_json(tmp / "config.json", config)
        gen = {"bos_token_id": eot, "eos_token_id": eot, "do_sample": True, "temperature": 0.8, "top_k": 50}
        _write_json(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
        if tok is not None and tok.kind == "hf":
            tok.save(tmp)
            eot_text = tok.impl.id_to_token(tok.eot_id)
            _write_json(tmp / "tokenizer_config.json", {
                "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eot_text, "eos_token": eot_text,
                "model_max_length": mcfg.max_seq_len, "clean_up_tokenization_spaces": False,
                "add_bos_token": False, "add_eos_token": False})
            _write_json(tmp / "special_tokens_map.json", {"bos_token": eot_text, "eos_token": eot_text})
        elif tokenizer:
            if tok is not None:
                why = (f"the run's tokenizer is a {tok.kind} model ({tok.source}), which transformers cannot load "
                       f"as a tokenizer.json")
            _warn(f"exported the model without a tokenizer: {why}; give transformers the tokenizer yourself")
        _write_json(tmp / "mxtrain_export.json", {
            "mxtrain": __version__, "run": str(run.run_dir.resolve()), "checkpoint": str(run.path.resolve()),
            "step": run.step, "tokens": run.tokens, "recipe": run.config.recipe_name(),
            "dtype": dname, "model": mcfg.to_dict(), "seq_len": run.seq_len,
            "tokenizer": "tokenizer.json" if tok is not None and tok.kind == "hf" else None,
            "note": "float32 master weights of an mxtrain run; transformers runs them in high precision, not "
                    "with the run's MX recipe"})
        _swap_in(tmp, out, force)
    except (OSError, UserError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, UserError) and str(tmp) not in str(e):
            raise   # (_swap_in's own errors say where things stand)
        # a write into the temporary folder failed (a full disk...): name the file as the export would hold it,
        # not the temporary folder, which is gone
        why = str(e) if isinstance(e, UserError) else f"cannot write {out}: {e.strerror or e}"
        kept = "; the earlier export there is intact" if out.exists() else "; nothing was written"
        raise UserError(why.replace(str(tmp), str(out)) + kept) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _eot_from_meta(run: RunCheckpoint) -> int | None:
    if run.data_dir is None:
        return None
    try:
        v = json.loads((run.data_dir / "meta.json").read_text()).get("eot_id")
        return v if isinstance(v, int) else None
    except (OSError, ValueError, AttributeError):
        return None


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _swap_in(tmp: Path, out: Path, force: bool = False) -> None:
    """Move the finished export ``tmp`` to ``out``. Without ``force`` one rename that replaces nothing but an empty
    folder (the kernel refuses it over a folder with files): a folder another command put at ``out`` while this
    export ran is not replaced (``_check_out`` saw none; another export is kept out by the lock from the start)."""
    try:
        if not force:
            try:
                os.rename(tmp, out)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise UserError(f"output folder {out} was written by another command while this export ran; "
                                    f"nothing replaced (use --force to replace an earlier export)") from None
                raise
        elif out.is_dir():
            swap_in(tmp, out, out.parent / f".{out.name}.old-{os.getpid()}")
        else:
            os.rename(tmp, out)
    except OSError as e:
        raise UserError(f"cannot move the export into {out}: {e.strerror or e}") from None
