"""``fedmosaic train``: arguments -> data set, base model, settings -> :func:`run_federated`.

The training settings (:func:`training.settings.method_settings`) are the method's own regime
(:mod:`training.local.regime`, defined in its module) under the ``--preset`` budget, then the command line's
overrides; ``--print-config`` prints the result as JSON without training, and run.json records it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from models import settings
from models.loaded import check_compile_mode

TRAIN_OVERRIDES = (("lr", float), ("batch-size", int), ("micro-batch-size", int), ("local-epochs", float),
                   ("max-steps", int), ("cutoff-len", int), ("optimizer", str), ("schedule", str),
                   ("lr-decay", float), ("max-grad-norm", float))


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _compile_mode(text: str) -> str:
    """``--compile``'s value: a mode :func:`models.loaded.check_compile_mode` accepts (its reason otherwise)."""
    try:
        check_compile_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _targets(text: str) -> Any:
    """``--target-modules``'s value as a target spec (:func:`adapters.targets.parse_targets`; its reason otherwise)."""
    from adapters.targets import parse_targets

    try:
        return parse_targets(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_train_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic train``."""
    from training.algorithms import ALGORITHMS
    from training.local.runtime import PRESETS

    p = sub.add_parser("train", help="federated training in the in-process simulator")
    p.add_argument("--method", required=True, choices=sorted(ALGORITHMS))
    p.add_argument("--data", default="generated", help="feddpa1 | feddpa2 | dolly | generated | a folder")
    p.add_argument("--rounds", type=int, default=None, help="default: the method's paper rounds, scaled by --preset")
    p.add_argument("--out", default=None, help="the run directory to write (required unless --print-config)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective settings (the method's regime under --preset) as JSON and exit")
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random, for smoke runs) or a folder")
    p.add_argument("--preset", default="paper", choices=sorted(PRESETS),
                   help="budget: a fraction of every method's paper work (rounds and local epochs together), the lr "
                        "and schedule following the steps (training.local.regime); --print-config shows the arithmetic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fraction", type=float, default=1.0, help="share of clients per round")
    p.add_argument("--sample-rate", type=float, default=None, help="per-task client sampling (40-client study)")
    p.add_argument("--clients-per-task", type=int, default=1, help="split each task into k clients")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last round")
    p.add_argument("--timeout", type=float, default=None, help="soft per-client time limit in seconds")
    p.add_argument("--keep-strategy", type=int, default=1,
                   help="newest complete rounds that keep the strategy's resume tensors (0: every round)")
    p.add_argument("--dtype", choices=settings.DTYPES, default=None,
                   help=("default: FEDMOSAIC_DTYPE, else bfloat16 on CUDA, autocast-bf16 on a CPU with native bf16 "
                         "(AVX512-BF16 or AMX), float32 on other CPUs"))
    p.add_argument("--device", type=settings.device_option, default=None, help=settings.DEVICE_HELP)
    for name, kind in TRAIN_OVERRIDES:
        p.add_argument(f"--{name}", type=kind, default=None, help="overrides the method's regime and the preset")
    lora = p.add_argument_group("LoRA (every method; in run.json and each adapter's adapter_config.json)")
    lora.add_argument("--lora-r", type=int, default=None, metavar="R", help="LoRA rank (default 8)")
    lora.add_argument("--lora-alpha", type=float, default=None, metavar="ALPHA",
                      help="lora_alpha: the update is scaled by alpha / r (default 16)")
    lora.add_argument("--lora-dropout", type=float, default=None, metavar="P", help="dropout on the adapters' input "
                      "while training (default 0.05)")
    lora.add_argument("--target-modules", type=_targets, default=None, metavar="SPEC",
                      help="the Linear layers to adapt, as PEFT's target_modules: names (q_proj,v_proj, the "
                           "default), a regex matched against the whole module path, or all-linear (every Linear "
                           "but lm_head)")
    p.add_argument("--compile", nargs="?", const="default", default=None, type=_compile_mode, metavar="MODE",
                   help="torch.compile the base model's decoder layers for training (mode: default or "
                        "max-autotune); the same training up to float order, after a one-off compile")
    p.add_argument("--prompt-style", choices=("alpaca_short", "chat"), default=None,
                   help="the prompt template training, evaluation, FedDPA's instance prompts and served chat use: "
                        "alpaca_short (the paper's, default) or chat (the base model's chat template, for chat "
                        "clients); in run.json")
    p.add_argument("--n-train", type=int, default=None, help="generated suite: training examples per client")
    p.add_argument("--n-test", type=int, default=None, help="generated suite: test examples per task")
    p.add_argument("--families", default=None, help="generated suite: comma-separated task families")
    p.add_argument("--leave-out", default=None, metavar="TASKS",
                   help="leave-one-task-out (FedOA): no client trains these comma-separated tasks; eval scores them "
                        "as out-of-distribution (recorded in run.json, so eval reloads the same split)")
    p.add_argument("--hold-out", type=float, default=None, metavar="SHARE",
                   help="hold out this share (0-0.5] of each client's examples, never trained on: FedDPA clients "
                        "check on it whether their local adapter helps (the calibrated weighting's gate; in run.json)")
    from training.data.cli_args import add_source_arguments

    add_source_arguments(p.add_argument_group("data source: table columns and partitions (docs/data.md)"))
    p.add_argument("--lr-search", nargs="?", const="0.5,1,2", default=None, metavar="MULTIPLES",
                   help="choose the lr among these multiples of the budget's rule (default 0.5,1,2) by the validation "
                        "loss on a held-out share of a few clients' training data (training.lr_search; in run.json)")
    p.add_argument("--lr-search-clients", type=int, default=2, help="clients the lr search scores")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, e.g. alpha=0.3, mu=0.01, lambda=0.5, weighting=num_examples; checked against "
                        "the method's declared options (--help-options lists them)")
    p.add_argument("--help-options", action="store_true",
                   help="list the method's options (type, range, default, meaning) and exit")
    return p


def run_train(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic train``."""
    from models import load_base_model
    from training.data import DataError, load_dataset
    from training.federation.rounds import RoundConfig, failure_lines
    from training.settings import method_settings
    from training.simulation import SimConfig, run_federated

    options: dict[str, Any] = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"fedmosaic train: --option expects KEY=VALUE, got {item!r}")
        options[key] = _value(value)
    if args.help_options:
        print(options_help(args.method))
        return 0
    data_options: dict[str, Any] = {}
    if args.data == "generated":
        for key in ("n_train", "n_test"):
            if getattr(args, key) is not None:
                data_options[key] = getattr(args, key)
        if args.families:
            data_options["families"] = args.families.split(",")
    if args.leave_out:
        data_options["leave_out"] = [t for t in args.leave_out.split(",") if t]
    if args.hold_out is not None:
        if not 0.0 < args.hold_out <= 0.5:
            raise SystemExit(f"fedmosaic train: --hold-out must be in (0, 0.5], got {args.hold_out}")
        data_options["hold_out"] = args.hold_out
    try:  # --columns / --partition: checked here, before any model loads
        from training.data.cli_args import source_options

        data_options.update(source_options(args, args.seed))
    except DataError as exc:
        raise SystemExit(f"fedmosaic train: {exc}") from exc
    overrides = {name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name, _ in TRAIN_OVERRIDES}
    overrides["compile"] = args.compile
    overrides["prompt_style"] = args.prompt_style
    overrides.update(lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                     target_modules=args.target_modules)
    if not args.out and not args.print_config:
        raise SystemExit("fedmosaic train: --out is required (or pass --print-config)")
    if args.lr_search and args.lr is not None:
        raise SystemExit("fedmosaic train: --lr-search chooses the rate; drop --lr")
    try:
        dataset = load_dataset(args.data, **data_options)
    except DataError as exc:  # a bad data set or split: one line naming it, never a traceback
        if not args.print_config or "columns" in data_options or "partition" in data_options:
            raise SystemExit(f"fedmosaic train: {exc}") from exc
        dataset = None  # --print-config without the data: the arithmetic for FedDPA's 300 examples a client
    try:  # the settings' own checks (rounds, rates, sizes, limits) name the bad value: one line, no traceback
        if args.clients_per_task < 1:
            raise ValueError(f"--clients-per-task must be >= 1, got {args.clients_per_task}")
        eff = method_settings(args.method, args.preset, args.rounds, options, data=args.data,
                              **_data_counts(dataset, args.method, args.clients_per_task), **overrides)
        loop = RoundConfig(rounds=eff.rounds, fraction=args.fraction, sample_rate=args.sample_rate, seed=args.seed,
                           keep_strategy=args.keep_strategy)
        sim = SimConfig(loop, client_timeout_s=args.timeout, clients_per_task=args.clients_per_task)
    except ValueError as exc:
        raise SystemExit(f"fedmosaic train: {exc}") from exc
    if args.print_config:
        print(json.dumps(eff.asdict(), indent=2, sort_keys=True))
        return 0
    assert dataset is not None
    loaded = load_base_model(args.model, dtype=args.dtype, device=args.device)
    record: dict[str, Any] = {"budget": eff.budget}
    train = eff.train
    if args.lr_search:
        from training.lr_search import search_lr

        grid = [float(x) for x in args.lr_search.split(",") if x]
        found = search_lr(loaded, dataset, train, eff.rounds, grid, clients=args.lr_search_clients, seed=args.seed)
        print(f"lr search on {', '.join(found.clients)}'s validation split: "
              + ", ".join(f"{lr:.3g} -> {v:.4f}" for lr, v in zip(found.lrs, found.val_loss, strict=True))
              + f" (untrained {found.start_loss:.4f}); chosen {found.lr:.3g}")
        train = replace(train, lr=found.lr)
        record["lr_search"] = found.asdict()
    summary = run_federated(args.method, dataset, loaded, args.out, sim, train, eff.options, resume=args.resume,
                            data_spec=args.data, data_options=data_options,
                            model_name=args.model, preset_name=args.preset, record=record)
    print(f"{summary.method}: {summary.rounds} rounds in {summary.seconds:.1f} s -> {summary.run_dir}")
    print("  mean client loss per round: " + ", ".join(f"{x:.3f}" for x in summary.losses))
    print(f"  bytes up {summary.bytes_up:,}  down {summary.bytes_down:,}  failures {len(summary.failures)}")
    for line in failure_lines(summary.failures):
        print("    " + line)
    gates = gate_lines(Path(summary.run_dir))
    if gates:
        kept = sum(line.endswith("kept") for line in gates)
        print(f"  local adapters kept by the hold-out check: {kept} of {len(gates)}")
        for line in gates:
            print("    " + line)
    if summary.empty_rounds:
        print(f"error: round(s) {', '.join(map(str, summary.empty_rounds))} aggregated no client (every fit failed, "
              f"errors above), so the adapters did not train in them; fix the cause and train again into a "
              f"new --out (a --resume of {summary.run_dir} would keep those rounds)", file=sys.stderr)
        return 1
    return 0


def options_help(method: str) -> str:
    """``--help-options``: the method's declared options, one per line (:class:`training.options.Option`)."""
    from training.algorithms import get_method

    m = get_method(method)
    lines = [f"{m.name} options (--option KEY=VALUE; values are JSON, else text):"]
    lines += [f"  {o.usage()}" for o in m.options] or ["  none"]
    return "\n".join(lines)


def _data_counts(dataset: Any, method: str, clients_per_task: int) -> dict[str, int]:
    """The number of clients and the mean training examples per client (pooled for Centralized)."""
    from training.algorithms import get_method

    if dataset is None or not dataset.clients:
        return {}
    n_clients = len(dataset.clients) * clients_per_task
    total = sum(len(c.train) for c in dataset.clients)
    per_client = total if get_method(method).centralized else round(total / n_clients)
    return {"n_clients": n_clients, "examples": max(1, per_client)}


def gate_lines(run_dir: Path) -> list[str]:
    """One line per client whose calibration holds a hold-out check (``training.federation.local_gate``): its scores."""
    from adapters.rundir import RunDir
    from routing.calibration import Calibration

    run, lines = RunDir(run_dir), []
    for client in run.clients():
        cal = Calibration.load(run.client_dir(client)) if run.embeddings(client).is_file() else None
        if cal is not None and cal.gate:
            g = cal.gate
            test = (f", {g['wins']} better / {g['losses']} worse, sign test p = {g['p_value']:.3g}"
                    if "wins" in g else "")
            lines.append(f"{client}: {g['metric']} global {g['global']:.2f}, mixed at {g['lambda']} {g['mixed']:.2f} "
                         f"on {g['n']} held-out examples{test}: {'kept' if cal.gain else 'global only'}")
    return lines
