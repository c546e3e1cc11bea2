"""``attnlens report RESULTS_DIR``: one self-contained HTML page of a benchmark run's tables and plots."""

from __future__ import annotations

import argparse

from ..viz.safetext import terminal_safe


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="turn a benchmark results directory into one HTML page",
        description=(
            "Write one self-contained HTML page (figures embedded) with the tables and plots of an "
            "`attnlens benchmark` results directory: metrics table, metric bar charts, occlusion and AOPC "
            "curves, consistency embeddings, example explanations."
        ),
    )
    p.add_argument("results_dir", metavar="RESULTS_DIR", help="directory written by `attnlens benchmark --out`")
    p.add_argument("--out", help="output HTML file (default: RESULTS_DIR/report.html)")
    p.add_argument("--examples", type=int, default=3, help="example explanations to show (default: 3; 0: none)")
    return p


def run(args: argparse.Namespace) -> int:
    from ..viz.report import write_report

    path = write_report(args.results_dir, args.out, examples=args.examples)
    print(f"wrote {terminal_safe(path, one_line=True)}")
    return 0
