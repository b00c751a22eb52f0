"""Study metrics: extra-token cost, final-loss gaps, paired per-step differences, seed spread.

Everything here reads ordinary run folders (``metrics.jsonl`` + ``config.json``) and works on
plain Python lists, so it can be unit-tested on synthetic files whose answer is known.

Definitions (also in docs/study.md):

* **Smoothing** (``smooth_k``): the validation curve of one run is replaced by the running mean
  of its last ``k`` evaluations, taken over *both* coordinates: smoothed point ``j`` is
  ``(mean tokens_{j-k+1..j}, mean val_loss_{j-k+1..j})`` (fewer points at the start). Averaging
  the token positions too keeps the smoothed curve unbiased for a locally linear curve and makes
  the metric exactly equivariant to rescaling the token axis. ``k = 1`` is no smoothing.
* **Tokens to target** ``T(run, L*)``: the first point where the smoothed curve is ``<= L*``,
  linearly interpolated in (tokens, loss) between it and the previous smoothed point. ``None``
  when the curve never gets there ("did not reach").
* **Extra-token cost** of an arm, per seed ``s``: ``T(arm, s) / T(baseline, s) - 1``, paired by
  seed (same init and data order); if the baseline's seed ``s`` is missing, the baseline's
  seed-mean ``T`` is used. Mean and a t-based 95 % CI over seeds. States: ``ok``;
  ``diverged`` (any seed diverged); ``did_not_reach`` (any seed never reached the target; a lower
  bound from the tokens it did train on is given); ``baseline_did_not_reach``; ``no_runs``.
* **Default target**: the baseline's smoothed val loss at ``target_frac`` (0.8) of its final
  tokens, averaged over its seeds; or an explicit ``target_loss``.
* **Diverged**: a non-finite training or validation loss, a run-folder status (``study_status.json``) or
  trainer outcome (``run.json``) that says so, or a
  final smoothed val loss above the first evaluation's (the run went back above where it started).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, read_json_object

__all__ = [
    "RunData", "read_run", "load_study_runs", "t_quantile", "mean_ci", "smooth",
    "tokens_to_target", "loss_at_tokens", "default_target", "extra_token_cost",
    "final_loss_stats", "paired_differences", "summarize", "missing_runs", "compare_with",
]


# ----------------------------------------------------------------------------------------------
# reading runs


@dataclass
class RunData:
    """One run folder, parsed."""

    path: Path
    arm: str = ""
    seed: int = 0
    eval_steps: list[int] = field(default_factory=list)
    eval_tokens: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    train_steps: list[int] = field(default_factory=list)
    train_tokens: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)      # run.json: versions, device, git SHA, ...
    status: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        if self.status.get("state") == "diverged":
            return True
        oc = self.info.get("outcome") if isinstance(self.info, dict) else None
        if isinstance(oc, dict) and oc.get("status") == "diverged":   # the trainer's typed outcome (run.json)
            return True
        if any(not math.isfinite(v) for v in self.train_loss + self.val_loss):
            return True
        fin = [v for v in self.val_loss if math.isfinite(v)]
        if len(fin) >= 3 and fin[-1] > fin[0]:
            return True
        return False

    @property
    def finite_evals(self) -> tuple[list[float], list[float], list[int]]:
        """Evaluation points up to the first non-finite one."""
        t, v, s = [], [], []
        for tok, loss, st in zip(self.eval_tokens, self.val_loss, self.eval_steps):
            if not math.isfinite(loss):
                break
            t.append(tok), v.append(loss), s.append(st)
        return t, v, s


def _num(x) -> float:
    if x is None:
        return float("nan")
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def read_run(path: str | Path, arm: str = "", seed: int = 0) -> RunData:
    """Parse ``path/metrics.jsonl`` (and ``config.json``, ``study_status.json`` if present).

    Rows with ``val_loss`` are evaluations, rows with ``loss`` training steps (a row may be both).
    A truncated last line (a run killed mid-write) is ignored; other unreadable lines are errors.
    """
    path = Path(path)
    f = path / "metrics.jsonl"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: not a run folder")
    rd = RunData(path=path, arm=arm, seed=seed)
    lines = f.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise UserError(f"{f}:{i + 1}: a line that is not valid JSON ({line[:60]}); restore the file or remove "
                            f"the line") from None
        if not isinstance(row, dict):
            continue
        try:
            if "val_loss" in row:
                rd.eval_steps.append(int(row.get("step", len(rd.eval_steps))))
                rd.eval_tokens.append(_num(row.get("tokens")))
                rd.val_loss.append(_num(row["val_loss"]))
            if "loss" in row:
                rd.train_steps.append(int(row.get("step", len(rd.train_steps))))
                rd.train_tokens.append(_num(row.get("tokens")))
                rd.train_loss.append(_num(row["loss"]))
        except (TypeError, ValueError):
            raise UserError(f"{f}:{i + 1}: a row whose step, tokens or loss is not a number ({line[:80]}); "
                            f"restore the file or remove the row") from None
        if row.get("diverged") or row.get("event") in ("diverged", "nonfinite", "non_finite_loss", "non-finite loss"):
            rd.status.setdefault("state", "diverged")
    for name, attr in (("config.json", "config"), ("run.json", "info"), ("study_status.json", "status")):
        p = path / name
        if p.is_file():
            if attr == "status":   # (a study's own note; unreadable: as if the run had none)
                try:
                    rd.status.update(read_json_object(p))
                except UserError:
                    pass
            else:
                setattr(rd, attr, read_json_object(p, "a run folder's record"))
    return rd


SEED_DIR = re.compile(r"seed(0|[1-9][0-9]*)")   # a run's folder name, as the runner writes it (ASCII digits)


def load_study_runs(study_dir: str | Path, finished_only: bool = True) -> dict[str, dict[int, RunData]]:
    """``{arm: {seed: RunData}}`` for every ``runs/<arm>/seed<k>`` holding a metrics.jsonl.

    With ``finished_only`` (default), only runs that ended: the runner wrote ``study_status.json``
    (done or diverged) or the trainer wrote its end-of-run ``summary.json``; an interrupted run is
    left out, never counted as a short run.
    """
    out: dict[str, dict[int, RunData]] = {}
    root = Path(study_dir) / "runs"
    if not root.is_dir():
        return out
    for arm_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for sd in sorted(arm_dir.glob("seed*")):
            # exactly the names the runner writes (seed0, seed12): int() would read "seed1 " or "seed01" as seed 1
            if not SEED_DIR.fullmatch(sd.name):
                continue
            seed = int(sd.name[4:])
            if finished_only and not ((sd / "study_status.json").is_file() or (sd / "summary.json").is_file()):
                continue
            if finished_only and _status_state(sd) == "failed":   # an error, not a result: trained again
                continue
            if (sd / "metrics.jsonl").is_file():
                out.setdefault(arm_dir.name, {})[seed] = read_run(sd, arm_dir.name, seed)
    return out


def _status_file(run_dir: Path) -> dict | None:
    p = Path(run_dir) / "study_status.json"
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return d if isinstance(d, dict) else None


def _status_state(run_dir: Path) -> str | None:
    return (_status_file(run_dir) or {}).get("state")


def missing_runs(study_dir: str | Path, arms: list[str], seeds: list[int],
                 runs: dict[str, dict[int, RunData]] | None = None) -> list[dict]:
    """The planned runs (every arm x seed) that have no finished run in ``runs`` (default: the finished runs
    of ``study_dir``), in plan order (seed-major), each ``{"arm", "seed", "state", "reason"}``; ``state`` is
    ``failed`` (an error other than divergence, with its message), ``interrupted`` (a run folder that never
    ended), ``not_trained`` (no folder) or ``no_metrics`` (it ended but wrote no metrics.jsonl)."""
    root = Path(study_dir)
    if runs is None:
        runs = load_study_runs(root)
    out = []
    for s in seeds:
        for a in arms:
            if s in runs.get(a, {}):
                continue
            rd = root / "runs" / a / f"seed{s}"
            st = _status_file(rd)
            if st is not None and st.get("state") == "failed":
                state, reason = "failed", st.get("message") or ""
            elif st is not None and st.get("state"):
                state, reason = "no_metrics", f"ended {st.get('state')} without metrics.jsonl"
            elif rd.exists():
                state, reason = "interrupted", "the run folder has no end status (stopped while training)"
            else:
                state, reason = "not_trained", ""
            out.append({"arm": a, "seed": int(s), "state": state, "reason": reason,
                        **({"oom": True} if st is not None and st.get("oom") else {})})
    return out


# ----------------------------------------------------------------------------------------------
# statistics

# two-sided 95 % t quantiles t_{0.975, df}
_T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423]


def t_quantile(df: int) -> float:
    """t_{0.975, df} (two-sided 95 %); exact table to df = 30, Cornish-Fisher beyond."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df <= 30:
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(xs: list[float]) -> dict:
    """Mean, sample s.d., n and t-based 95 % CI ``[lo, hi]`` (``None`` when n < 2)."""
    xs = [float(x) for x in xs if x is not None and math.isfinite(x)]
    n = len(xs)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0, "ci95": None}
    m = sum(xs) / n
    if n < 2:
        return {"mean": m, "sd": None, "n": 1, "ci95": None}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = t_quantile(n - 1) * sd / math.sqrt(n)
    return {"mean": m, "sd": sd, "n": n, "ci95": [m - h, m + h]}


# ----------------------------------------------------------------------------------------------
# curves


def smooth(tokens: list[float], losses: list[float], k: int = 1) -> tuple[list[float], list[float]]:
    """Running mean of the last ``k`` points over both coordinates (see module docstring)."""
    if k < 1:
        raise ValueError("smoothing window k must be >= 1")
    st, sl = [], []
    for j in range(len(tokens)):
        lo = max(0, j - k + 1)
        w = j + 1 - lo
        st.append(sum(tokens[lo:j + 1]) / w)
        sl.append(sum(losses[lo:j + 1]) / w)
    return st, sl


def tokens_to_target(tokens: list[float], losses: list[float], target: float, k: int = 1) -> float | None:
    """Tokens at which the smoothed curve first reaches ``target`` (linear interpolation)."""
    st, sl = smooth(tokens, losses, k)
    for j, (t, v) in enumerate(zip(st, sl)):
        if v <= target:
            if j == 0:
                return t
            t0, v0 = st[j - 1], sl[j - 1]
            if v0 == v:
                return t
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
    return None


def loss_at_tokens(tokens: list[float], losses: list[float], at: float, k: int = 1) -> float | None:
    """The smoothed curve linearly interpolated at token count ``at`` (``None`` outside it)."""
    st, sl = smooth(tokens, losses, k)
    if not st or at < st[0] or at > st[-1]:
        return None
    for j in range(1, len(st)):
        if st[j] >= at:
            t0, t1 = st[j - 1], st[j]
            if t1 == t0:
                return sl[j]
            return sl[j - 1] + (sl[j] - sl[j - 1]) * (at - t0) / (t1 - t0)
    return sl[-1]


def default_target(baseline: dict[int, RunData], frac: float = 0.8, k: int = 1) -> float | None:
    """Seed mean of the baseline's smoothed val loss at ``frac`` of each seed's final tokens."""
    vals = []
    for rd in baseline.values():
        t, v, _ = rd.finite_evals
        if not t or rd.diverged:
            continue
        x = loss_at_tokens(t, v, frac * t[-1], k)
        if x is None:  # frac * T before the first smoothed point: use that point
            x = smooth(t, v, k)[1][0]
        vals.append(x)
    return sum(vals) / len(vals) if vals else None


def extra_token_cost(arm: dict[int, RunData], baseline: dict[int, RunData], target: float, k: int = 1) -> dict:
    """Extra-token cost of ``arm`` vs ``baseline`` at ``target`` (see module docstring)."""
    base_T = {s: tokens_to_target(*rd.finite_evals[:2], target, k) for s, rd in baseline.items()
              if not rd.diverged}
    base_ok = [T for T in base_T.values() if T]
    out: dict = {"target_loss": target, "smooth_k": k, "per_seed": {}, "tokens_to_target": {},
                 "mean": None, "ci95": None, "sd": None, "n": 0, "state": "ok", "reason": None}
    if not arm:
        out.update(state="no_runs", reason="no finished runs")
        return out
    if not base_ok:
        out.update(state="baseline_did_not_reach", reason=f"the baseline never reached val loss {target:.4f}")
        return out
    base_mean = sum(base_ok) / len(base_ok)
    diverged = [s for s, rd in arm.items() if rd.diverged]
    missed, costs = [], []
    for s, rd in sorted(arm.items()):
        if rd.diverged:
            out["per_seed"][str(s)] = None
            continue
        t, v, _ = rd.finite_evals
        T = tokens_to_target(t, v, target, k)
        out["tokens_to_target"][str(s)] = T
        ref = base_T.get(s) or base_mean
        if T is None:
            missed.append((s, (t[-1] if t else 0.0) / ref - 1))
            out["per_seed"][str(s)] = None
            continue
        c = T / ref - 1
        out["per_seed"][str(s)] = c
        costs.append(c)
    if diverged:
        out.update(state="diverged", reason=f"diverged: seed(s) {', '.join(map(str, sorted(diverged)))}")
        return out
    if missed:
        lb = min(x for _, x in missed)
        out.update(state="did_not_reach",
                   reason=(f"seed(s) {', '.join(str(s) for s, _ in missed)} never reached val loss {target:.4f}; "
                           f"cost > {100 * lb:+.1f} % (tokens trained / baseline's tokens to target - 1)"),
                   lower_bound=lb)
        if costs:
            out["reached_mean"] = sum(costs) / len(costs)
        return out
    out.update(mean_ci(costs))
    return out


def final_loss_stats(runs: dict[int, RunData], k: int = 1) -> dict:
    """Final val loss per seed (last raw eval and last smoothed point), mean and CI."""
    last, last_s = {}, {}
    for s, rd in sorted(runs.items()):
        t, v, _ = rd.finite_evals
        if rd.diverged or not v:
            last[str(s)] = None
            last_s[str(s)] = None
            continue
        last[str(s)] = v[-1]
        last_s[str(s)] = smooth(t, v, k)[1][-1]
    d = {"per_seed": last, "per_seed_smoothed": last_s}
    d.update(mean_ci([x for x in last.values() if x is not None]))
    d["smoothed"] = mean_ci([x for x in last_s.values() if x is not None])
    return d


def paired_differences(arm: dict[int, RunData], baseline: dict[int, RunData]) -> dict:
    """Per evaluation step, ``val_loss(arm, s) - val_loss(baseline, s)`` over seeds present in both.

    Returns steps, tokens, mean, CI bounds and n per step, plus ``second_half``: the per-seed
    mean difference over the second half of the common steps, with mean and CI over seeds.
    """
    seeds = sorted(set(arm) & set(baseline))
    per_seed: dict[int, dict[int, float]] = {}
    tokens_at: dict[int, float] = {}
    for s in seeds:
        a = dict(zip(arm[s].eval_steps, arm[s].val_loss))
        b = dict(zip(baseline[s].eval_steps, baseline[s].val_loss))
        for st, tok in zip(baseline[s].eval_steps, baseline[s].eval_tokens):
            tokens_at.setdefault(st, tok)
        per_seed[s] = {st: a[st] - b[st] for st in a.keys() & b.keys()
                       if math.isfinite(a[st]) and math.isfinite(b[st])}
    steps = sorted(set().union(*[set(d) for d in per_seed.values()])) if per_seed else []
    out = {"seeds": seeds, "steps": steps, "tokens": [tokens_at.get(s) for s in steps],
           "mean": [], "ci_lo": [], "ci_hi": [], "n": []}
    for st in steps:
        m = mean_ci([d[st] for d in per_seed.values() if st in d])
        out["mean"].append(m["mean"])
        out["ci_lo"].append(m["ci95"][0] if m["ci95"] else None)
        out["ci_hi"].append(m["ci95"][1] if m["ci95"] else None)
        out["n"].append(m["n"])
    half = steps[len(steps) // 2:]
    sh = {}
    for s, d in per_seed.items():
        xs = [d[st] for st in half if st in d]
        if xs:
            sh[str(s)] = sum(xs) / len(xs)
    out["second_half"] = {"per_seed": sh, **mean_ci(list(sh.values()))}
    return out


def _seed_spread(runs: dict[int, RunData], target: float | None, k: int) -> dict:
    fin = [rd.finite_evals[1][-1] for rd in runs.values() if not rd.diverged and rd.finite_evals[1]]
    Ts = []
    if target is not None:
        Ts = [tokens_to_target(*rd.finite_evals[:2], target, k) for rd in runs.values() if not rd.diverged]
        Ts = [T for T in Ts if T]
    f = mean_ci(fin)
    tt = mean_ci(Ts)
    rel = tt["sd"] / tt["mean"] if tt["sd"] is not None and tt["mean"] else None
    return {"final_val_loss_sd": f["sd"], "tokens_to_target_rel_sd": rel, "n": len(runs)}


def _baseline_cost(base: dict[int, RunData], target: float, k: int) -> dict:
    """The baseline's own row: cost 0 by definition, plus its tokens to target per seed."""
    T = {str(s): (None if rd.diverged else tokens_to_target(*rd.finite_evals[:2], target, k))
         for s, rd in sorted(base.items())}
    missed = [s for s, t in T.items() if t is None]
    return {"state": "baseline", "target_loss": target, "smooth_k": k, "mean": 0.0, "ci95": None, "sd": None,
            "n": len(base), "per_seed": {s: (0.0 if t is not None else None) for s, t in T.items()},
            "tokens_to_target": T,
            "reason": (f"baseline seed(s) {', '.join(missed)} never reached the target; their pairs use the "
                       f"baseline's seed mean" if missed else None)}


def summarize(runs: dict[str, dict[int, RunData]], baseline: str, *, target_loss: float | None = None,
              target_frac: float = 0.8, smooth_k: int = 3, recipes: dict | None = None) -> dict:
    """The study summary (``summary.json``'s content) from ``{arm: {seed: RunData}}``."""
    if baseline not in runs:
        raise ValueError(f"baseline arm {baseline!r} has no runs; arms with runs: {', '.join(runs) or 'none'}")
    base = runs[baseline]
    if target_loss is None:
        target = default_target(base, target_frac, smooth_k)
        rule = f"baseline's smoothed val loss at {target_frac:.0%} of its tokens (seed mean)"
    else:
        target, rule = float(target_loss), "given (--target-loss)"
    base_final = final_loss_stats(base, smooth_k)
    arms = {}
    for name, rs in runs.items():
        fl = final_loss_stats(rs, smooth_k)
        gap_seeds = {s: fl["per_seed"][s] - base_final["per_seed"][s] for s in fl["per_seed"]
                     if fl["per_seed"][s] is not None and base_final["per_seed"].get(s) is not None}
        gap = {"per_seed": gap_seeds, **mean_ci(list(gap_seeds.values()))}
        recipe = (recipes or {}).get(name)
        if recipe is None:
            any_cfg = next(iter(rs.values())).config
            recipe = any_cfg.get("recipe")
        arms[name] = {
            "recipe": recipe,
            "seeds": sorted(rs),
            "diverged": {str(s): rd.diverged for s, rd in sorted(rs.items())},
            "final_val_loss": fl,
            "final_gap_vs_baseline": gap,
            "extra_tokens": (_baseline_cost(rs, target, smooth_k) if name == baseline and target is not None
                             else extra_token_cost(rs, base, target, smooth_k) if target is not None
                             else {"state": "no_target", "reason": "no target loss could be set", "mean": None,
                                   "ci95": None}),
            "paired_diff": paired_differences(rs, base),
            "seed_spread": _seed_spread(rs, target, smooth_k),
            "tokens_trained": {str(s): (rd.eval_tokens[-1] if rd.eval_tokens else None) for s, rd in sorted(rs.items())},
        }
    return {
        "schema": 1,
        "baseline": baseline,
        "target_loss": target,
        "target_rule": rule,
        "smoothing": {"kind": "trailing window mean over (tokens, val_loss)", "k": smooth_k},
        "arms": arms,
    }


def compare_with(runs: dict[str, dict[int, RunData]], reference: str, *, target_loss: float | None = None,
                 target_frac: float = 0.8, smooth_k: int = 3) -> dict | None:
    """Every arm against a second reference arm (e.g. ``fp8`` beside a ``bf16`` baseline): ``summarize``'s
    extra tokens, final gap and paired second-half difference with ``reference`` as the baseline (its own
    target loss unless ``target_loss`` is given). ``{"target_loss", "target_rule", "arms": {name:
    {"extra_tokens", "final_gap", "second_half"}}}``; None when the reference has no finished run."""
    if reference not in runs:
        return None
    s = summarize(runs, reference, target_loss=target_loss, target_frac=target_frac, smooth_k=smooth_k)
    return {"target_loss": s["target_loss"], "target_rule": s["target_rule"],
            "arms": {n: {"extra_tokens": a["extra_tokens"], "final_gap": a["final_gap_vs_baseline"],
                         "second_half": a["paired_diff"]["second_half"]} for n, a in s["arms"].items()}}


def sanitize(obj):
    """Replace non-finite floats by ``None`` so the result is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj
