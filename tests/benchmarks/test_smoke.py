"""Every benchmark runs at a tiny size, as its user would run it (``python -m benchmarks.NAME``),
so that a change that breaks one fails here rather than when someone next measures.

Each runs in a process of its own against this session's PostgreSQL and Redis (a database of
its own, dropped after), writes its result file into a temporary folder
(``BENCHMARK_RESULTS_DIR``: the published figures are never replaced) and must end with a JSON
line naming it and holding its headline fields. The figures of a tiny run mean nothing and
are not checked, only that they are there and of the right kind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT

# name -> (tiny arguments, the fields its final line must hold)
BENCHMARKS = {
    "ingest": (["--docs", "4", "--rounds", "1"], ["pipeline_chunks_per_s", "embed_only_chunks_per_s", "ratio"]),
    "text_analysis": (
        ["--texts", "4", "--rounds", "1"],
        ["analyser_mb_per_s", "embedder_texts_per_s", "single_text_cpu_ms", "single_text_max_abs_diff"],
    ),
    "search_scale": (["--n", "400", "--queries", "4", "--passages", "60"], ["recall@10", "hybrid_p50_ms"]),
    "permissions": (
        ["--n", "1000", "--queries", "4", "--passages", "60"],
        ["recall_vs_visible_10pct", "recall_vs_visible_1pct", "p99_ratio_10pct", "p99_ratio_1pct"],
    ),
    "cost_dashboard": (["--rows", "3000", "--runs", "1"], ["rows", "summary_ms", "comparison_ms"]),
    "worker_routing_cost": (
        ["--requests", "4", "--warmup", "2", "--breakdown", "4"],
        ["direct_kept_p50_ms", "routed_p50_ms", "routing_cost_p50_ms", "routing_cost_p99_ms"],
    ),
    "gateway_overhead": (
        "--requests 4 --warmup 2 --levels 1,3 --level-seconds 1 --token-delay-ms 10".split(),
        [
            "direct_ttft_p50_ms",
            "gateway_ttft_p50_ms",
            "overhead_ttft_p50_ms",
            "overhead_ttft_p99_ms",
            "direct_total_p50_ms",
            "gateway_total_p50_ms",
            "breakdown_p50_ms",
            "levels",
            "ledger",
        ],
    ),
    "load": (
        "--levels 1 --level-seconds 2 --settle-seconds 0.5 --docs 4 --keys 2 --queries 3".split(),
        ["scenarios", "peak_ok_rps"],
    ),
    "specdec": (
        "--target-layers 2 --draft-layers 1 --width 64 --tokens 8 --prompts 1 --rounds 1".split(),
        ["methods"],
    ),
    "scale_out": (
        "--seconds 6 --clients 2 --docs 4 --drain-seconds 90".split(),
        ["requests", "ok", "failed", "lost", "duplicate_ledger_rows", "latency_ms", "kills"],
    ),
    # The in-house engine behind the OpenAI protocol through the real gpu queue; vLLM's own
    # servers are exercised by tests/inference/test_vllm_pool.py.
    "gpu_pool": (["--quick", "--configs", "inhouse", "--levels", "1"], ["configurations", "levels"]),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_the_benchmark_runs_at_a_tiny_size(name, tmp_path):
    arguments, fields = BENCHMARKS[name]
    env = dict(os.environ, BENCHMARK_RESULTS_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *arguments],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    final = json.loads(run.stdout.strip().splitlines()[-1])
    assert final["benchmark"] == name
    missing = [field for field in fields if field not in final]
    assert missing == [], f"{name}'s final line lacks {missing}: {sorted(final)}"
    for field in fields:
        assert final[field] not in (None, "", [], {}), f"{name}: {field} is empty"
    if name == "scale_out":  # not a figure: what the system accepted, it finished, once, whatever was killed
        lost = {key: final[key] for key in ("lost_uploads", "lost_answers", "failures", "kills", "drained_s")}
        assert (final["lost"], final["duplicate_ledger_rows"], final["chunks_duplicated"]) == (0, 0, 0), lost
        assert final["unacknowledged"]["unfinished"] == [], final
        assert len(final["kills"]) == 3 and final["processes_dead_at_the_end"] == [], final
    if name != "gpu_pool":  # --quick prints its line without writing a result file
        assert json.loads((tmp_path / f"{name}.json").read_text()) == final
