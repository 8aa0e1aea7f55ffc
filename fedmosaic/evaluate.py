"""``fedmosaic eval RUN_DIR``: batch offline evaluation in the layout of paper 000's Table 1.

Every client's personalized model (global + local mixed per row at ``(1 - a, a)``, or its local or the
global adapter alone, whichever the run has) generates on the test set of every task; the global model
and the bare base model do too. Predictions are cached per (checkpoint, model, task) as JSONL written
batch by batch, so an interrupted evaluation resumes where it stopped. Then ROUGE-1/ROUGE-L/exact
scores, the Personalization and Test-Time Personalization blocks (Markdown + JSON), and PNG plots.
Generation goes through the serving package only (:mod:`serving.generation`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from adapters.rundir import RunDir
from training.evaluation import plots, tables
from training.evaluation.metrics import METRICS, Scores, score
from training.evaluation.predictions import PredictionCache

GenerateFn = Callable[[Sequence[str], Sequence[str], list[list[float]]], list[str]]


@dataclass(frozen=True)
class EvalOptions:
    """Settings of one evaluation.

    Attributes:
        limit: test examples per task (None: all).
        max_new_tokens: generation budget per answer.
        num_beams: 1 greedy (default); the FedDPA reference used 4.
        batch_size: prompts per generation batch.
        metric: the table's metric: ``rouge1`` (paper), ``rougeL`` or ``exact``.
        data: data set spec overriding run.json's.
        model: base model overriding run.json's.
        per_round: also score the global adapter of every per-round checkpoint (paper Figure 3).
        dtype: compute dtype (None: the setting's default).
    """

    limit: int | None = None
    max_new_tokens: int = 64
    num_beams: int = 1
    batch_size: int = 8
    metric: str = "rouge1"
    data: str | None = None
    model: str | None = None
    per_round: bool = False
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")


def model_specs(
    run: RunDir, clients: Sequence[str], inference_weight: float
) -> dict[str, tuple[tuple[str, ...], list[float]]]:
    """Adapter names and weights of every model key: each client, ``global``, ``base``."""
    has_global = run.global_adapter.is_dir()
    specs: dict[str, tuple[tuple[str, ...], list[float]]] = {}
    for c in clients:
        has_local = run.local_adapter(c).is_dir()
        if has_global and has_local:
            specs[c] = (("global", f"local-{c}"), [1.0 - inference_weight, inference_weight])
        elif has_local:
            specs[c] = ((f"local-{c}",), [1.0])
        elif has_global:
            specs[c] = (("global",), [1.0])
    if has_global:
        specs["global"] = (("global",), [1.0])
    specs["base"] = ((), [])
    return specs


def _default_generate(run: RunDir, cfg: dict, opts: EvalOptions, clients: Sequence[str]) -> GenerateFn:
    from adapters import inject, load_adapter
    from fedmosaic.models import load_base_model
    from serving.generation import GenerationConfig, generate

    loaded = load_base_model(opts.model or cfg.get("model", "smollm2"), dtype=opts.dtype)  # type: ignore[arg-type]
    adapted = inject(loaded.model)
    if run.global_adapter.is_dir():
        load_adapter(adapted, run.global_adapter, "global", check_base=False)
    for c in clients:
        if run.local_adapter(c).is_dir():
            load_adapter(adapted, run.local_adapter(c), f"local-{c}", check_base=False)
    gen_cfg = GenerationConfig(max_new_tokens=opts.max_new_tokens, num_beams=opts.num_beams, batch_size=opts.batch_size)

    def fn(prompts: Sequence[str], names: Sequence[str], weights: list[list[float]]) -> list[str]:
        return generate(adapted, loaded.model, loaded.tokenizer, prompts, names, weights or None, gen_cfg,
                        autocast=loaded.autocast)

    fn.adapted = adapted  # type: ignore[attr-defined] - lets per-round evaluation swap the global adapter
    return fn


def evaluate_run(run_dir: str | Path, opts: EvalOptions = EvalOptions(), generate_fn: GenerateFn | None = None) -> dict:
    """Evaluate a run directory; writes ``eval/`` and returns the JSON summary.

    Args:
        run_dir: a run directory (see :mod:`adapters.rundir`).
        opts: evaluation settings.
        generate_fn: ``(prompts, adapter names, per-row weights) -> answers``; defaults to the serving
            package's batched generation over the run's adapters.
    """
    from training.data import load_dataset, prompt_texts

    run = RunDir(Path(run_dir))
    cfg = run.read_config()
    dataset = load_dataset(opts.data or cfg["data"], **cfg.get("data_options", {}))
    clients = [c for c in dataset.client_ids if c in set(run.clients()) or run.global_adapter.is_dir()]
    specs = model_specs(run, clients, float(cfg.get("inference_weight", 0.5)))
    fn = generate_fn or _default_generate(run, cfg, opts, clients)
    cache = PredictionCache(run.eval_dir / "predictions", limit=opts.limit)
    grid: dict[str, dict[str, Scores]] = {}
    from tqdm.auto import tqdm

    # Keys with the same adapters and weights (e.g. every FedIT client = the global model) share one
    # set of generations: the first such key is generated, the others reuse its predictions.
    canonical: dict[str, str] = {}
    for key, spec in specs.items():
        canonical[key] = next(k for k, v in specs.items() if v == spec)
    jobs = [(key, task) for key in specs for task in dataset.tasks if canonical[key] == key]
    for key, task in tqdm(jobs, desc="eval", unit="set"):
        names, weights = specs[key]
        records = list(dataset.tests[task])[: opts.limit]
        prompts = prompt_texts(records)
        preds = cache.fill("final", key, task, prompts, [r.output for r in records],
                           lambda ps, n=names, w=weights: fn(ps, n, [w] * len(ps) if n else []),
                           batch_size=opts.batch_size)
        grid.setdefault(key, {})[task] = score(preds, [r.output for r in records])
    for key in specs:
        grid[key] = grid[canonical[key]]
    summary = _write_outputs(run, cfg, dataset, clients, grid, opts)
    if opts.per_round:
        summary["per_round"] = _per_round(run, dataset, opts, fn, cache)
    (run.eval_dir / "results.json").write_text(json.dumps(summary, indent=2))
    return summary


def _write_outputs(run: RunDir, cfg: dict, dataset, clients, grid, opts: EvalOptions) -> dict:  # noqa: ANN001
    client_tasks = {c: dataset.task_of(c) for c in clients}
    label = str(cfg.get("method", run.root.name))
    blocks = tables.block_rows(label, grid, clients, client_tasks, opts.metric)
    columns = [client_tasks[c] for c in clients]
    md = tables.markdown(blocks, columns, opts.metric)
    run.eval_dir.mkdir(parents=True, exist_ok=True)
    (run.eval_dir / "table.md").write_text(md)
    plots.plot_scores({k: {t: s.get(opts.metric) for t, s in v.items()} for k, v in grid.items()},
                      run.eval_dir / "scores.png", opts.metric)
    return {
        "run": str(run.root), "method": label, "options": asdict(opts), "clients": clients,
        "client_tasks": client_tasks, "tables": tables.blocks_json(blocks, columns), "markdown": md,
        "scores": {k: {t: s.asdict() for t, s in v.items()} for k, v in grid.items()},
    }


def _per_round(run: RunDir, dataset, opts: EvalOptions, fn: GenerateFn, cache: PredictionCache) -> dict:  # noqa: ANN001
    from adapters import load_adapter
    from training.data import prompt_texts

    adapted = getattr(fn, "adapted", None)
    series: dict[int, float] = {}
    for r in run.rounds():
        folder = run.round_dir(r) / "global"
        if not folder.is_dir() or adapted is None:
            continue
        load_adapter(adapted, folder, "round-global", check_base=False, replace=True)
        values = []
        for task in dataset.tasks:
            records = list(dataset.tests[task])[: opts.limit]
            preds = cache.fill(f"round-{r}", "global", task, prompt_texts(records), [x.output for x in records],
                               lambda ps: fn(ps, ("round-global",), [[1.0]] * len(ps)), batch_size=opts.batch_size)
            values.append(score(preds, [x.output for x in records]).get(opts.metric))
        series[r] = sum(values) / len(values)
    if series:
        plots.plot_rounds({"global (mean over tasks)": series}, opts.metric, run.eval_dir / "rounds.png")
    return {str(k): v for k, v in series.items()}


def compare_runs(run_dirs: Sequence[str | Path], out: Path | None = None, metric: str = "rouge1") -> str:
    """Put several evaluated runs side by side (rows = runs); returns the Markdown."""
    per_run, columns = [], None
    for d in run_dirs:
        res = json.loads((Path(d) / "eval" / "results.json").read_text())
        grid = {k: {t: Scores(**{**v, "n": int(v["n"])}) for t, v in ts.items()} for k, ts in res["scores"].items()}
        per_run.append(tables.block_rows(res["method"], grid, res["clients"], res["client_tasks"], metric))
        cols = [res["client_tasks"][c] for c in res["clients"]]
        if columns is not None and cols != columns:
            raise ValueError(f"runs disagree on clients/tasks: {columns} vs {cols}")
        columns = cols
    md = tables.markdown(tables.merge_blocks(per_run), columns or [], metric)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
    return md


def add_eval_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic eval``."""
    p = sub.add_parser("eval", help="evaluate run directories in the layout of paper 000 Table 1")
    p.add_argument("run_dirs", nargs="+", help="one run directory, or several with --compare")
    p.add_argument("--limit", type=int, default=None, help="test examples per task")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--metric", choices=METRICS, default="rouge1")
    p.add_argument("--data", default=None, help="data set spec (default: run.json's)")
    p.add_argument("--model", default=None, help="base model (default: run.json's)")
    p.add_argument("--per-round", action="store_true", help="also score each round's global checkpoint")
    p.add_argument("--compare", action="store_true", help="only tabulate already-evaluated runs side by side")
    p.add_argument("--out", default=None, help="where --compare writes its Markdown")
    return p


def run_eval(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic eval``."""
    if args.compare:
        print(compare_runs(args.run_dirs, Path(args.out) if args.out else None, args.metric))
        return 0
    opts = EvalOptions(limit=args.limit, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
                       batch_size=args.batch_size, metric=args.metric, data=args.data, model=args.model,
                       per_round=args.per_round)
    for d in args.run_dirs:
        print(evaluate_run(d, opts)["markdown"])
    return 0
