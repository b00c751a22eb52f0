"""The training loop: ``train(cfg) -> run folder``.

One code path for every device and world size: the loop never assumes a single process (the data
loader takes rank / world size, the global batch is split into micro-batches per rank). The
multi-GPU issue wraps the model (DDP / FSDP2) in ``_wrap_parallel`` and reduces metrics in
``_reduce_mean``; nothing else changes.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import __version__, convert, set_step
from .. import distributed as D  # [distributed] issue 5: DDP / FSDP2 / DCP hooks
from ..data import Loader, TokenData, ensure_builtin, val_batches
from ..errors import UserError
from ..model import Llama, ModelConfig
from . import checkpoint as ckpt
from .config import TrainConfig

# dense bf16 peak TFLOP/s for MFU, matched against torch.cuda.get_device_name()
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
               "A10G": 70.0, "RTX 4090": 165.0, "B200": 2250.0}


class Interrupted(UserError):
    """SIGINT or SIGTERM: the run saved a checkpoint at the end of the step in progress and stopped."""

    def __init__(self, msg: str, signum: int):
        super().__init__(msg)
        self.exit_code = 128 + signum


class _Signals:
    """While a run trains (main thread only): SIGINT and SIGTERM set ``caught`` instead of stopping the
    process, so the loop can checkpoint at the end of the step; a second signal stops at once."""

    def __init__(self):
        import signal
        import threading
        self.caught = None
        self.old = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self.old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.caught is not None:   # a second signal: stop now
            raise KeyboardInterrupt
        self.caught = signum

    def restore(self):
        import signal
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}


class NonFiniteLoss(UserError):
    """The loss became NaN or infinite; the run stopped and its last checkpoint was kept."""
    exit_code = 3


def _world() -> tuple[int, int]:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return rank, world


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device {name!r}; use auto, cpu, cuda or cuda:N")
    return dev


def _autocast_dtype(cfg: TrainConfig, dev: torch.device):
    d = cfg.train.dtype
    if d == "auto":
        return torch.bfloat16 if dev.type == "cuda" else None
    if d == "bf16":
        return torch.bfloat16
    if d == "fp32":
        return None
    raise UserError(f"train.dtype must be auto, bf16 or fp32, got {d!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup, then cosine / WSD / constant over the horizon."""
    s, o = cfg.schedule, cfg.optim
    horizon = s.horizon_steps or cfg.train.steps
    lr_min = o.lr * o.min_lr_ratio
    if s.warmup_steps and step < s.warmup_steps:
        return o.lr * (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return o.lr
    if s.kind == "cosine":
        t = min(1.0, (step - s.warmup_steps) / max(1, horizon - s.warmup_steps))
        return lr_min + 0.5 * (o.lr - lr_min) * (1 + math.cos(math.pi * t))
    if s.kind == "wsd":
        decay_start = horizon - int(round(s.decay_fraction * horizon))
        if step < decay_start:
            return o.lr
        t = min(1.0, (step - decay_start) / max(1, horizon - decay_start))
        return o.lr - (o.lr - lr_min) * t
    raise UserError(f"schedule.kind must be cosine, wsd or constant, got {s.kind!r}")


def _check(cfg: TrainConfig) -> None:
    t, d = cfg.train, cfg.data
    if t.tokens is not None:
        if t.tokens <= 0:
            raise UserError("--tokens must be positive")
        t.steps = math.ceil(t.tokens / (t.batch_size * d.seq_len))
    for name, v in (("train.steps", t.steps), ("train.batch_size", t.batch_size), ("data.seq_len", d.seq_len),
                    ("log.eval_every", cfg.log.eval_every), ("log.eval_tokens", cfg.log.eval_tokens),
                    ("log.log_every", cfg.log.log_every)):
        if v <= 0:
            raise UserError(f"{name} must be positive, got {v}")
    validate(cfg)
    if cfg.schedule.horizon_steps is not None and cfg.schedule.horizon_steps < cfg.train.steps:
        raise UserError(f"schedule.horizon_steps ({cfg.schedule.horizon_steps}) must be >= train.steps ({t.steps})")
    if cfg.schedule.kind not in ("cosine", "wsd", "constant"):
        raise UserError(f"schedule.kind must be cosine, wsd or constant, got {cfg.schedule.kind!r}")
    if cfg.train.compile not in ("auto", "on", "off"):
        raise UserError(f"train.compile must be auto, on or off, got {cfg.train.compile!r}")
    if cfg.parallel.mode not in ("auto",) + D.MODES:  # [distributed]
        raise UserError(f"parallel.mode must be auto, {', '.join(D.MODES)}; got {cfg.parallel.mode!r}")
    if cfg.parallel.param_dtype not in ("auto", "bf16", "fp32"):
        raise UserError(f"parallel.param_dtype must be auto, bf16 or fp32, got {cfg.parallel.param_dtype!r}")


def _num(name: str, v, lo=None, hi=None, lo_open=False, hi_open=False, integer=False, optional=False) -> None:
    """One config value: a finite number (an int if ``integer``) within [lo, hi] (open ends as asked)."""
    if v is None and optional:
        return
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise UserError(f"{name} must be {kind}, got {v!r}")
    if not math.isfinite(v):
        raise UserError(f"{name} must be finite, got {v}")
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
    if bad_lo or bad_hi:
        rng = (f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}"
               f"{')' if hi_open or hi is None else ']'}")
        raise UserError(f"{name} must be in {rng}, got {v}")


def validate(cfg: TrainConfig) -> None:
    """Every value of ``cfg`` that training reads, checked before anything is written (UserError on the first
    bad one): the model's shape, the optimizer's values (finite, in range), the schedule, the recipe."""
    m, o, sc, t, d, lg = cfg.model, cfg.optim, cfg.schedule, cfg.train, cfg.data, cfg.log
    for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        _num(f"model.{k}", getattr(m, k), lo=1, integer=True, optional=True)
    _num("model.rope_theta", m.rope_theta, lo=0, lo_open=True, optional=True)
    _num("model.init_seed", m.init_seed, integer=True, optional=True)
    try:
        mc = ModelConfig.named(m.name, **{k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
                                                                    "ffn_dim") if getattr(m, k) is not None})
    except TypeError as e:
        raise UserError(f"model: {e}") from None
    if (mc.dim // mc.n_heads) % 2:
        raise UserError(f"the head size model.dim / model.n_heads ({mc.dim // mc.n_heads}) must be even (RoPE)")
    _num("data.vocab_size", d.vocab_size, lo=32, hi=2**20, integer=True)
    _num("data.seq_len", d.seq_len, lo=1, hi=2**20, integer=True)
    _num("data.seed", d.seed, integer=True, optional=True)
    _num("optim.lr", o.lr, lo=0, lo_open=True)
    _num("optim.min_lr_ratio", o.min_lr_ratio, lo=0, hi=1)
    _num("optim.weight_decay", o.weight_decay, lo=0)
    _num("optim.beta1", o.beta1, lo=0, hi=1, hi_open=True)
    _num("optim.beta2", o.beta2, lo=0, hi=1, hi_open=True)
    _num("optim.eps", o.eps, lo=0, lo_open=True, hi=1)
    _num("optim.grad_clip", o.grad_clip, lo=0)
    _num("schedule.warmup_steps", sc.warmup_steps, lo=0, integer=True)
    _num("schedule.horizon_steps", sc.horizon_steps, lo=1, integer=True, optional=True)
    _num("schedule.decay_fraction", sc.decay_fraction, lo=0, hi=1)
    _num("train.micro_batch_size", t.micro_batch_size, lo=1, integer=True, optional=True)
    _num("train.seed", t.seed, integer=True)
    _num("train.checkpoint_every", t.checkpoint_every, lo=0, integer=True)
    _num("train.checkpoint_minutes", t.checkpoint_minutes, lo=0)
    _num("log.peak_tflops", lg.peak_tflops, lo=0, lo_open=True, optional=True)
    cfg.resolved_recipe()   # unknown presets and bad recipe fields: one line


def graph_blockers(recipe, device: torch.device, world: int) -> list[str]:
    """Why the micro-step cannot be replayed as a CUDA graph (empty: it can). A graph replays the kernels
    captured once; every MX layer's random inputs (per-step signs, stochastic-rounding keys) are computed
    on the device from the layer's state tensor, so replays follow the step and call as eager training
    does, on the fast and the reference path alike."""
    why = []
    if device.type != "cuda":
        why.append(f"the device is {device}, not a CUDA GPU")
    if world > 1:
        why.append("training runs on several processes (CUDA graphs are for one GPU here)")
    return why


def compiles(cfg, device: torch.device) -> bool:
    """Does this run compile its transformer blocks (``train.compile``)?"""
    if cfg.train.compile == "auto":
        return device.type == "cuda" and not cfg.train.cuda_graphs
    return cfg.train.compile == "on"


class _LossModule(torch.nn.Module):
    """model(x, y) under the run's autocast, as one module for ``torch.cuda.make_graphed_callables``."""

    def __init__(self, model, device_type: str, amp_dtype):
        super().__init__()
        self.model = model
        self.device_type, self.amp_dtype = device_type, amp_dtype

    def forward(self, x, y):
        # autocast's weight-cast cache must be off while capturing (it would hold casts from the capture)
        with torch.autocast(self.device_type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None, cache_enabled=False):
            return self.model(x, y)


def _git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if sha.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


class _RunLock:
    """An exclusive lock on a run folder while a run trains in it (``fcntl.flock`` on ``RUN/.lock``, which
    holds the owner's pid; the system drops the lock when the process ends, however it ends)."""

    def __init__(self, out: Path):
        self.f = None
        try:
            import fcntl
        except ImportError:   # no flock on this system: unlocked
            return
        f = open(out / ".lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            who = f.read().strip()
            f.close()
            raise UserError(f"output folder {out} is in use by another mxtrain run{f' (pid {who})' if who else ''}; "
                            f"wait for it to finish or choose another --out") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.f = f

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _clean_stale(out: Path) -> None:
    """Temporary files of processes that died in this folder (checkpoint writes, write tests): removed once
    the folder is locked (no live run can be writing them)."""
    for p in list(out.glob(".*.tmp-*")) + list(out.glob(".write-test-*")):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            try:
                p.unlink()
            except OSError:
                pass


def _holds_run(out: Path) -> str | None:
    """What makes ``out`` a run folder (a checkpoint, or metrics of a run that wrote none), or None."""
    if (out / ckpt.NAME).exists() or D.find_dcp(out):
        return "a checkpoint"
    if (out / "metrics.jsonl").exists():
        return "the metrics of a run (and no checkpoint)"
    return None


def _make_out(cfg: TrainConfig, resume_dir: Path | None, rank: int, locks: list) -> Path:
    """The run folder, created and (rank 0) locked. A new run refuses a folder that holds a run; a resumed run
    refuses one that holds another run than the one it continues."""
    out = Path(cfg.log.out) if cfg.log.out else Path("runs") / f"{cfg.exp}-{cfg.recipe_name()}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"output folder {out} exists and is not a folder")
        out.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            locks.append(_RunLock(out))
            _clean_stale(out)
        what = _holds_run(out)
        same = resume_dir is not None and out.resolve() == resume_dir.resolve()
        if what and resume_dir is None:
            raise UserError(f"output folder {out} already holds a run ({what}); use --resume {out} or another --out")
        if what and not same:
            raise UserError(f"output folder {out} holds another run ({what}) than the one resumed from {resume_dir}; "
                            f"resume into {resume_dir} (leave --out out) or choose an empty --out")
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"cannot write to output folder {out}: {e.strerror or e}") from None
    return out


def _model_config(cfg: TrainConfig, vocab: int) -> ModelConfig:
    m = cfg.model
    over = {k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta",
                                        "tie_embeddings") if getattr(m, k) is not None}
    padded = 32 * math.ceil(vocab / 32)  # MX blocks of 32: pad the vocab (extra rows are never targets)
    base = ModelConfig.named(m.name)
    return ModelConfig.named(m.name, **over, vocab_size=padded, max_seq_len=max(base.max_seq_len, cfg.data.seq_len))


def build_model(cfg: TrainConfig, vocab: int, device: torch.device) -> Llama:
    """The model with its init fixed by ``model.init_seed`` (default ``train.seed``), whatever the recipe."""
    mcfg = _model_config(cfg, vocab)
    seed = cfg.model.init_seed if cfg.model.init_seed is not None else cfg.train.seed
    init_dev = torch.device("cpu") if mcfg.num_params() < 1e9 else device
    model = Llama(mcfg, device="meta").to_empty(device=init_dev)
    if mcfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=init_dev).manual_seed(seed)
    model.init_weights(generator=gen)
    return model.to(device)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             fused=device.type == "cuda")


def _apply_optim_values(opt: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """Set betas, eps and weight decay (of the decayed group) from ``cfg`` after loading a checkpoint's state;
    the learning rate is set at every step from the schedule."""
    o = cfg.optim
    for g in opt.param_groups:
        g["betas"], g["eps"] = (o.beta1, o.beta2), o.eps
        if g["weight_decay"] != 0.0:
            g["weight_decay"] = o.weight_decay


def _all_finite(model: torch.nn.Module) -> bool:
    """Are all weights finite (on every rank: each checks its shards)?"""
    ok = []
    for p in model.parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t   # [distributed] FSDP2's DTensor shards
        ok.append(torch.isfinite(t).all())
    here = bool(torch.stack([t.to(ok[0].device) for t in ok]).all()) if ok else True
    return _reduce_mean(0.0 if here else 1.0) == 0.0   # [distributed] any rank non-finite: all stop


def _wrap_parallel(model, cfg, env):  # [distributed] DDP / FSDP2 (mxtrain.distributed.wrap)
    p = cfg.parallel
    mode = ("ddp" if env.distributed else "none") if p.mode == "auto" else p.mode
    if mode != "fsdp2":
        return D.wrap(model, mode, env)
    dt = {"auto": "auto", "bf16": torch.bfloat16, "fp32": None}[p.param_dtype]
    return D.wrap(model, mode, env, param_dtype=dt, reshard_after_forward=p.reshard_after_forward)


def _reduce_mean(x: float) -> float:  # [distributed] all-reduce over ranks
    return D.reduce_mean(x)


def _peak_tflops(cfg: TrainConfig, dev: torch.device) -> float | None:
    if cfg.log.peak_tflops:
        return cfg.log.peak_tflops
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    for k, v in PEAK_TFLOPS.items():
        if k in name:
            return v
    return None


@torch.no_grad()
def evaluate(model, data: TokenData, cfg: TrainConfig, device, amp_dtype, rank=0, world=1) -> float:
    model.eval()
    total, count = 0.0, 0
    bs = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // world)
    # [distributed] every rank runs as many forwards (FSDP2 gathers in each); padding batches weigh 0
    for (x, y), w in D.even_batches(val_batches(data, cfg.data.seq_len, bs, cfg.log.eval_tokens, rank, world)):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = model(x, y)
        total += w * loss.item() * y.numel()
        count += w * y.numel()
    model.train()
    total, count = D.reduce_sums(total, count)  # [distributed] token-weighted mean over all ranks
    return total / count


def _write_json(path: Path, obj) -> None:
    """A small JSON file written whole (``checkpoint.write_atomic``)."""
    text = json.dumps(obj, indent=2, default=str, allow_nan=False) + "\n"
    ckpt.write_atomic(path, lambda f: f.write(text.encode()))


class _Log:
    """metrics.jsonl + TensorBoard + console."""

    def __init__(self, out: Path, cfg: TrainConfig, start_step: int, total: int, rank: int):
        self.rank = rank
        self.path = out / "metrics.jsonl"
        if rank:  # [distributed] only rank 0 touches metrics.jsonl
            self.f = self.tb = self.bar = None
            self._bar_args = (False, total, start_step)
            return
        if start_step > 0 and self.path.exists():  # drop rows past the checkpoint (a crash after it)
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= start_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        elif start_step == 0:
            self.path.write_text("")
        self.f = open(self.path, "a")
        self.tb = None
        if cfg.log.tensorboard and rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(out / "tb"))
            except Exception:  # tensorboard not installed
                self.tb = None
        self.bar = None
        self._bar_args = (cfg.log.progress and rank == 0, total, start_step)

    def start_bar(self):
        on, total, start_step = self._bar_args
        if on:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                                file=sys.stderr)
            except ImportError:
                pass

    def row(self, r: dict):
        if self.rank:
            return
        # strict JSON: a non-finite number is written as its name in a string ("nan", "inf")
        line = json.dumps({k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                           for k, v in r.items()}, allow_nan=False) + "\n"
        try:
            self.f.write(line)
            self.f.flush()
        except OSError as e:
            raise UserError(f"cannot write {self.path}: {e.strerror or e}; the last checkpoint is intact") from None
        if self.tb:
            for k, v in r.items():
                if k not in ("step", "tokens") and isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(k, v, r["step"])

    def say(self, msg: str):
        if self.rank:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.tb:
            self.tb.close()
        if self.f:
            self.f.close()


def train(cfg: TrainConfig, resume: str | Path | None = None) -> Path:
    """Train as ``cfg`` says; returns the run folder. ``resume``: a run folder or checkpoint to continue."""
    cfg = copy.deepcopy(cfg)
    _check(cfg)
    device = _resolve_device(cfg.train.device)
    env = D.init(str(device) if device.index is not None or device.type == "cpu" else "cuda")  # [distributed]
    locks: list = []
    try:
        out = _train(cfg, resume, env, locks)
    finally:
        for lock in locks:   # the run folder's lock (rank 0)
            lock.close()
    # [distributed] _train's frame is gone, and with it the DDP / FSDP2 model that holds the process group:
    # D.shutdown destroys the group while the interpreter is whole (not at exit, where gloo can abort)
    if env.distributed:
        D.barrier()
        D.shutdown()
    return out


def _train(cfg: TrainConfig, resume: str | Path | None, env: D.DistEnv, locks: list) -> Path:
    rank, world, device = env.rank, env.world_size, env.device
    amp_dtype = _autocast_dtype(cfg, device)
    recipe = cfg.resolved_recipe()
    if cfg.train.cuda_graphs:
        why = graph_blockers(recipe, device, world)
        if why:
            raise UserError("train.cuda_graphs needs one GPU: " + "; ".join(why))
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    state = None
    dcp_path = D.find_dcp(resume) if resume is not None else None  # [distributed] a DCP checkpoint?
    if dcp_path is not None:
        state = D.read_extra(dcp_path)
        if cfg.log.out is None:
            cfg.log.out = str(dcp_path.parent)
    elif resume is not None:
        state = ckpt.load(resume)
        if cfg.log.out is None:
            cfg.log.out = str(ckpt.find(resume).parent)

    # data
    if cfg.data.path == "builtin":
        data_dir = ensure_builtin(cfg.data.vocab_size, progress=cfg.log.progress)
    else:
        data_dir = Path(cfg.data.path)
        if not data_dir.exists():
            raise UserError(f"data folder not found: {data_dir} (prepare it with: mxtrain data prepare SOURCES --out {data_dir})")
    data = TokenData(data_dir)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    micro = cfg.train.micro_batch_size or B // world
    if micro <= 0 or B % (micro * world):
        raise UserError(f"train.batch_size ({B}) must be a multiple of micro_batch_size x world size ({micro} x {world})")
    accum = B // (micro * world)
    data_seed = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed
    loader = Loader(data, T, micro, data_seed, rank, world)

    # model + optimizer
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, data.vocab_size, device)
    convert(model, recipe)
    if compiles(cfg, device):
        # each block compiled on its own (one graph shared by all blocks: layer numbers and steps are
        # tensors), before DDP / FSDP2 wrap them, as torchtitan does; state_dict keys are unchanged
        for block in model.layers:
            block.compile()
    model = _wrap_parallel(model, cfg, env)
    opt = _optimizer(model, cfg, device)
    mcfg = D.unwrap(model).cfg
    cfg_dict = cfg.to_dict()
    cfg_dict["recipe"] = cfg.recipe if isinstance(cfg.recipe, str) else recipe.to_dict()

    start_step, tokens = 0, 0
    if state is not None:
        ckpt.check_compatible(state["config"], cfg_dict, resume)
        try:
            if dcp_path is not None:  # [distributed] any writer world size -> this one
                D.load_checkpoint(dcp_path, model, opt, env=env)
            elif env.distributed:  # [distributed] a single-process checkpoint.pt -> DDP / FSDP2
                D.load_full_state(model, opt, state["model"], state["optimizer"])
            else:
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise UserError(f"checkpoint {resume} does not fit this model ({str(e).splitlines()[0][:160]})") from None
        _apply_optim_values(opt, cfg)   # this run's optimizer values, not the checkpoint's
        loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        start_step, tokens = int(state["step"]), int(state["tokens"])
        if start_step >= cfg.train.steps:
            raise UserError(f"checkpoint is at step {start_step}, nothing to do for --steps {cfg.train.steps}; "
                            f"raise --steps to continue")

    resume_dir = None
    if state is not None:
        resume_dir = dcp_path.parent if dcp_path is not None else ckpt.find(resume).parent
    out = _make_out(cfg, resume_dir, rank, locks)
    if rank == 0:
        _write_json(out / "config.json", cfg_dict)
        _write_json(out / "recipe.json", recipe.to_dict())
        info = {"mxtrain": __version__, "torch": torch.__version__, "python": platform.python_version(),
                "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                else (platform.processor() or platform.machine()), "cpu_threads": torch.get_num_threads(),
                "git_sha": _git_sha(), "argv": sys.argv, "data": str(Path(data_dir).resolve()),
                "data_meta": {k: data.meta[k] for k in ("train_tokens", "val_tokens", "vocab_size", "sources")},
                "model_params": mcfg.num_params(), "flops_per_token": mcfg.flops_per_token(T),
                "world_size": world, "grad_accum": accum, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "resumed_from_step": start_step or None}
        # every leg of a resumed run keeps its record: the earlier legs go under "legs", oldest first
        legs = []
        if state is not None and (out / "run.json").exists():
            try:
                prev = json.loads((out / "run.json").read_text())
                legs = prev.pop("legs", []) + [prev] if isinstance(prev, dict) else []
            except (OSError, json.JSONDecodeError):
                legs = []
        if legs:
            info["legs"] = legs
        _write_json(out / "run.json", info)

    log = _Log(out, cfg, start_step, cfg.train.steps, rank)
    flops_tok = mcfg.flops_per_token(T)
    peak = _peak_tflops(cfg, device)
    log.say(f"mxtrain {__version__} | model {cfg.model.name} ({mcfg.num_params() / 1e6:.1f}M params, "
            f"{flops_tok / 1e6:.1f} MFLOP/token) | recipe {recipe.name} | {device}"
            f"{' bf16 autocast' if amp_dtype else ' fp32'} | {cfg.train.steps} steps x {B} x {T} tokens | run {out}")
    log.start_bar()

    ckpt_path = out / ckpt.NAME
    last_ckpt_step = start_step if state is not None else None

    def save_ckpt(step):
        nonlocal last_ckpt_step
        if not _all_finite(model):   # never a checkpoint of non-finite weights
            raise NonFiniteLoss(f"weights are not finite at step {step}; no checkpoint written (last good "
                                f"checkpoint: {ckpt_path if last_ckpt_step is not None else 'none'}); try a lower --lr")
        rest = {"schedule": {"step": step, "lr": lr_at(step, cfg)}, "loader": loader.state_dict(),
                "rng": ckpt.rng_state(), "step": step, "tokens": tokens, "config": cfg_dict}
        if env.distributed:  # [distributed] DCP folder, every rank writes its shards; atomic rename
            D.save_checkpoint(out / D.DCP_NAME, model, opt, extra=rest, env=env)
            if rank == 0 and ckpt_path.exists():
                ckpt_path.unlink()  # a single-process leg's older checkpoint: resume must find the newest
        elif rank == 0:
            ckpt.save(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(), **rest})
            if D.find_dcp(out):  # [distributed] an older multi-process leg's checkpoint
                import shutil
                shutil.rmtree(out / D.DCP_NAME)
        last_ckpt_step = step

    model.train()
    graphed = None
    t_last, tok_last, steps_last = time.perf_counter(), tokens, 0
    loss_acc = 0.0
    val_loss = None
    sig = _Signals()
    t_ckpt = time.perf_counter()
    try:
        for step in range(start_step, cfg.train.steps):
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            set_step(model, step)
            loss_sum = torch.zeros((), device=device)
            for k in range(accum):
                x, y = loader.next()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if cfg.train.cuda_graphs:
                    if graphed is None:   # capture once (after 3 eager warm-up passes), replay from then on
                        try:
                            graphed = torch.cuda.make_graphed_callables(
                                _LossModule(model, device.type, amp_dtype), (x, y))
                        except RuntimeError as e:
                            raise UserError(f"could not capture the training step as a CUDA graph "
                                            f"({str(e).splitlines()[0][:300]}); run without train.cuda_graphs") from None
                        # a replayed backward hands autograd its static gradient buffers; a .grad that
                        # already exists is added to in place, so accumulation never aliases (and sums)
                        # those buffers. The grads stay allocated: zero_grad below zeroes, not frees.
                        for p in model.parameters():
                            if p.grad is None:
                                p.grad = torch.zeros_like(p)
                        # the warm-up and capture passes advanced the layers' call counters: this first
                        # replay is call 0 of this step, as in eager training
                        set_step(model, step)
                    loss = graphed(x, y) / accum
                    loss.backward()
                else:
                    with D.grad_sync(model, k == accum - 1):  # [distributed] reduce grads on the last micro-step only
                        with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                                            enabled=amp_dtype is not None):
                            loss = model(x, y) / accum
                        loss.backward()
                loss_sum += loss.detach()
            loss_val = _reduce_mean(loss_sum.item())
            if not math.isfinite(loss_val):
                where = (f"last good checkpoint: {ckpt_path} (step {last_ckpt_step})" if last_ckpt_step is not None
                         else "no checkpoint was written yet")
                log.row({"step": step + 1, "tokens": tokens, "event": "non-finite loss", "loss": str(loss_val)})
                raise NonFiniteLoss(f"loss is {loss_val} at step {step + 1}; training stopped ({where}); "
                                    f"try a lower --lr or another recipe")
            gnorm = D.clip_grad_norm_(model, cfg.optim.grad_clip if cfg.optim.grad_clip > 0  # [distributed] DTensor grads
                                      else float("inf"))
            if not math.isfinite(float(gnorm)):
                # checked before the update: the weights (and the last checkpoint) stay those of the last good step
                where = (f"last good checkpoint: {ckpt_path} (step {last_ckpt_step})" if last_ckpt_step is not None
                         else "no checkpoint was written yet")
                log.row({"step": step + 1, "tokens": tokens, "event": "non-finite gradient", "grad_norm": float(gnorm)})
                raise NonFiniteLoss(f"gradient norm is {float(gnorm)} at step {step + 1}; the weights were not updated "
                                    f"({where}); resume with a lower --lr (it may change on resume) or another recipe")
            opt.step()
            opt.zero_grad(set_to_none=graphed is None)
            tokens += B * T
            done = step + 1
            loss_acc += loss_val
            steps_last += 1
            if done % cfg.log.log_every == 0 or done == cfg.train.steps or done == start_step + 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.perf_counter()
                tps = (tokens - tok_last) / max(now - t_last, 1e-9)
                row = {"step": done, "tokens": tokens, "loss": loss_acc / steps_last, "lr": lr,
                       "grad_norm": float(gnorm), "tok_per_s": tps, "epoch": loader.epoch}
                if peak:
                    row["mfu"] = flops_tok * tps / (peak * 1e12)
                log.row(row)
                if log.bar is not None:
                    log.bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
                else:
                    log.say(f"step {done:>6} | tokens {tokens:>11,} | loss {row['loss']:.4f} | lr {lr:.2e} | "
                            f"{tps:,.0f} tok/s")
                loss_acc, steps_last = 0.0, 0
                t_last, tok_last = now, tokens
            if log.bar is not None:
                log.bar.update(1)
            if done % cfg.log.eval_every == 0 or done == cfg.train.steps:
                te = time.perf_counter()
                val_loss = evaluate(model, data, cfg, device, amp_dtype, rank, world)
                log.row({"step": done, "tokens": tokens, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
                if not math.isfinite(val_loss):
                    raise NonFiniteLoss(f"validation loss is {val_loss} at step {done}; training stopped (last good "
                                        f"checkpoint: {ckpt_path} (step {last_ckpt_step})); resume with a lower --lr "
                                        f"or another recipe" if last_ckpt_step is not None else
                                        f"validation loss is {val_loss} at step {done}; training stopped (no checkpoint "
                                        f"was written yet); try a lower --lr or another recipe")
                log.say(f"step {done:>6} | tokens {tokens:>11,} | val_loss {val_loss:.4f} | val_ppl {math.exp(min(val_loss, 50)):.2f}")
                t_last += time.perf_counter() - te  # keep evaluation out of tokens/s
            caught = sig.caught if not env.distributed else int(_reduce_mean(float(sig.caught or 0)) > 0) and (
                sig.caught or 15)   # [distributed] a signal on any rank stops every rank at the same step
            due = cfg.train.checkpoint_minutes > 0 and time.perf_counter() - t_ckpt >= 60 * cfg.train.checkpoint_minutes
            if ((cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0) or done == cfg.train.steps
                    or due or caught):
                save_ckpt(done)
                t_ckpt = time.perf_counter()
            if caught and done < cfg.train.steps:
                import signal
                name = signal.Signals(caught).name
                log.row({"step": done, "tokens": tokens, "event": f"interrupted ({name})"})
                raise Interrupted(f"interrupted by {name} at step {done}; checkpoint saved in {out}; continue with: "
                                  f"mxtrain train --resume {out}", caught)
    finally:
        sig.restore()
        log.close()
    if rank == 0:
        summary = {"steps": cfg.train.steps, "tokens": tokens, "final_val_loss": val_loss,
                   "final_val_ppl": math.exp(min(val_loss, 50)) if val_loss is not None else None,
                   "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write_json(out / "summary.json", summary)
    return out
