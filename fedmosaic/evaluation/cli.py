"""``fedmosaic eval``'s command line: options -> :class:`.evaluate.EvalOptions`, one run or a comparison."""

from __future__ import annotations

import argparse
from pathlib import Path

from adapters import AdapterError
from fedmosaic.evaluation.backend import WEIGHTING
from fedmosaic.evaluation.compare import compare_runs
from fedmosaic.evaluation.evaluate import EvalOptions, EvalSetupError, evaluate_run
from fedmosaic.evaluation.inputs import AMOLE_MODELS
from models import settings
from routing.feddpa_options import add_option_arguments
from training.data import DataError
from training.scoring import METRICS

# What a bad run directory, data set or test set raises: one line on stderr, never a traceback.
_USER_ERRORS = (AdapterError, DataError, EvalSetupError)


def add_eval_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic eval``."""
    p = sub.add_parser("eval", help="evaluate run directories in the layout of paper 000 Table 1")
    p.add_argument("run_dirs", nargs="+", help="one run directory, or several with --compare")
    p.add_argument("--limit", type=int, default=None,
                   help="score only the first N test examples per task (default: all of them, 200 per task on "
                        "the FedDPA data sets: the reproduction protocol; a limit is for quick looks only)")
    p.add_argument("--ttp-limit", type=int, default=None, metavar="N",
                   help="TTP on the first N examples of each task, for every model (a client's model then "
                        "answers only those of the other tasks; default: as many as --limit); Personalization, "
                        "the global and the base model keep every example")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer length (the FedDPA reference: 80)")
    p.add_argument("--num-beams", type=int, default=1,
                   help="1: greedy on the continuous-batching engine; >1: HF beam search (the FedDPA reference: 4); "
                        "cached answers are kept per setting")
    p.add_argument("--batch-size", type=int, default=8, help="rows decoded together")
    p.add_argument("--metric", choices=METRICS, default="rouge1")
    p.add_argument("--data", default=None, help="data set spec (default: run.json's)")
    p.add_argument("--test", default=None, metavar="FOLDER_OR_SPEC",
                   help="score the run's clients on another test set: a data set name, a folder (test/<task>.jsonl "
                        "or <task>.jsonl files) or one .jsonl file; writes eval/test-sets/<name>/")
    p.add_argument("--model", default=None, help="base model (default: run.json's)")
    p.add_argument("--per-round", action="store_true", help="also score each round's global checkpoint")
    p.add_argument("--feddpa-weights", choices=WEIGHTING, default="auto",
                   help="<client> weighting: auto = instance-wise for FedDPA runs with embeddings (paper), "
                        "else the run's fixed inference weight")
    p.add_argument("--feddpa-weighting", choices=["paper", "calibrated", "fixed"], default=None,
                   help="instance-wise rule of FedDPA runs: calibrated (default), paper (lambda * mean cosine) "
                        "or fixed; calibrated needs `fedmosaic calibrate` on runs trained before it existed")
    add_option_arguments(p, ("samples", "mode", "similarity", "variant", "embedding"))  # as `fedmosaic serve`'s
    p.add_argument("--amole-model", choices=AMOLE_MODELS, default=None,
                   help="FedAMoLE runs: each client's own model after its last local training (local, paper 002 "
                        "App. D.1.1; the default where training wrote them) or the aggregated pool (aggregated)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "autocast-bf16"])
    p.add_argument("--device", type=settings.device_option, default=None, help=settings.DEVICE_HELP)
    p.add_argument("--compare", action="store_true", help="only tabulate already-evaluated runs side by side")
    p.add_argument("--out", default=None, help="where --compare writes its Markdown")
    return p


def run_eval(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic eval``."""
    try:
        if args.compare:
            print(compare_runs(args.run_dirs, Path(args.out) if args.out else None, args.metric, args.test))
            return 0
        return _evaluate(args)
    except _USER_ERRORS as exc:
        raise SystemExit(f"fedmosaic eval: {exc}") from exc


def _evaluate(args: argparse.Namespace) -> int:
    try:
        opts = _options(args)
    except ValueError as exc:  # an option out of range (--limit 0, --batch-size 0): one line, no traceback
        raise SystemExit(f"fedmosaic eval: {exc}") from exc
    for d in args.run_dirs:
        print(evaluate_run(d, opts)["markdown"])
    return 0


def _options(args: argparse.Namespace) -> EvalOptions:
    return EvalOptions(limit=args.limit, ttp_limit=args.ttp_limit, max_new_tokens=args.max_new_tokens,
                       num_beams=args.num_beams,
                       batch_size=args.batch_size, metric=args.metric, data=args.data, test=args.test, model=args.model,
                       per_round=args.per_round, dtype=args.dtype, device=args.device,
                       feddpa_weights=args.feddpa_weights, feddpa_weighting=args.feddpa_weighting,
                       feddpa_samples=args.feddpa_samples, feddpa_mode=args.feddpa_mode,
                       feddpa_similarity=args.feddpa_similarity, feddpa_variant=args.feddpa_variant,
                       feddpa_embedding=args.feddpa_embedding, amole_model=args.amole_model)
