"""``fedmosaic eval RUN_DIR``: batch offline evaluation in the layout of paper 000's Table 1.

Every client's personalized model generates on the test set of every task; the global model and the bare
base model do too. Models are *served targets* of the serving stack (:mod:`.stack_backend`):
``<client>`` (FedDPA's global + local mix: instance-wise weights by default for FedDPA runs, paper 000
section 4.3, or the run's fixed inference weight; a FedAMoLE client's own model, paper 002 App. D.1.1,
or with ``amole_model`` ``aggregated`` the pool's ``amole:<client>``), else ``<client>:local`` or
``global``, whichever the run serves. Greedy decoding runs on the continuous-batching engine; beam
search (``--num-beams`` > 1) on HF ``generate`` (:mod:`serving.beam`). Predictions are cached per
(checkpoint, model, task) as JSONL, row by row, tagged with how they were generated, so an interrupted
evaluation resumes where it stopped. Then ROUGE-1/ROUGE-L/exact scores, the Personalization and
Test-Time Personalization blocks (Markdown + JSON), and PNG plots (scores, score per round, FedDPA
weight per task).

``--test`` scores the same clients and adapters on another test set (:mod:`.testsets`), e.g. tasks no
client trained on (paper 000 Table 14); its outputs go to ``eval/test-sets/<name>/`` so the run's own
evaluation is kept. The test set, the run's clients and the metric's references are checked before the
model is loaded, so a bad option fails in one line, not after the generations.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adapters.rundir import RunDir
from fedmosaic.evaluation import outputs, plots, testsets
from fedmosaic.evaluation.backend import WEIGHTING, EvalBackend, EvalItem, tag_of
from fedmosaic.evaluation.inputs import AMOLE_MODELS, EvalSetupError, amole_reading, load_inputs
from fedmosaic.evaluation.predictions import PredictionCache, make_row
from fedmosaic.evaluation.stack_backend import open_backend
from fedmosaic.evaluation.weights import weight_outputs
from routing.embedding import check_pooling
from routing.feddpa import VARIANTS, similarity_name
from serving.pool.amole_run import aggregated_target
from training.data import FederatedDataset, PromptConfig, prompt_texts
from training.scoring import METRICS, Scores, example_scores, mean_scores, score


@dataclass(frozen=True)
class EvalOptions:
    """Settings of one evaluation.

    Attributes:
        limit: test examples per task (None: all).
        ttp_limit: the test-time personalization (TTP) column scores every model on the first
            ``ttp_limit`` examples of each task (None: as many as ``limit``), so a client's model answers
            only those of the tasks other than its own. Personalization, and the global and base models,
            keep ``limit``; a model that serves several clients (FedIT's global) gets it wherever one of
            them needs it.
        max_new_tokens: generation budget per answer.
        num_beams: 1 greedy on the engine (default); more uses HF beam search (the FedDPA reference used 4).
        batch_size: rows decoded together.
        metric: the table's metric: ``rouge1`` (paper), ``rougeL`` or ``exact``.
        data: data set spec overriding run.json's (the clients, their tasks and, without ``test``,
            the test sets).
        test: another test set to score on (:func:`.testsets.load_test_set`: a data set name, a
            folder or a file), e.g. tasks no client trained on; None: the data set's own.
        model: base model overriding run.json's.
        per_round: also score the global adapter of every per-round checkpoint (paper Figure 3).
        dtype: compute dtype (None: the setting's default).
        device: where the model runs (``auto``, ``cpu``, ``cuda[:N]``; None: ``FEDMOSAIC_DEVICE``).
        feddpa_weights: ``<client>`` weighting: ``auto`` (instance-wise for FedDPA runs with an
            embedding index, fixed otherwise), ``instance`` or ``fixed`` (the run's inference weight).
        feddpa_weighting: the instance-wise rule: ``paper``, ``calibrated`` or ``fixed`` (= ``feddpa_weights``
            ``fixed``); None: ``feddpa_weights`` decides, with the default rule (calibrated).
        feddpa_samples: S, local instances compared per example (instance-wise).
        feddpa_mode: ``random`` S instances (paper) or the S nearest (``knn``, order-independent).
        feddpa_similarity: ``cosine`` (paper), ``neg_l2`` (``neg-l2`` accepted) or ``pearson`` (paper 000
            Table 9); with an ablation and no ``feddpa_weighting`` the rule is the paper's.
        feddpa_variant: ``paper`` (``a`` weights the local adapter) or ``reference`` (the global one).
        feddpa_embedding: ``last`` token state (paper) or ``mean`` over the prompt's tokens (Table 10).
        amole_model: a FedAMoLE client's model: ``local`` (its own model after its last local training,
            paper 002 App. D.1.1) or ``aggregated`` (the server's pool after the last aggregation); None:
            ``local`` when the run has the clients' own models (``export=local``), else ``aggregated``.
    """

    limit: int | None = None
    ttp_limit: int | None = None
    max_new_tokens: int = 64
    num_beams: int = 1
    batch_size: int = 8
    metric: str = "rouge1"
    data: str | None = None
    test: str | None = None
    model: str | None = None
    per_round: bool = False
    dtype: str | None = None
    device: str | None = None
    feddpa_weights: str = "auto"
    feddpa_weighting: str | None = None
    feddpa_samples: int = 5
    feddpa_mode: str = "random"
    feddpa_similarity: str = "cosine"
    feddpa_variant: str = "paper"
    feddpa_embedding: str = "last"
    amole_model: str | None = None

    def __post_init__(self) -> None:
        if self.amole_model not in (None, *AMOLE_MODELS):
            raise ValueError(f"amole_model must be one of {AMOLE_MODELS}, got {self.amole_model!r}")
        object.__setattr__(self, "feddpa_similarity", similarity_name(self.feddpa_similarity))
        if self.feddpa_variant not in VARIANTS:
            raise ValueError(f"feddpa_variant must be one of {VARIANTS}, got {self.feddpa_variant!r}")
        check_pooling(self.feddpa_embedding)
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        for name in ("limit", "ttp_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.feddpa_weights not in WEIGHTING:
            raise ValueError(f"feddpa_weights must be one of {WEIGHTING}, got {self.feddpa_weights!r}")
        if self.feddpa_weighting not in (None, "paper", "calibrated", "fixed"):
            raise ValueError(f"feddpa_weighting must be paper, calibrated or fixed, got {self.feddpa_weighting!r}")
        if self.feddpa_weighting is not None and self.feddpa_weights != "auto" and \
                (self.feddpa_weighting == "fixed") != (self.feddpa_weights == "fixed"):
            raise ValueError(f"feddpa_weights={self.feddpa_weights!r} contradicts "
                             f"feddpa_weighting={self.feddpa_weighting!r}")
        if self.feddpa_mode not in ("random", "knn"):
            raise ValueError(f"feddpa_mode must be 'random' or 'knn', got {self.feddpa_mode!r}")
        for name in ("max_new_tokens", "num_beams", "batch_size", "feddpa_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def served_targets(models: Sequence[str], base_name: str, clients: Sequence[str],
                   amole_model: str | None = None) -> dict[str, str]:
    """The served target of every model key: each client, ``global``, ``base``.

    A client's personalized model is ``<client>`` when served (FedDPA mix, a FedAMoLE client's own
    model, or whatever the resolver serves under that name), else its local adapter, else the global
    adapter; clients with none are left out. With ``amole_model`` ``aggregated`` a FedAMoLE client is
    its route in the aggregated pool (``amole:<client>`` where its own model takes ``<client>``), as it
    is, last, for a client without its own model (one the last round did not select).
    """
    available = set(models)
    targets: dict[str, str] = {}
    for c in clients:
        pooled = (aggregated_target(c),)
        first = pooled if amole_model == "aggregated" else ()
        found = next((t for t in (*first, c, f"{c}:local", "global", *pooled) if t in available), None)
        if found is not None:
            targets[c] = found
    if "global" in available:
        targets["global"] = "global"
    targets["base"] = base_name
    return targets


def output_dir(run: RunDir, test: str | None = None) -> Path:
    """Where an evaluation writes: ``eval/`` on the run's own test sets, ``eval/test-sets/<name>/`` with ``--test``."""
    return run.eval_dir if test is None else run.eval_dir / "test-sets" / testsets.slug(testsets.spec_name(test))


def evaluate_run(run_dir: str | Path, opts: EvalOptions = EvalOptions(), backend: EvalBackend | None = None) -> dict:
    """Evaluate a run directory; writes its outputs (:func:`output_dir`) and returns the JSON summary.

    Args:
        run_dir: a run directory (see :mod:`adapters.rundir`).
        opts: evaluation settings.
        backend: the generation backend; defaults to the serving stack over the run's adapters
            (:func:`fedmosaic.evaluation.stack_backend.open_backend`).

    Raises:
        DataError: the data set or the test set cannot be read, the test set holds no task, or some of
            its examples lack the reference the metric needs (raised before the model is loaded).
        EvalSetupError: the run has no clients, or none that the data set names.
    """
    run = RunDir(Path(run_dir))
    cfg = run.read_config()
    dataset, test_set = load_inputs(run, cfg, data=opts.data, test=opts.test, metric=opts.metric,
                                    limit=opts.limit)
    amole = amole_reading(run, opts.amole_model)  # before the model loads: a bad choice fails first
    out = output_dir(run, opts.test)
    if backend is None:
        backend = open_backend(run, cfg, model=opts.model, dtype=opts.dtype, device=opts.device,
                               max_new_tokens=opts.max_new_tokens,
                               num_beams=opts.num_beams, batch_size=opts.batch_size, weighting=opts.feddpa_weights,
                               samples=opts.feddpa_samples, mode=opts.feddpa_mode, rule=opts.feddpa_weighting,
                               similarity=opts.feddpa_similarity, variant=opts.feddpa_variant,
                               embedding=opts.feddpa_embedding)
    targets = served_targets(backend.models(), backend.base_name, dataset.client_ids, amole)
    clients = [c for c in dataset.client_ids if c in targets]
    pooled = [c for c in clients if amole == "local" and targets[c] == aggregated_target(c)]
    if pooled:
        warnings.warn(f"FedAMoLE clients {pooled} have no own model (not selected in the last round): "
                      "scored on the aggregated pool", stacklevel=2)
    if not clients:  # a backend that serves neither a client nor the global model: nothing personalised
        raise EvalSetupError(f"{run.root} serves no model for any client of {dataset.name!r} {dataset.client_ids}")
    described = {t: backend.describe(t) for t in set(targets.values())}
    cache = PredictionCache(out / "predictions", limit=opts.limit)
    tests = {task: list(dataset.tests[task])[: opts.limit] for task in dataset.tasks}
    render = _prompter(cfg, backend)
    prompts = {task: render(records) for task, records in tests.items()}
    # Keys served by the same target (e.g. every FedIT client = the global model) share one set of
    # generations: the first such key is generated, the others reuse its predictions.
    canonical = {key: next(k for k, t in targets.items() if t == target) for key, target in targets.items()}
    jobs = [(key, task) for key in targets for task in dataset.tasks if canonical[key] == key]
    count = _counts(jobs, canonical, {c: dataset.task_of(c) for c in clients}, prompts, opts.ttp_limit)
    items = []
    for key, task in jobs:
        tag = tag_of(described[targets[key]])
        for i in cache.missing("final", key, task, prompts[task][:count[key, task]], tag):
            items.append(EvalItem("final", key, task, i, targets[key], prompts[task][i], tests[task][i].output, tag))
    _generate_into(cache, backend, items, "eval")
    scored = sum(count[job] for job in jobs)
    grid: dict[str, dict[str, Scores]] = {}
    ttp_grid: dict[str, dict[str, Scores]] = {}
    weights: dict[str, dict[str, list[float]]] = {}
    before: dict[str, dict[str, list[float]]] = {}  # the calibrated weights without the clients' gates
    examples: dict[str, dict[str, list[float]]] = {}  # key -> task -> each example's metric, in test order
    for key, task in jobs:
        n = count[key, task]
        rows = cache.rows("final", key, task, prompts[task][:n], tag_of(described[targets[key]]))
        per = [example_scores(r["prediction"], t.output) for r, t in zip(rows, tests[task][:n], strict=True)]
        grid.setdefault(key, {})[task] = mean_scores(per)
        examples.setdefault(key, {})[task] = [round(e[opts.metric], 4) for e in per]
        if opts.ttp_limit is not None:  # every model's TTP on the same examples: the first ttp_limit of each task
            ttp_grid.setdefault(key, {})[task] = mean_scores(per[:min(n, opts.ttp_limit)])
        info = described[targets[key]]
        if key in clients and info.get("mode") == "feddpa" and info.get("routed"):
            weights.setdefault(key, {})[task] = [float(r["weights"][f"{key}:local"]) for r in rows]
            ungated = [(r.get("route") or {}).get("a_before_gate") for r in rows]
            numbers = [float(a) for a in ungated if isinstance(a, int | float)]
            if len(numbers) == len(ungated):  # every row's weight before the gate is a number
                before.setdefault(key, {})[task] = numbers
    for key in targets:
        grid[key] = grid[canonical[key]]
        if ttp_grid:
            ttp_grid[key] = ttp_grid[canonical[key]]
    summary = outputs.write_tables(run, out, cfg, dataset, test_set, clients, grid, opts.metric, opts.limit,
                                   _ttp_note(opts), ttp_grid or None)
    summary["options"] = asdict(opts)
    if dataset.held_out and set(dataset.held_out) <= set(dataset.tasks):  # FedOA's leave-one-task-out run
        summary["ood"] = outputs.ood_block(out, dataset, grid, opts.metric)
    summary["targets"] = {key: described[t] for key, t in targets.items()}
    summary["example_scores"] = outputs.per_example(examples, canonical, {c: dataset.task_of(c) for c in clients},
                                                    opts.metric, opts.ttp_limit)
    # What this call generated and what it found cached (an earlier, interrupted call's or shared answers)
    summary["answers"] = {"generated": len(items), "cached": scored - len(items)}
    if amole is not None:
        summary["amole_model"] = amole
    if weights:
        summary["feddpa_weights"] = weight_outputs(out, weights, {c: dataset.task_of(c) for c in clients},
                                                   before if before.keys() == weights.keys() and before != weights
                                                   else None)
    if opts.per_round:
        summary["per_round"] = _per_round(run, out, dataset, opts, backend, cache, render)
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    return summary


def _counts(jobs: Sequence[tuple[str, str]], canonical: dict[str, str], client_tasks: dict[str, str],
            prompts: dict[str, list[str]], ttp_limit: int | None) -> dict[tuple[str, str], int]:
    """Examples scored per job: all (up to ``limit``) unless only a client's off-task TTP column reads it.

    A job is generated once for every key served by the same target (``canonical``), so it is cut to
    ``ttp_limit`` only when no such key needs the task in full: the global and base models, or a client
    whose own task it is.
    """
    sharing: dict[str, list[str]] = {}
    for key, first in canonical.items():
        sharing.setdefault(first, []).append(key)
    counts: dict[tuple[str, str], int] = {}
    for key, task in jobs:
        n = len(prompts[task])
        if ttp_limit is not None and not any(k not in client_tasks or client_tasks[k] == task for k in sharing[key]):
            n = min(n, ttp_limit)  # only off-task TTP columns read this job
        counts[key, task] = n
    return counts


def _ttp_note(opts: EvalOptions) -> list[str]:
    if opts.ttp_limit is None or (opts.limit is not None and opts.ttp_limit >= opts.limit):
        return []
    return [f"TTP: every model on the first {opts.ttp_limit} examples of each task (a client's model answers only "
            "those of the other tasks; Personalization: every example)."]


def _prompter(cfg: dict, backend: EvalBackend) -> Callable[[Sequence[Any]], list[str]]:
    """Records -> prompts in the template the run trained with (run.json ``train.prompt_style``).

    The FedDPA embedding index was built from training prompts in that template too, so instance-wise
    weights compare like with like.
    """
    style = str((cfg.get("train") or {}).get("prompt_style", "alpaca_short"))
    tokenizer = getattr(backend, "tokenizer", None)
    if style == "chat" and tokenizer is None:
        raise ValueError("this run trained with chat prompts; the evaluation backend must expose its tokenizer")
    config = PromptConfig.named(style)
    return lambda records: prompt_texts(records, tokenizer, config)


def _generate_into(cache: PredictionCache, backend: EvalBackend, items: Sequence[EvalItem], desc: str) -> None:
    """Generate every item and append each row to its cache file as soon as it is done."""
    if not items:
        return
    from tqdm.auto import tqdm

    with tqdm(total=len(items), desc=desc, unit="ex") as bar:
        for item, pred in backend.generate(items):
            cache.append(item.checkpoint, item.key, item.task,
                         [make_row(item.i, item.prompt, item.reference, pred, item.tag)])
            bar.update(1)


def _per_round(run: RunDir, out: Path, dataset: FederatedDataset, opts: EvalOptions, backend: EvalBackend,
               cache: PredictionCache, render: Callable[[Sequence[Any]], list[str]]) -> dict:
    """Score the global adapter of every per-round checkpoint on every task; plot ``rounds.png`` into ``out``."""
    series: dict[int, float] = {}
    for r in run.rounds():
        folder = run.round_dir(r) / "global"
        if not folder.is_dir():
            continue
        name = f"round-{r}"
        backend.add_adapter(name, folder)
        try:
            tag = tag_of(backend.describe(name))
            tests = {task: list(dataset.tests[task])[: opts.limit] for task in dataset.tasks}
            prompts = {task: render(records) for task, records in tests.items()}
            items = [EvalItem(name, "global", task, i, name, prompts[task][i], tests[task][i].output, tag)
                     for task in dataset.tasks for i in cache.missing(name, "global", task, prompts[task], tag)]
            _generate_into(cache, backend, items, name)
            values = []
            for task in dataset.tasks:
                rows = cache.rows(name, "global", task, prompts[task], tag)
                values.append(score([x["prediction"] for x in rows], [x.output for x in tests[task]]).get(opts.metric))
        finally:
            backend.remove_adapter(name)
        series[r] = sum(values) / len(values)
    if series:
        plots.plot_rounds({"global (mean over tasks)": series}, opts.metric, out / "rounds.png")
    return {str(k): v for k, v in series.items()}
