"""``python -m tools.trainers torchtitan|lightning``: a real trainer on CPU ranks with torch FSDP2 and with
each implementation, step by step compared (loss and grad norm at full precision): torchtitan's llama3
debug model, or the kit's L3 decoder under Lightning's ModelParallelStrategy.

torchtitan and Lightning (pinned) live in a venv of their own, ``.venvs/trainers`` (torch held at the
project's pin); nothing of them is part of ``make test``. Writes ``runs/trainers-<time>/index.html``
and ``trainers.json``; exits 1 when an implementation owes a difference from FSDP2's run.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.kit.judging.surface import parse_implementations, parse_spec
from tests.kit.judging.tolerances import Tolerance, tolerance
from tools.trainers.assets import REPO
from tools.trainers.compare import (
    after,
    compare,
    cost,
    first_error,
    owed,
    read_steps,
    read_validations,
    validation_difference,
)
from tools.trainers.rank import SHIMS

TORCHTITAN = "torchtitan==0.3.0"
LIGHTNING = "pytorch-lightning==2.6.6"
# torchtitan imports triton (its async expert-parallel kernels) whatever runs: the CPU build has none
EXTRA = ("triton",)
VENV = REPO / ".venvs" / "trainers"


@dataclass(frozen=True)
class Config:
    """One row of a trainer's matrix: the trainer's arguments beyond the common ones, on how many ranks."""

    args: tuple[str, ...] = ()
    ranks: int = 2
    steps: int | None = None  # None: the command's --steps
    collectives: bool = False  # count each step's collectives (a dispatch mode: slower steps)
    # the rank that records: torchtitan's metrics rank, the first of the last pipeline stage's
    record_rank: int = 0
    # the precision-matrix row judging an implementation other than ours (ours: bitwise is owed)
    row: str = "FSDP 1D bf16"
    launch: str = "torchtitan"  # or "lightning": lightning_rank.py with ``args``
    note: str = ""  # what a reader of the row should know, shown under its name


def _degrees(**degrees: int) -> tuple[str, ...]:
    """``--parallelism.<name>_degree N`` for each degree given."""
    return tuple(arg for name, n in degrees.items() for arg in (f"--parallelism.{name}_degree", str(n)))


CONFIGS: dict[str, Config] = {
    "default (bf16 params / fp32 reduce / selective AC)": Config(),
    "fp32 params": Config(("--training.mixed_precision_param", "float32"), row="FSDP 1D fp32"),
    "bf16 training dtype": Config(("--training.dtype", "bfloat16")),
    "2 micro-batches accumulated": Config(("--training.global_batch_size", "8")),
    "reshard after forward: never": Config(("--parallelism.fsdp_reshard_after_forward", "never")),
    "reshard after forward: always": Config(("--parallelism.fsdp_reshard_after_forward", "always")),
    "validation every 2 steps": Config(
        (
            "--validator.enable",
            "--validator.freq",
            "2",
            "--validator.steps",
            "2",
            "--validator.dataloader.dataset",
            "c4_test",
            "--validator.dataloader.dataset_path",
            "{dataset}",
        )
    ),  # fmt: skip
    "full AC": Config(("activation-checkpoint:full",)),
    "no AC": Config(("activation-checkpoint:none",)),
    "HSDP 2 x 1": Config(_degrees(data_parallel_replicate=2, data_parallel_shard=1)),
    "HSDP 2 x 2": Config(_degrees(data_parallel_replicate=2, data_parallel_shard=2), ranks=4),
    "FSDP 2 x TP 2": Config(_degrees(data_parallel_shard=2, tensor_parallel=2), ranks=4),
    # torchtitan refuses PP beside its CUDA graphs, on by default (a no-op on the CPU)
    "PP 2 stages x FSDP 2": Config(
        (*_degrees(pipeline_parallel=2, data_parallel_shard=2), "--training.disable_cuda_graphs"),
        ranks=4,
        collectives=True,
        record_rank=2,
        note="torch's pipelining steers only its own FSDPModule: what ours gets there is in "
        "docs/api.md#under-a-pipeline-schedule",
    ),
    # context parallel splits the sequence into 2 x CP blocks of flex attention's 128
    "FSDP 2 x CP 2": Config(
        (*_degrees(data_parallel_shard=2, context_parallel=2), "--training.seq_len", "256"), ranks=4
    ),
}
SAVED_AT = 5  # the checkpointed row saves here and at its last step; each engine resumes from the other's
CHECKPOINTED = f"DCP checkpoints at steps {SAVED_AT} and {2 * SAVED_AT} resumed across engines"
CONFIGS[CHECKPOINTED] = Config(
    ("--checkpoint.enable", "--checkpoint.interval", str(SAVED_AT), "--checkpoint.folder", "checkpoint"),
    steps=2 * SAVED_AT,
)
# Lightning's ModelParallelStrategy: the kit's L3 decoder sharded in configure_model (lightning_rank.py)
LIGHTNING_CONFIGS: dict[str, Config] = {
    "fp32": Config(launch="lightning", row="FSDP 1D fp32"),
    "bf16 params / fp32 reduce": Config(("--bf16",), launch="lightning"),
}
TRAINERS = {"torchtitan": CONFIGS, "lightning": LIGHTNING_CONFIGS}
FSDP2_NEEDS = (
    "set_force_sum_reduction_for_comms(True) beside torchtitan's set_gradient_divide_factor (gloo has no PREMUL_SUM)",
)


def ensure_venv() -> Path:
    """The venv's python, torchtitan and Lightning installed there once with the project's torch pin held."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    check = subprocess.run([str(python), "-c", "import torchtitan.train, pytorch_lightning"], capture_output=True)
    if check.returncode != 0:
        pin = ["-c", str(REPO / "constraints.txt")]
        subprocess.run([str(python), "-m", "pip", "install", "-q", *pin, TORCHTITAN, LIGHTNING, *EXTRA], check=True)
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


def run(python: Path, spec: str, config: Config, out: Path, assets: tuple[Path, Path], steps: int,
        resume_from: Path | None = None) -> dict:  # fmt: skip
    """One trainer run (torchtitan, or Lightning where ``config.launch`` says so); its record, exit
    status and seconds. ``resume_from``: a checkpoint folder (``.../step-N``) copied into the run's own
    checkpoint folder, which torchtitan resumes from."""
    tokenizer, dataset = assets
    record = out / "steps.jsonl"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if resume_from is not None:
        shutil.copytree(resume_from, out / "checkpoint" / resume_from.name)
    launcher = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(config.ranks)]
    if config.launch == "lightning":
        args = [*launcher, str(Path(__file__).with_name("lightning_rank.py")), "--steps", str(steps), *config.args]
    else:
        args = [
            *launcher, str(Path(__file__).with_name("rank.py")), "--module", "llama3", "--config", "llama3_debugmodel",
            "--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(dataset),
            "--training.steps", str(steps), "--training.local_batch_size", "2", "--training.seq_len", "128",
            "--parallelism.spmd_backend", "partial_dtensor", "--debug.seed", "0", "--dump_folder", str(out),
            "--checkpoint.no-enable", "--validator.no-enable", "--metrics.log_freq", "1",
            *(arg.replace("{dataset}", str(dataset)) for arg in config.args),
        ]  # fmt: skip
    env = {**os.environ, "TRAINER_IMPLEMENTATION": spec, "TRAINER_RECORD": str(record), "TRAINER_REPO": str(REPO),
           "OMP_NUM_THREADS": "1", "TRAINER_RECORD_RANK": str(config.record_rank),
           **({"TRAINER_COLLECTIVES": "1"} if config.collectives else {})}  # fmt: skip
    started = time.monotonic()
    with open(out / "log.txt", "w") as log:
        done = subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    steps_run = read_steps(record)
    spent = cost(steps_run)
    error = first_error((out / "log.txt").read_text(errors="replace")) if done.returncode else ""
    return {"exit": done.returncode, "seconds": round(time.monotonic() - started, 1), "steps": steps_run,
            "step_seconds": spent.step_seconds, "peak_rss_mib": spent.peak_rss_mib, "error": error,
            "validations": read_validations(record)}  # fmt: skip


def checkpoint_report(python: Path, first: Path, second: Path) -> dict:
    """Two DCP checkpoints compared entry by entry, in the venv (``checkpoints.py``)."""
    script = str(Path(__file__).with_name("checkpoints.py"))
    done = subprocess.run([str(python), script, str(first), str(second)], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"entries": 0, "differences": [f"unreadable: {last}"]}
    return json.loads(done.stdout)


def across_checkpoints(python: Path, config: Config, folder: Path, name: str, spec: str, assets: tuple[Path, Path],
                       reference: dict) -> tuple[list[str], int]:  # fmt: skip
    """What differs between torch FSDP2's and ``name``'s checkpoints, entry by entry, and between
    FSDP2's steps and each engine's resumed from the other's checkpoint at ``SAVED_AT``; and how many
    entries the last checkpoint compared has."""
    problems, entries = [], 0
    for step in (SAVED_AT, config.steps):
        report = checkpoint_report(python, folder / "torch" / "checkpoint" / f"step-{step}",
                                   folder / name / "checkpoint" / f"step-{step}")  # fmt: skip
        entries = report["entries"]
        if not entries and not report["differences"]:
            problems.append(f"step-{step} checkpoint: no entries")
        if report["differences"]:
            shown = "; ".join(report["differences"][:3])
            problems.append(f"step-{step} checkpoint: {len(report['differences'])} entries differ ({shown})")
    for engine, engine_spec, source in ((name, spec, "torch"), ("torch", "torch", name)):
        saved = folder / source / "checkpoint" / f"step-{SAVED_AT}"
        resumed = run(python, engine_spec, config, folder / f"{engine}-from-{source}", assets, config.steps, saved)
        verdict = compare(after(reference["steps"], SAVED_AT), resumed["steps"], _tolerance_for(spec, config))
        if owed(verdict):
            problems.append(f"{engine} resumed from {source}'s step {SAVED_AT}: {verdict.verdict} {verdict.detail}")
    return problems, entries


def _tolerance_for(spec: str, config: Config) -> Tolerance | None:
    """Bitwise is owed by this engine's code (ours, or a checkout of it); another implementation is
    judged within the precision-matrix row of the configuration's precision."""
    return None if parse_spec(spec).adapter == "native" else tolerance(config.row)


def judged(python: Path, config: Config, folder: Path, name: str, spec: str, assets: tuple[Path, Path],
           reference: dict, steps: int) -> dict:  # fmt: skip
    """``name``'s run of one configuration with its verdict against torch FSDP2's ``reference``."""
    entry = run(python, spec, config, folder / name, assets, steps)
    tol = _tolerance_for(spec, config)
    verdict = compare(reference["steps"], entry["steps"], tol)
    entry.update(verdict=verdict.verdict, detail=verdict.detail)
    validation = validation_difference(reference.get("validations", []), entry.get("validations", []), tol)
    if validation and not owed(verdict):
        entry.update(verdict="DIFFERS", detail=validation)
    elif reference.get("validations") and not owed(verdict):
        entry["detail"] = f"{verdict.detail} {len(entry['validations'])} validations equal".strip()
    if entry["exit"] and verdict.verdict != "BITWISE":
        entry["detail"] = f"{verdict.detail}; exit {entry['exit']}: {entry['error'] or 'see its log'}"
    if config is CONFIGS[CHECKPOINTED] and not owed(verdict):
        problems, entries = across_checkpoints(python, config, folder, name, spec, assets, reference)
        if problems:
            entry.update(verdict="DIFFERS", detail="; ".join(problems))
        else:
            entry["detail"] = (f"checkpoints at steps {SAVED_AT} and {config.steps} equal entry for entry "
                               f"({entries} entries); "
                               f"each engine resumed from the other's step {SAVED_AT} continues bitwise")  # fmt: skip
    return entry


COLOURS = {"BITWISE": "#dff5df", "CLOSE": "#f3f7d8", "reference": "#f0f0f0"}  # anything else: red


def cost_text(entry: dict, reference: dict) -> str:
    """A run's median step time and peak RSS on its recording rank, with ratios to FSDP2's for another run."""
    parts = []
    for key, unit, digits in (("step_seconds", "s a step", 2), ("peak_rss_mib", "MiB peak RSS", 0)):
        value, base = entry.get(key), reference.get(key)
        if value is None:
            continue
        ratio = f" ({value / base:.2f}x)" if entry is not reference and base else ""
        parts.append(f"{value:.{digits}f} {unit}{ratio}")
    return ", ".join(parts)


def collectives_text(entry: dict) -> str:
    """The collectives the recording rank issued in the run's last step, by kind ('' where not counted)."""
    counted = [step["collectives"] for step in entry.get("steps", []) if "collectives" in step]
    if not counted:
        return ""
    return "last step's collectives: " + ", ".join(f"{kind} {n}" for kind, n in counted[-1].items())


def page(results: dict) -> str:
    """The results as one HTML table: configuration x implementation, each cell its verdict."""
    trainer = results.get("trainer", TORCHTITAN)
    names = list(results["implementations"])
    rows = []
    for config, runs in results["configs"].items():
        reference = runs["torch"]
        shape = f"{reference['ranks']} ranks, {reference['steps_asked']} steps" if "ranks" in reference else ""
        note = reference.get("note", "")
        about_row = html.escape(shape) + (f"<br><em>{html.escape(note)}</em>" if note else "")
        cells = [f"<td>{html.escape(config)}<br><small>{about_row}</small></td>"]
        for name in ["torch", *names]:
            entry = runs[name]
            failed_reference = f"exit {entry['exit']}: {entry.get('error') or 'see its log'}"
            shown = entry.get("verdict", "reference" if entry["exit"] == 0 else failed_reference)
            colour = COLOURS.get(shown.split()[0], "#fce4e4")
            spent = "; ".join(filter(None, (cost_text(entry, runs["torch"]), collectives_text(entry))))
            log = f" <a href='{html.escape(entry['log'])}'>log</a>" if "log" in entry else ""
            verdict = f"{html.escape(shown)} {html.escape(entry.get('detail', ''))}"
            text = f"{verdict}<br><small>{html.escape(spent)}{log}</small>"
            cells.append(f"<td style='background:{colour}'>{text}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{html.escape(n)}</th>" for n in ["configuration", "torch FSDP2", *names])
    about = f"seeded, torch {results.get('torch', '?')}, gloo"
    shims = "".join(f"<li>{html.escape(s)}</li>" for s in results["shims"])
    needs = "".join(f"<li>{html.escape(s)}</li>" for s in results["fsdp2_needs"])
    return (
        f"<!doctype html><meta charset=utf-8><title>{html.escape(trainer.split('==')[0])} as a judge</title>"
        f"<h1>{html.escape(trainer.replace('==', ' '))}: torch FSDP2 and each implementation on CPU ranks</h1>"
        f"<p>{html.escape(about)}; each cell: every step's loss and grad norm against torch FSDP2's; "
        "below it, the recording rank's median step time and peak RSS (against FSDP2's: runs one after another "
        "on shared cores, so a few per cent is noise)</p>"
        f"<table border=1 cellpadding=4><tr>{head}</tr>"
        + "".join(rows)
        + f"</table><h2>Shims (CPU and torch, every engine alike)</h2><ul>{shims}</ul>"
        f"<h2>torch FSDP2's own needs on gloo</h2><ul>{needs}</ul>"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.trainers", description=__doc__.splitlines()[0])
    parser.add_argument("trainer", choices=list(TRAINERS))
    parser.add_argument("--implementation", action="append", default=[], metavar="NAME=SPEC",
                        help="repeatable; SPEC: docs/judging.md#specs ('' is ours, the default)")  # fmt: skip
    parser.add_argument("--configs", default="", help="comma-separated configuration names (default: all)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        implementations = parse_implementations(args.implementation or ["ours="])
    except ValueError as error:
        parser.error(str(error))
    rows = TRAINERS[args.trainer]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] or list(rows)
    unknown = [c for c in configs if c not in rows]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; {args.trainer}'s: {list(rows)}")
    out = Path(args.out or REPO / "runs" / f"trainers-{time.strftime('%Y%m%d-%H%M%S')}")
    python = ensure_venv()
    titan = args.trainer == "torchtitan"
    assets = prepared_assets(python) if titan else (Path(), Path())  # Lightning's data is the kit's
    results: dict = {"trainer": TORCHTITAN if titan else LIGHTNING, "implementations": implementations,
                     "shims": list(SHIMS) if titan else [], "fsdp2_needs": list(FSDP2_NEEDS) if titan else [],
                     "steps": args.steps, "torch": _torch_of(python), "configs": {}}  # fmt: skip
    failed = False
    out.mkdir(parents=True, exist_ok=True)
    for number, config_name in enumerate(configs):
        config, folder = rows[config_name], out / f"c{number}"
        steps = config.steps or args.steps
        runs = {"torch": run(python, "torch", config, folder / "torch", assets, steps)}
        for name, spec in implementations.items():
            runs[name] = judged(python, config, folder, name, spec, assets, runs["torch"], steps)
            failed |= runs[name]["verdict"] not in ("BITWISE", "CLOSE") and runs["torch"]["exit"] == 0
            print(f"[{config_name}] {name}: {runs[name]['verdict']} {runs[name]['detail']}", flush=True)
        for name, entry in runs.items():
            entry["log"] = f"{folder.name}/{name}/log.txt"  # the page's link, relative to it
            entry["ranks"], entry["steps_asked"], entry["note"] = config.ranks, steps, config.note
        results["configs"][config_name] = runs
        (out / "trainers.json").write_text(json.dumps(results, indent=1))
        (out / "index.html").write_text(page(results))
    print(f"page: {out / 'index.html'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
