"""The benchmark at one rank, end to end: every trainer it times (ours, FSDP2, the plain model and the
DTensor floor) trains the same steps, so its ratios compare like with like."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_fsdp2.py"


def run_one_rank(tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """The decoder, one sample, one warm-up and one timed step, at world size 1."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "BENCH_NPROC": "1"}
    args = ["--models", "decoder", "--batch", "1", "--warmup", "1", "--steps", "1", "--threads", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args, "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, json.loads(out.read_text()) if out.exists() else {}


def test_one_rank_trains_the_floor_and_the_plain_model_as_the_engines(tmp_path):
    done, result = run_one_rank(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (model,) = result["models"]
    assert sorted(model["engines"]) == ["floor", "fsdp2", "ours", "plain"]
    # the floor's optimizer steps DTensor views of the plain model's params: it must train that model
    # as the others train theirs (a view that copies, or a grad left behind, leaves it untrained)
    assert model["loss_max_abs_diff"] == 0.0, model
    for name, numbers in model["engines"].items():  # where each step's CPU time goes, part by part
        assert all(numbers[f"{part}_cpu_ms"] > 0 for part in ("forward", "backward", "optimizer")), name
    assert "DTensor floor, process CPU (median)" in done.stdout
    assert "ours/floor" in done.stdout and "losses agree" in done.stdout


def load_bench():
    """The benchmark script as a module (imported, it runs nothing)."""
    spec = importlib.util.spec_from_file_location("bench_fsdp2", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_one_rank_verdict_tells_the_engines_cost_from_the_floors():
    verdict = load_bench().one_rank_verdict
    assert "within the target" in verdict(104.0, 101.0, 100.0)
    assert "which the DTensor floor alone (1.080) already is" in verdict(110.0, 108.0, 100.0)
    assert "OVER the target" in verdict(110.0, 102.0, 100.0)
