"""Figures derived from saved result files (no measuring): the analyses docs/BENCHMARKS.md quotes from them.

- `profile-job-ratio FILE...`: per profile_overhead row, the profile-only ratio and the ratio a job pays,
  (profile + hardware probe + first use) / iteration, from the file's `hardware_probe_s` and
  `first_profile_in_process_s` (files written before `job_ratio` was saved).
- `prediction-headline FILE...`: per predict_vs_measure file, rows within 10% in each trial and by the
  per-configuration median, the worst single-trial error and the largest load drift over the trials
  (taken from the trials' summaries: combined summaries written before the fix report 0.0 drift).

Usage: .venv/bin/python benchmarks/reread_results.py profile-job-ratio benchmarks/results/profile_overhead_threads1.json
       .venv/bin/python benchmarks/reread_results.py prediction-headline benchmarks/results/predict_vs_measure.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("analysis", choices=["profile-job-ratio", "prediction-headline"])
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
        else:
            print(f"{path}: {json.dumps(prediction_headline(doc))}")


if __name__ == "__main__":
    main()
