"""``python -m tools.trainers torchtitan``: torchtitan's llama3 debug model trained on 2 CPU ranks with
torch FSDP2 and with each implementation, step by step compared (loss and grad norm at full precision).

torchtitan (pinned) lives in a venv of its own, ``.venvs/trainers`` (torch held at the project's pin);
nothing of it is part of ``make test``. Writes ``runs/trainers-<time>/index.html`` and ``trainers.json``;
exits 1 when an implementation's run differs from FSDP2's in a configuration where bitwise is owed.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.trainers.assets import REPO
from tools.trainers.compare import compare, owed, read_steps
from tools.trainers.rank import SHIMS

TORCHTITAN = "torchtitan==0.3.0"
# torchtitan imports triton (its async expert-parallel kernels) whatever runs: the CPU build has none
EXTRA = ("triton",)
VENV = REPO / ".venvs" / "trainers"
# configuration -> torchtitan arguments beyond the common ones
CONFIGS: dict[str, tuple[str, ...]] = {
    "default (bf16 params / fp32 reduce / selective AC)": (),
    "fp32 params": ("--training.mixed_precision_param", "float32"),
    "2 micro-batches accumulated": ("--training.global_batch_size", "8"),
    "reshard after forward: never": ("--parallelism.fsdp_reshard_after_forward", "never"),
    "reshard after forward: always": ("--parallelism.fsdp_reshard_after_forward", "always"),
    "HSDP (2, 1)": (
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ),
}
FSDP2_NEEDS = (
    "set_force_sum_reduction_for_comms(True) beside torchtitan's set_gradient_divide_factor (gloo has no PREMUL_SUM)",
)


def ensure_venv() -> Path:
    """The venv's python, torchtitan installed there once with the project's torch pin held."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    check = subprocess.run([str(python), "-c", "import torchtitan.train"], capture_output=True)
    if check.returncode != 0:
        pin = ["-c", str(REPO / "constraints.txt")]
        subprocess.run([str(python), "-m", "pip", "install", "-q", *pin, TORCHTITAN, *EXTRA], check=True)
    return python


def _torch_of(python: Path) -> str:
    """The torch release the venv runs."""
    done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def prepared_assets(python: Path) -> tuple[Path, Path]:
    """The tokenizer and dataset torchtitan reads, made in its venv (``tokenizers`` lives there)."""
    folder = REPO / "runs" / "trainers-assets"
    code = "import sys, pathlib, tools.trainers.assets as a; a.make_assets(pathlib.Path(sys.argv[1]))"
    subprocess.run([str(python), "-c", code, str(folder)], cwd=REPO, check=True)
    return folder / "tokenizer", folder / "c4_test"


def run(python: Path, spec: str, config: str, out: Path, assets: tuple[Path, Path], steps: int) -> dict:
    """One torchtitan run on 2 CPU ranks; its record, exit status and seconds."""
    tokenizer, dataset = assets
    record = out / "steps.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    args = [
        str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(Path(__file__).with_name("rank.py")), "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(dataset),
        "--training.steps", str(steps), "--training.local_batch_size", "2", "--training.seq_len", "128",
        "--parallelism.spmd_backend", "partial_dtensor", "--debug.seed", "0", "--dump_folder", str(out),
        "--checkpoint.no-enable", "--validator.no-enable", "--metrics.log_freq", "1", *CONFIGS[config],
    ]  # fmt: skip
    env = {**os.environ, "TRAINER_IMPLEMENTATION": spec, "TRAINER_RECORD": str(record), "TRAINER_REPO": str(REPO),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    started = time.monotonic()
    with open(out / "log.txt", "w") as log:
        done = subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    return {"exit": done.returncode, "seconds": round(time.monotonic() - started, 1), "steps": read_steps(record)}


COLOURS = {"BITWISE": "#dff5df", "CLOSE": "#f3f7d8", "reference": "#f0f0f0"}  # anything else: red


def page(results: dict) -> str:
    """The results as one HTML table: configuration x implementation, each cell its verdict."""
    names = list(results["implementations"])
    rows = []
    for config, runs in results["configs"].items():
        cells = [f"<td>{html.escape(config)}</td>"]
        for name in ["torch", *names]:
            entry = runs[name]
            shown = entry.get("verdict", "reference" if entry["exit"] == 0 else f"exit {entry['exit']}")
            colour = COLOURS.get(shown.split()[0], "#fce4e4")
            text = f"{html.escape(shown)} {html.escape(entry.get('detail', ''))}"
            cells.append(f"<td style='background:{colour}'>{text}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{html.escape(n)}</th>" for n in ["configuration", "torch FSDP2", *names])
    about = f"{results.get('steps', '?')} steps each, seeded, torch {results.get('torch', '?')}, gloo"
    shims = "".join(f"<li>{html.escape(s)}</li>" for s in results["shims"])
    needs = "".join(f"<li>{html.escape(s)}</li>" for s in results["fsdp2_needs"])
    return (
        "<!doctype html><meta charset=utf-8><title>torchtitan as a judge</title>"
        f"<h1>{html.escape(TORCHTITAN.replace('==', ' '))}: torch FSDP2 and each implementation, 2 CPU ranks</h1>"
        f"<p>{html.escape(about)}; each cell: every step's loss and grad norm against torch FSDP2's</p>"
        f"<table border=1 cellpadding=4><tr>{head}</tr>"
        + "".join(rows)
        + f"</table><h2>Shims (CPU and torch, every engine alike)</h2><ul>{shims}</ul>"
        f"<h2>torch FSDP2's own needs on gloo</h2><ul>{needs}</ul>"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.trainers", description=__doc__.splitlines()[0])
    parser.add_argument("trainer", choices=["torchtitan"])
    parser.add_argument("--implementation", action="append", default=[], metavar="NAME=SPEC",
                        help="repeatable; SPEC: docs/judging.md#specs ('' is ours, the default)")  # fmt: skip
    parser.add_argument("--configs", default="", help="comma-separated configuration names (default: all)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    implementations = dict(item.split("=", 1) for item in (args.implementation or ["ours="]))
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] or list(CONFIGS)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    out = Path(args.out or REPO / "runs" / f"trainers-{time.strftime('%Y%m%d-%H%M%S')}")
    python = ensure_venv()
    assets = prepared_assets(python)
    results: dict = {"implementations": implementations, "shims": list(SHIMS), "fsdp2_needs": list(FSDP2_NEEDS),
                     "steps": args.steps, "torch": _torch_of(python), "configs": {}}  # fmt: skip
    failed = False
    for number, config in enumerate(configs):
        runs = {"torch": run(python, "torch", config, out / f"c{number}" / "torch", assets, args.steps)}
        for name, spec in implementations.items():
            entry = run(python, spec, config, out / f"c{number}" / name, assets, args.steps)
            verdict = compare(runs["torch"]["steps"], entry["steps"], None)
            entry.update(verdict=verdict.verdict, detail=verdict.detail)
            failed |= owed(verdict) and runs["torch"]["exit"] == 0
            runs[name] = entry
            print(f"[{config}] {name}: {verdict.verdict} {verdict.detail}", flush=True)
        results["configs"][config] = runs
        out.mkdir(parents=True, exist_ok=True)
        (out / "trainers.json").write_text(json.dumps(results, indent=1))
        (out / "index.html").write_text(page(results))
    print(f"page: {out / 'index.html'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
