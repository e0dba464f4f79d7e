"""Figures derived from saved result files (no measuring): the analyses docs/BENCHMARKS.md quotes from them.

- `profile-job-ratio FILE...`: per profile_overhead row, the profile-only ratio and the ratio a job pays,
  (profile + hardware probe + first use) / iteration, from the file's `hardware_probe_s` and
  `first_profile_in_process_s` (files written before `job_ratio` was saved).
- `prediction-headline FILE...`: per predict_vs_measure file, rows within 10% in each trial and by the
  per-configuration median, the worst single-trial error and the largest load drift over the trials
  (taken from the trials' summaries: combined summaries written before the fix report 0.0 drift).
- `phase-errors FILE...`: per predict_vs_measure file run with `--breakdown` (plans kept: multi-rank runs), the
  median over its rank-rows of measured minus predicted ms for the iteration and each phase and counter the
  breakdown line prints, and of the managed overhead: the iteration less the plain one measured beside it
  (`plain_now_s`), against the prediction less its compute terms; the measured overhead split into the
  runtime's entry points (its outermost sections) and the rest, outside them (autograd calling the hooks,
  kernels slowed by the runtime's copies: what the runtime probe's `offload_outside_s` stands for).

Usage: .venv/bin/python benchmarks/reread_results.py profile-job-ratio benchmarks/results/profile_overhead_threads1.json
       .venv/bin/python benchmarks/reread_results.py prediction-headline benchmarks/results/predict_vs_measure.json
       .venv/bin/python benchmarks/reread_results.py phase-errors benchmarks/results/predict_vs_measure-2026*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

# the runtime's outermost sections: entry points torch or the loop calls (the moves run inside them)
from agent.runtime.timing import ENTRY_POINTS


def job_ratios(doc: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(model, profile-only ratio, ratio a job pays) per row."""
    fixed = doc["hardware_probe_s"] + doc["first_profile_in_process_s"]
    return [(r["model"], r["ratio"], (r["profile_s"] + fixed) / r["iteration_s"]) for r in doc["rows"]]


def prediction_headline(doc: dict[str, Any]) -> dict[str, Any]:
    trials = doc.get("trials") or [doc["summary"]]
    combined = doc.get("combined")
    return {
        "rows": trials[0]["rows"],
        "within_10pct_per_trial": [t["iteration_within_10pct"] for t in trials],
        "within_10pct_median_of_trials": combined["summary"]["iteration_within_10pct"] if combined else None,
        "worst_single_trial_error": max(t["iteration_error_max_abs"] for t in trials),
        "largest_drift_over_trials": max((t["load_drift_max_abs"] or 0.0) for t in trials),
        "peak_within_target_per_trial": [t["peak_within_target"] for t in trials],
    }


PHASES = ("iteration", "forward", "backward", "step")
COUNTERS = ("host_step", "grad_reduction", "control")


def phase_errors(doc: dict[str, Any]) -> dict[str, Any] | None:
    """Medians over the file's rank-rows with a breakdown and a plan (None: none has both), in ms. The plan is
    kept on rank 0's row only (every rank runs it): the other ranks' rows read it from there."""
    config_of = lambda r: (r.get("trial"), r.get("kind"), r.get("layers"), r.get("fraction"))  # noqa: E731
    plans = {config_of(r): r["plan"] for r in doc["rows"] if r.get("plan")}
    rows = [
        {**r, "plan": plans[config_of(r)]}
        for r in doc["rows"]
        if r.get("breakdown") and config_of(r) in plans
    ]
    if not rows:
        return None
    diffs: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        diffs.setdefault(key, []).append(value)

    for r in rows:
        bd, pred = r["breakdown"], r["plan"]["predictions"]
        measured, predicted, counters = bd["measured_ms"], bd["predicted_ms"], bd["counters_ms"]
        for k in PHASES:
            add(k, measured[k] - predicted[k])
        for k in COUNTERS:
            add(k, counters.get(k, 0.0) - predicted.get(k, 0.0))
        terms = pred["breakdown"]
        compute_ms = 1e3 * (terms["forward_compute_s"] + terms["backward_compute_s"] + terms["recompute_s"])
        overhead = measured["iteration"] - 1e3 * r["plain_now_s"]
        entry = sum(v for k, v in bd["sections_ms"].items() if k in ENTRY_POINTS)
        add("overhead_predicted", 1e3 * pred["iteration_s"] - compute_ms)
        add("overhead_measured", overhead)
        add("overhead_entry_points", entry)
        add("overhead_outside", overhead - entry)
        add("plain_now_less_profiled", 1e3 * (r["plain_now_s"] - r["trace_iteration_s"]))
    return {
        "cpu": doc["machine"]["cpu"],
        "world_size": doc["args"].get("world_size") or 1,
        "rank_rows": len(rows),
        # what `_results.switches` recorded; None in files from before session 33 (not recorded)
        "switches": doc.get("switches"),
        "median_ms": {k: statistics.median(v) for k, v in diffs.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("analysis", choices=["profile-job-ratio", "prediction-headline", "phase-errors"])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.files:
        doc = json.loads(path.read_text())
        if args.analysis == "profile-job-ratio":
            rows = job_ratios(doc)
            print(
                f"{path}: probe {doc['hardware_probe_s']:.2f} s, first use {doc['first_profile_in_process_s']:.2f} s; "
                f"rows over 10 as a job pays: {sum(j > 10 for _, _, j in rows)}/{len(rows)}"
            )
            for model, ratio, job in rows:
                print(f"  {model:<16} profile only {ratio:6.2f}   what a job pays {job:6.2f}")
        elif args.analysis == "phase-errors":
            errors = phase_errors(doc)
            if errors is None:
                print(f"{path}: no row with a breakdown and a plan")
                continue
            m = errors["median_ms"]
            switched = errors["switches"]
            print(
                f"{path.name}: {errors['cpu']}, {errors['world_size']} rank(s), {errors['rank_rows']} rank-rows; "
                + (
                    "switches not recorded; "
                    if switched is None
                    else "".join(f"{k}={'default' if v is None else v}; " for k, v in switched.items())
                )
                + "measured - predicted ms (medians): "
                + ", ".join(f"{k} {m[k]:+.1f}" for k in (*PHASES, *COUNTERS))
                + f"; overhead predicted {m['overhead_predicted']:.1f}, measured {m['overhead_measured']:.1f} = "
                f"entry points {m['overhead_entry_points']:.1f} + outside {m['overhead_outside']:.1f}; plain "
                f"iteration now - profiled {m['plain_now_less_profiled']:+.1f}"
            )
        else:
            print(f"{path}: {json.dumps(prediction_headline(doc))}")


if __name__ == "__main__":
    main()
