"""mxtrain's ``fp8`` recipe against torchao's float8 tensorwise, alternated in one process (BENCHMARKS.md, "The
`fp8` recipe on TransformerEngine's and torchao's definition of the cast").

``bench_step.measure`` (4 blocks of the model) for bf16 once, then ``ROUNDS`` rounds of torchao tensorwise and
``fp8`` (the order swapped every round, so that neither always runs first); per round the ratio of the two
medians, and at the end the median of the rounds' ratios. Usage: ``python tools/fp8_against_torchao.py OUT.json
8b [ROUNDS]`` (4 Llama-8B blocks, default compile) or ``... 125m`` (4 blocks of the 125M model under
``reduce-overhead``); torchao installed."""
import json
import statistics
import sys

from mxtrain import bench_step


def main(out: str, which: str, rounds: int = 3) -> dict:
    kw = {} if which == "8b" else dict(model="125m", compile_mode="reduce-overhead")
    res = {"bf16": bench_step.measure(["bf16"], **kw)["runs"]["bf16"], "rounds": []}
    for r in range(rounds):
        order = ["torchao-tensorwise", "fp8"] if r % 2 == 0 else ["fp8", "torchao-tensorwise"]
        runs = bench_step.measure(order, **kw)["runs"]
        ratio = runs["torchao-tensorwise"]["ms"] / runs["fp8"]["ms"]   # > 1: fp8 faster
        res["rounds"].append({"order": order, "runs": runs, "fp8_vs_torchao": ratio})
        for v in order:
            ms = runs[v].get("ms_all") or [0]
            print(which, r, v, round(runs[v]["ms"], 2), round(min(ms), 1), round(max(ms), 1),
                  round(runs[v].get("peak_gib", 0), 2), flush=True)
        print(which, r, "fp8 vs torchao tensorwise", round(ratio, 4), flush=True)
    res["median_ratio"] = statistics.median(x["fp8_vs_torchao"] for x in res["rounds"])
    print(which, "bf16", round(res["bf16"]["ms"], 2), "median fp8 vs torchao", round(res["median_ratio"], 4))
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
