"""mxtrain's ``fp8`` recipe against torchao's float8 tensorwise, alternated in one process (BENCHMARKS.md, "The
`fp8` recipe on TransformerEngine's and torchao's definition of the cast" and "torchao's numerics as two
settings").

``bench_step.measure`` (4 blocks of the model) for bf16 once, then ``ROUNDS`` rounds of the variants (default
``torchao-tensorwise,fp8``; any ``mxtrain bench step`` variants, settings after colons), the order rotated every
round so that none always runs first; per round each variant's median step time against torchao tensorwise
(> 1: faster), and at the end the median of the rounds' ratios. Usage: ``python tools/fp8_against_torchao.py
OUT.json 8b [ROUNDS [VARIANT,VARIANT,...]]`` (4 Llama-8B blocks, default compile) or ``... 125m`` (4 blocks of the
125M model under ``reduce-overhead``); torchao installed. The JSON is written after every round."""
import json
import statistics
import sys

from mxtrain import bench_step

BASE = "torchao-tensorwise"


def main(out: str, which: str, rounds: int = 3, variants: tuple = (BASE, "fp8")) -> dict:
    kw = {} if which == "8b" else dict(model="125m", compile_mode="reduce-overhead")
    variants = list(variants) if BASE in variants else [BASE, *variants]
    res = {"bf16": bench_step.measure(["bf16"], **kw)["runs"]["bf16"], "rounds": []}
    print(which, "bf16", round(res["bf16"]["ms"], 2), flush=True)
    for r in range(rounds):
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        runs = {}
        for v in order:
            runs[v] = bench_step.measure([v], **kw)["runs"][v]
            ms = runs[v].get("ms_all") or [0]
            print(which, r, v, round(runs[v].get("ms", 0), 2), round(min(ms), 2), round(max(ms), 2),
                  round(runs[v].get("peak_gib", 0), 2), runs[v].get("error", ""), flush=True)
        res["rounds"].append({"order": order, "runs": runs})
        with open(out, "w") as f:
            json.dump(res, f, default=str)
    res["median_vs_torchao"] = {}
    for v in variants:
        rat = [rr["runs"][BASE]["ms"] / rr["runs"][v]["ms"] for rr in res["rounds"]
               if "ms" in rr["runs"].get(v, {}) and "ms" in rr["runs"].get(BASE, {})]
        if rat:
            res["median_vs_torchao"][v] = statistics.median(rat)
            print(which, v, "vs", BASE, "median", round(statistics.median(rat), 4), [round(x, 4) for x in rat])
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3,
         tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else (BASE, "fp8"))
