"""Write the level notebooks (one per level, all alike) and record their outputs.

    python notebooks/build.py            # write the .ipynb files from the cells below
    python notebooks/build.py --record   # ... and execute them with papermill, in place

The committed notebooks carry the outputs of a run with the default parameters: that is what
nbval compares against (``make test``), through ``notebooks/nbval_sanitize.cfg``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests.kit.front.evidence import KernelMissing, resolve_kernel  # noqa: E402  (the repo root is on sys.path only now)
from tests.kit.judging.levels import LEVELS  # noqa: E402

KERNEL = {"name": "hyper-parallel-kit", "display_name": "hyper-parallel-kit (Python 3)", "language": "python"}

PARAMETERS = """\
cases = "all"              # "all", or case ids / plan names, comma-separated: "{example}"
implementation = ""        # implementation under test: a SPEC of docs/judging.md#specs ("" is ours)
isolate = False            # fresh engines for every case (implementations with process-global state)
backend = "auto"           # "auto": nccl with CUDA, gloo on CPU
timeout = 0                # seconds per case; 0: each case's own timeout
cluster_id = ""            # join this running ipyparallel cluster (the sweep passes its own)
profile = ""               # ipyparallel profile; "hpkit" is installed by `make setup`
engines = 4                # engines to start when not joining
results_path = ""          # write the verdict summaries here (JSON), for the sweep's index"""

SETUP = """\
import pathlib
import sys

root = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "tests" / "kit").is_dir())
sys.path.insert(0, str(root))

from tests.kit import notebook as nb

selected = nb.select_cases("{level}", cases)
print(f"{{len(selected)}} {level} case(s):", ", ".join(c.id for c in selected) or "none yet")"""

CONNECT = """\
cluster = nb.connect(cluster_id, profile, engines, implementation) if selected else None
cluster"""

DEBUG = """\
## Debugging one rank

After the run every engine keeps the last case's objects: `case_ctx` (its `CaseContext`:
`checks`, `series`, `kept`), plus whatever the case passed to `ctx.keep(...)`, and
`_last_result` / `_last_traceback`. Engine *i* is rank *i*.

```python
rank1 = cluster.view(1)                                       # an ipyparallel DirectView
rank1.execute("bad = [c for c in case_ctx.checks if not c.passed]", block=True)
rank1.pull("bad", block=True)
```

or, with the `%px` magics of ipyparallel (`cluster.view().activate()` first):

```python
%%px --targets 1 --block
print(case_ctx.case.id, [c.name for c in case_ctx.checks if not c.passed])
```

Re-run one case on the same warm cluster after an edit (engines cache imported modules:
restart the kernel, or `cluster.view().execute("import importlib, ...; importlib.reload(...)")`):

```python
verdicts = nb.run_cases(cluster, nb.select_cases("{level}", "{example}"))
nb.print_verdicts(verdicts)
```"""


def _code(source: str, *tags: str):
    cell = new_code_cell(source)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def build(level: str) -> nbformat.NotebookNode:
    stem, title, scope = LEVELS[level].notebook, LEVELS[level].title, LEVELS[level].scope
    example = f"{level}-01"
    cells = [
        new_markdown_cell(
            f"# {title}\n\n{scope}.\n\n"
            "Each case runs on a warm ipyparallel cluster of torch ranks and is judged against "
            "single-device or DDP baselines with the tolerances of `tests/kit/judging/tolerances.py` "
            "(the plan's precision matrix). Headless, one case:\n\n"
            f"    papermill notebooks/{stem}.ipynb out.ipynb -p cases {example}\n\n"
            "Cells: parameters, set-up, cluster, run, where a failed case went wrong (its diagnosis), "
            "the plan's assertions (table and figures), "
            "verdicts (text, checked by nbval), every check (folded), loss curves, errors against "
            "tolerances, and a last cell that raises if anything failed."
        ),
        _code(PARAMETERS.format(example=example), "parameters"),
        _code(SETUP.format(level=level)),
        _code(CONNECT, "nbval-ignore-output"),
        _code(
            "verdicts = nb.run_cases(cluster, selected, timeout, backend, isolate) if selected else []",
            "nbval-ignore-output",
        ),
        new_markdown_cell(
            "## Where a failed case went wrong\nFor a case that failed its checks: its first divergence from "
            "the baseline (step, phase, module, ranks), found by tracing both tensor by tensor and measuring each "
            "tensor's round-off noise (`tests/kit/judging/divergence.py`); the picture draws error / threshold per "
            'module. Nothing here when every case passed. Any case, on demand: `nb.diagnose(cluster, "L3-01")`.'
        ),
        _code("nb.show_diagnoses(verdicts)", "diagnosis"),
        new_markdown_cell(
            "## The plan's assertions\nEach assertion of the case's plan row, the checks that judge it "
            "(`tests/kit/plan/`), the worst of their errors against the tolerance, and where the kit reads "
            "the plan differently; then the figures the plan names."
        ),
        _code(
            "from IPython.display import HTML\n\nHTML(nb.plans_html(verdicts))",
            "nbval-ignore-output",
            "plan-table",
        ),
        _code("nb.plot_figures(verdicts);", "nbval-ignore-output", "plan-figures"),
        new_markdown_cell(
            "## Verdicts\nThe plan's assertions, then every check of every case; `err` is the worst over ranks "
            "(what nbval compares: measured values masked, verdicts and tolerances kept)."
        ),
        _code("nb.print_verdicts(verdicts)"),
        _code("HTML(nb.checks_html(verdicts))", "nbval-ignore-output", "verdict-table"),
        new_markdown_cell(
            "## Provenance\nWhat ran on the ranks: the implementation's package file as rank 0 imported it, "
            "its checkout's commit (dirty: uncommitted changes), torch, backend, ranks, host, date, and the kit's "
            "commit."
        ),
        _code("nb.print_provenance(verdicts)", "nbval-ignore-output", "provenance"),
        new_markdown_cell(
            "## Loss per step against the baseline\nRank 0's loss of each case (crosses) over "
            "its baseline (grey); a red curve belongs to a failed case."
        ),
        _code("nb.plot_losses(verdicts);", "nbval-ignore-output"),
        new_markdown_cell(
            "## Every check's error against its tolerance\nLog scale; a dot above the green "
            "tolerance step fails (red). Exact agreement is drawn on the floor."
        ),
        _code("nb.plot_errors(verdicts);", "nbval-ignore-output"),
        new_markdown_cell(DEBUG.format(level=level, example=example)),
        _code("nb.write_results(verdicts, results_path)\nnb.raise_if_failed(verdicts)"),
    ]
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = KERNEL
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


L4_NOTEBOOK = "L4_generalization.ipynb"

L4_PARAMETERS = """\
seed = 0                   # Hypothesis seed: the same configurations everywhere
examples = 20              # configurations to draw (nbval's run in `make test` is this budget)
cover = True               # first the covering phase: the fewest configurations holding every pair of features
max_world_size = 4         # largest world size drawn (1..8; the cluster needs as many engines)
implementation = ""        # implementation under test: a SPEC of docs/judging.md#specs ("" is ours)
time_budget = 0            # seconds; stop drawing after them (0: no limit)
replay = ""                # a saved configuration to run instead: its id (runs/l4/) or a .json path
cluster_id = ""            # join this running ipyparallel cluster (the sweep passes its own)
profile = ""               # ipyparallel profile; "hpkit" is installed by `make setup`
engines = 4                # engines to start when not joining
results_path = ""          # write the summary here (JSON), for the sweep's index"""

L4_SETUP = """\
import pathlib
import sys

root = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "tests" / "kit").is_dir())
sys.path.insert(0, str(root))

from tests.kit import notebook as nb
from tests.kit.explore import report as l4"""


def build_l4() -> nbformat.NotebookNode:
    """The L4 notebook: the generalization explorer (``tests.kit.explore``)."""
    cells = [
        new_markdown_cell(
            "# L4 — generalization\n\nConfigurations of the whole `fully_shard` API drawn at random "
            "(world size and mesh, a model from a small grammar, which modules are sharded with which "
            "options, a schedule of steps and controls), after a covering phase that holds every pair of "
            "features at least once, each run on the warm cluster against what the API "
            "promises for it (`tests/kit/explore/`), and a failure shrunk by Hypothesis to its smallest "
            "configuration, saved under `runs/l4/` and replayable. Headless:\n\n"
            "    papermill notebooks/L4_generalization.ipynb out.ipynb -p examples 100 -p seed 3\n"
            "    papermill notebooks/L4_generalization.ipynb out.ipynb -p replay 1a2b3c4d5e\n\n"
            "Cells: parameters, set-up, cluster, run, summary (text, checked by nbval), what was drawn "
            "(table and plot), the minimal failing configuration, and a last cell that raises if one failed."
        ),
        _code(L4_PARAMETERS, "parameters"),
        _code(L4_SETUP),
        _code("cluster = nb.connect(cluster_id, profile, engines, implementation)\ncluster", "nbval-ignore-output"),
        _code(
            "done = l4.run(cluster, seed, examples, max_world_size, time_budget, replay, cover)", "nbval-ignore-output"
        ),
        new_markdown_cell(
            "## Summary\nHow many configurations ran (the covering phase's, then the drawn ones), the pairs of "
            "features and of option values they reached out of those the grammar allows, and how often each "
            "option came up."
        ),
        _code("print(l4.summary_text(done))"),
        new_markdown_cell("## What was drawn"),
        _code("from IPython.display import HTML\n\nHTML(l4.coverage_html(done))", "nbval-ignore-output"),
        _code("l4.plot_coverage(done);", "nbval-ignore-output"),
        new_markdown_cell("## The minimal failing configuration"),
        _code("nb.show_l4_failure(done)", "nbval-ignore-output"),
        _code("l4.write_results(done, results_path)\nl4.raise_if_failed(done)"),
    ]
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = KERNEL
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="execute with papermill, in place")
    parser.add_argument("--levels", default=",".join([*LEVELS, "L4"]), help="comma-separated levels (and L4)")
    args = parser.parse_args()
    kernel = KERNEL["name"]
    if args.record:
        try:
            kernel, note = resolve_kernel(kernel)
        except KernelMissing as exc:
            print(exc, file=sys.stderr)
            return 2
        if note:
            print(note, file=sys.stderr)
    for level in args.levels.split(","):
        path = HERE / (L4_NOTEBOOK if level == "L4" else LEVELS[level].notebook_file)
        nbformat.write(build_l4() if level == "L4" else build(level), path)
        print(f"wrote {path}")
        if args.record:
            import papermill

            papermill.execute_notebook(
                str(path), str(path), kernel_name=kernel, cwd=str(HERE), execution_timeout=1200, progress_bar=False
            )
            if kernel != KERNEL["name"]:  # the committed notebooks stay on the kit's kernel
                recorded = nbformat.read(path, as_version=4)
                recorded.metadata["kernelspec"] = KERNEL
                nbformat.write(recorded, path)
            print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
