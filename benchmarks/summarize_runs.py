"""Summary of the runs benchmarks/llama8b.sh copied into a folder (``<run>.jsonl``: each run's metrics.jsonl).

    python benchmarks/summarize_runs.py OUT      # writes OUT/summary.json and OUT/summary.md

Per run: tokens/s per GPU and MFU (medians over the logged rows after the first ``--skip`` steps, which hold
compilation), the peak memory of the busiest GPU, the last loss. Recipe runs (``recipe-<name>``): each one's
training loss against the first recipe's at the same steps (same init and batches). Scaling runs
(``scale-n1``, ``scale-<fsdp2|ddp>-n<N>``): tokens/s per GPU as a share of the fewest GPUs' rate. Checkpoint
runs: ``save_s`` and ``load_s`` of their checkpoint and resume rows. Profiled runs (``<run>-profile.tgz``):
each rank's step wall time against the host's and the device's self time. With matplotlib: summary.png (loss,
loss against the baseline, tokens/s per GPU by step; scaling efficiency).
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path


def load(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:   # a run killed mid-write
            pass
    return rows


def run_summary(rows: list[dict], skip: int) -> dict:
    train = [r for r in rows if "loss" in r and isinstance(r.get("loss"), (int, float))]
    timed = [r for r in train if r["step"] > skip] or train[-1:]
    # processes: all ranks' tokens/s over one GPU's (rows of one process have no per-GPU rate)
    ratio = [r["tok_per_s"] / r["tok_per_s_per_gpu"] for r in train if r.get("tok_per_s_per_gpu")]
    world = round(ratio[-1]) if ratio else 1
    out = {"steps": train[-1]["step"] if train else 0, "last_loss": train[-1]["loss"] if train else None,
           "losses": {r["step"]: r["loss"] for r in train}}
    if timed:
        tps = [r.get("tok_per_s_per_gpu", r["tok_per_s"]) for r in timed if "tok_per_s" in r]
        out["tok_per_s_per_gpu"] = statistics.median(tps) if tps else None
        mfu = [r["mfu"] for r in timed if "mfu" in r]
        out["mfu"] = statistics.median(mfu) if mfu else None
    mem = [r["peak_mem_gib"] for r in rows if "peak_mem_gib" in r]
    out["peak_mem_gib"] = max(mem) if mem else None
    ev = [r for r in rows if r.get("event") in ("checkpoint", "resumed")]
    out["events"] = [{k: r.get(k) for k in ("event", "step", "world_size", "save_s", "load_s") if k in r} for r in ev]
    out["gpus"] = world
    return out


def summarize(folder: Path, skip: int = 10) -> dict:
    # in the order the runs were copied (a stage's order: a checkpoint's save leg before its resume)
    files = sorted(folder.glob("*.jsonl"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    runs = {p.stem: run_summary(load(p), skip) for p in files}
    s = {"runs": {k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in runs.items()}}
    recipes = [k for k in runs if k.startswith("recipe-")]
    if recipes:
        base = recipes[0] if "recipe-bf16" not in runs else "recipe-bf16"
        ref = runs[base]["losses"]
        agree = {}
        for k in recipes:
            common = sorted(set(ref) & set(runs[k]["losses"]))
            d = [runs[k]["losses"][st] - ref[st] for st in common]
            tail = d[len(d) * 3 // 4:] or d
            agree[k] = {"against": base, "steps": len(common), "max_abs_diff": max(map(abs, d)) if d else None,
                        "mean_diff_last_quarter": statistics.fmean(tail) if tail else None,
                        "range_last_quarter": [min(tail), max(tail)] if tail else None}
        s["loss_vs_baseline"] = agree
    scale = {}
    for k, v in runs.items():
        m = re.fullmatch(r"scale-(?:(fsdp2|ddp)-)?n(\d+)", k)
        if m and v.get("tok_per_s_per_gpu"):
            scale.setdefault(m.group(1) or "none", {})[int(m.group(2))] = v["tok_per_s_per_gpu"]
    if scale:
        # against one GPU where it ran, else each mode against its own fewest GPUs
        one = scale.get("none", {}).get(1)
        s["scaling"], s["scaling_base"] = {}, {}
        for p, rates in scale.items():
            n0 = 1 if one else min(rates)
            base = one or rates[n0]
            s["scaling_base"][p] = {"gpus": n0, "tok_per_s_per_gpu": base}
            s["scaling"][p] = {n: {"tok_per_s_per_gpu": r, "efficiency": r / base} for n, r in sorted(rates.items())}
    prof = profiles(folder)
    if prof:
        s["profiles"] = prof
    return s


def profiles(folder: Path) -> dict:
    """``{run: [per rank: step wall time (median), host and device self time per step]}`` from the
    ``<run>-profile.tgz`` that llama8b.sh keeps (``log.profile_steps``): each rank's ``summary-rank<r>.json``,
    read from the archive without unpacking it."""
    import tarfile
    out = {}
    for tgz in sorted(folder.glob("*-profile.tgz")):
        ranks = []
        try:
            with tarfile.open(tgz, "r:gz") as tf:
                for m in tf.getmembers():
                    if m.isfile() and re.fullmatch(r"(\./)?summary-rank\d+\.json", m.name) and m.size < 1 << 20:
                        ranks.append(json.loads(tf.extractfile(m).read()))
        except (OSError, tarfile.TarError, json.JSONDecodeError):   # a run killed while writing it
            continue
        rows = []
        for r in sorted(ranks, key=lambda r: r.get("rank", 0)):
            walls = r.get("step_wall_s") or []
            rows.append({"rank": r.get("rank"), "steps": r.get("steps"),
                         "step_wall_s": statistics.median(walls) if walls else None,
                         "host_self_s": r.get("host_self_s_per_step"), "device_self_s": r.get("device_self_s_per_step")})
        if rows:
            out[tgz.name[:-len("-profile.tgz")]] = rows
    return out


def plot(folder: Path, s: dict) -> Path | None:
    """``folder/summary.png`` (needs matplotlib, the ``plots`` extra; None without it): the recipe runs' training
    loss and its difference to the baseline's by step, every run's tokens/s per GPU by step, and each mode's
    scaling efficiency by GPU count. One colour per run in every panel."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    files = sorted(folder.glob("*.jsonl"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    rows = {p.stem: [r for r in load(p) if isinstance(r.get("loss"), (int, float))] for p in files}
    rows = {k: v for k, v in rows.items() if v}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {k: palette[i % len(palette)] for i, k in enumerate(rows)}
    recipes = [k for k in rows if k.startswith("recipe-")]
    panels = []
    if recipes:
        panels += ["loss", "diff"] if len(recipes) > 1 else ["loss"]
    panels.append("rate")
    if s.get("scaling"):
        panels.append("scaling")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, what in zip(axes[0], panels):
        if what == "loss":
            for k in recipes:
                ax.plot([r["step"] for r in rows[k]], [r["loss"] for r in rows[k]], color=color[k], label=k[7:])
            ax.set(title="training loss", xlabel="step", ylabel="loss")
        elif what == "diff":
            base = s["loss_vs_baseline"][recipes[0]]["against"]
            ref = {r["step"]: r["loss"] for r in rows[base]}
            for k in recipes:
                pts = [(r["step"], r["loss"] - ref[r["step"]]) for r in rows[k] if r["step"] in ref]
                ax.plot([a for a, _ in pts], [b for _, b in pts], color=color[k], label=k[7:])
            ax.axhline(0, color="k", lw=0.8)
            ax.set(title=f"loss minus {base[7:]}'s at the same step", xlabel="step", ylabel="nats")
        elif what == "rate":
            for k, rs in rows.items():
                pts = [(r["step"], r.get("tok_per_s_per_gpu", r.get("tok_per_s"))) for r in rs if r["step"] > 1
                       and r.get("tok_per_s")]
                ax.plot([a for a, _ in pts], [b for _, b in pts], color=color[k], marker=".", label=k)
            ax.set(title="tokens/s per GPU (each logged interval)", xlabel="step", ylabel="tokens/s")
        else:
            for mode, rates in s["scaling"].items():
                ns = sorted(rates, key=int)
                ax.plot([int(n) for n in ns], [100 * rates[n]["efficiency"] for n in ns], marker="o", label=mode)
            ax.axhline(100, color="k", lw=0.8)
            ax.set_ylim(0, 110)
            ax.set_xticks(sorted({int(n) for rates in s["scaling"].values() for n in rates}))
            ax.set(title="scaling efficiency (tokens/s per GPU over the base)", xlabel="GPUs", ylabel="%")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = folder / "summary.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def markdown(s: dict) -> str:
    def f(x, fmt):
        return "" if x is None else format(x, fmt)
    lines = ["| run | steps | tokens/s per GPU | MFU | peak GiB (busiest GPU) | last loss |", "|---|---|---|---|---|---|"]
    for k, v in s["runs"].items():
        lines.append(f"| {k} | {v['steps']} | {f(v.get('tok_per_s_per_gpu'), ',.0f')} | {f(v.get('mfu'), '.1%')} | "
                     f"{f(v.get('peak_mem_gib'), '.2f')} | {f(v.get('last_loss'), '.4f')} |")
    if "loss_vs_baseline" in s:
        lines += ["", "| recipe | against | steps compared | max abs loss diff | last quarter: mean diff [min, max] |",
                  "|---|---|---|---|---|"]
        for k, v in s["loss_vs_baseline"].items():
            r = v.get("range_last_quarter")
            rng = f" [{r[0]:+.4f}, {r[1]:+.4f}]" if r else ""
            lines.append(f"| {k} | {v['against']} | {v['steps']} | {f(v['max_abs_diff'], '.4f')} | "
                         f"{f(v['mean_diff_last_quarter'], '+.4f')}{rng} |")
    if "scaling" in s:
        lines += ["", "Scaling: each mode's tokens/s per GPU over the rate of its base (one GPU without a wrapper "
                      "where that ran, else the mode's fewest GPUs).", "",
                  "| mode | GPUs | tokens/s per GPU | efficiency | base |", "|---|---|---|---|---|"]
        for p, rates in s["scaling"].items():
            b = s["scaling_base"][p]
            for n, v in rates.items():
                lines.append(f"| {p} | {n} | {v['tok_per_s_per_gpu']:,.0f} | {v['efficiency']:.1%} | "
                             f"{b['gpus']} GPU(s), {b['tok_per_s_per_gpu']:,.0f} |")
    ev = [(k, e) for k, v in s["runs"].items() for e in v["events"]]
    if ev:
        lines += ["", "| run | event | step | GPUs | seconds |", "|---|---|---|---|---|"]
        seen = set()
        for k, e in ev:
            key = (e["event"], e["step"], e.get("world_size"))
            if key in seen:   # a resumed run's file repeats its first leg's rows
                continue
            seen.add(key)
            lines.append(f"| {k} | {e['event']} | {e['step']} | {e.get('world_size')} | "
                         f"{e.get('save_s', e.get('load_s')):.1f} |")
    if s.get("profiles"):
        lines += ["", "Profiled steps (log.profile_steps): median wall time, and per step the host's self time (the "
                      "profiler's own cost included) and the device's (kernels of all streams summed). Host time near "
                      "the wall time: the step waits for the host.", "",
                  "| run | rank | steps | step wall s | host s | device s | host / wall |", "|---|---|---|---|---|---|---|"]
        for k, rows in s["profiles"].items():
            for r in rows:
                ratio = r["host_self_s"] / r["step_wall_s"] if r["host_self_s"] and r["step_wall_s"] else None
                st = "-".join(map(str, r["steps"] or []))
                lines.append(f"| {k} | {r['rank']} | {st} | {f(r['step_wall_s'], '.4f')} | {f(r['host_self_s'], '.4f')} | "
                             f"{f(r['device_self_s'], '.4f')} | {f(ratio, '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the rates (compilation)")
    a = ap.parse_args(argv)
    if not a.folder.is_dir():
        print(f"summarize_runs: {a.folder} is not a folder", file=sys.stderr)
        return 2
    s = summarize(a.folder, a.skip)
    (a.folder / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    (a.folder / "summary.md").write_text(markdown(s))
    plot(a.folder, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
