"""kernel_bench's tile sweeps, shared by W4A16 and W8A8: paste-able config reprs, the per-bucket
pick (smallest geometric-mean slowdown against each point's best), and the printed report with a
suggested dispatch table."""

from __future__ import annotations

import math

from slimserve.eval.kernels.common import Ctx, print_table


def cfg_repr(c) -> str:
    """A paste-able constructor call of a W4A16Config / W8A8Config."""
    name = type(c).__name__
    if name == "W4A16Config":
        return (
            f'W4A16Config("{c.path}", {c.block_m}, {c.block_n}, {c.block_k}, '
            f"split_k={c.split_k}, num_warps={c.num_warps}, num_stages={c.num_stages})"
        )
    return (
        f"W8A8Config({c.block_m}, {c.block_n}, {c.block_k}, group_m={c.group_m}, "
        f"num_warps={c.num_warps}, num_stages={c.num_stages}, split_k={c.split_k})"
    )


def suggest(times: dict, buckets: list) -> list[dict]:
    """Per bucket (bound, [points]) of a dispatch table, the candidate with the smallest
    geometric-mean slowdown against each point's best, among those measured at every point of
    the bucket; adjacent buckets with the same pick merge into the larger bound.

    times: {point: {config: us}} (failed or invalid candidates absent). Returns
    [{"bound", "config", "geo_slowdown", "worst_slowdown"}]; a bucket with no common candidate
    gets config None."""
    picks = []
    for bound, points in buckets:
        points = [pt for pt in points if times.get(pt)]
        common = set.intersection(*(set(times[pt]) for pt in points)) if points else set()
        best = None
        for cfg in sorted(common):
            slow = [times[pt][cfg] / min(times[pt].values()) for pt in points]
            geo = math.exp(sum(map(math.log, slow)) / len(slow))
            if best is None or geo < best["geo_slowdown"]:
                best = {"config": cfg, "geo_slowdown": geo, "worst_slowdown": max(slow)}
        picks.append({"bound": bound, **(best or {"config": None})})
    merged = []
    for pk in picks:
        if merged and pk["config"] is not None and merged[-1]["config"] == pk["config"]:
            merged[-1] = {
                **pk,
                "geo_slowdown": max(pk["geo_slowdown"], merged[-1]["geo_slowdown"]),
                "worst_slowdown": max(pk["worst_slowdown"], merged[-1]["worst_slowdown"]),
            }
        else:
            merged.append(pk)
    return merged


def _sweep_points(records: list[dict]) -> tuple[dict, list[dict]]:
    """({(M, N, K): {config: us}} of valid timings, per-point best vs default rows)."""
    times, best_rows = {}, []
    for r in records:
        if r.get("us") and r.get("valid", True):
            times.setdefault((r["M"], r["N"], r["K"]), {})[r["config"]] = r["us"]
    for pt, cands in times.items():
        dflt = next((r for r in records if (r["M"], r["N"], r["K"]) == pt and r["default"]), None)
        best = min(cands, key=cands.get)
        d_us = dflt.get("us") if dflt else None
        best_rows.append(
            {
                "M": pt[0],
                "N": pt[1],
                "K": pt[2],
                "best_us": cands[best],
                "default_us": d_us,
                "ratio": d_us / cands[best] if d_us else None,
                "within_10pct": bool(d_us and d_us <= 1.1 * cands[best]),
                "best": best,
            }
        )
    return times, sorted(best_rows, key=lambda r: (r["N"], r["K"], r["M"]))


def report_sweep(
    ctx: Ctx,
    name: str,
    records: list[dict],
    buckets: list,
    head: str,
    opener: str,
    fmt_bound,
    current: dict | None = None,
) -> list:
    """Print the per-point table, the failed candidates and a paste-able suggested table
    (a bucket without measurements keeps its `current` row)."""
    times, best_rows = _sweep_points(records)
    bad = [r for r in records if r.get("error") or r.get("valid") is False]
    skipped = sum(1 for r in records if r.get("skipped"))
    print_table(
        f"{name} tuning sweep: best config per (M, N, K); is the default within 10%?",
        [
            ("M", "M", 6, ""),
            ("N", "N", 6, ""),
            ("K", "K", 6, ""),
            ("default_us", "default us", 11, ".1f"),
            ("best_us", "best us", 9, ".1f"),
            ("ratio", "dflt/best", 9, ".2f"),
            ("within_10pct", "<=10%", 6, ""),
            ("best", "best config", 0, ""),
        ],
        best_rows,
    )
    for r in bad:
        print(
            f"  {'WRONG OUTPUT' if r.get('valid') is False else 'FAILED'}: M={r['M']} "
            f"N={r['N']} K={r['K']} {r['config']} {r.get('error', '')}"
        )
    if skipped:
        print(f"  {skipped} candidates skipped at the section's time limit")
    picks = suggest(times, [(b, [pt for pt in times if pt[0] in ms]) for b, ms in buckets])
    print(f"\n{head}\n{opener}")
    for pk in picks:
        if pk["config"] is not None:
            print(
                f"    ({fmt_bound(pk['bound'])}, {pk['config']}),  # geo-mean "
                f"{pk['geo_slowdown']:.2f}x of best, worst {pk['worst_slowdown']:.2f}x"
            )
        elif (current or {}).get(pk["bound"]):
            print(
                f"    ({fmt_bound(pk['bound'])}, {current[pk['bound']]}),  # not measured: "
                "current row"
            )
    print(")" if opener.endswith("(") else "", flush=True)
    ctx.res["suggestions"][name] = {"best": best_rows, "table": picks}
    ctx.save()
    return picks
