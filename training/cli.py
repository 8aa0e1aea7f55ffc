"""``fedmosaic train``: arguments -> data set, base model, settings -> :func:`run_federated`.

The training settings are the method's own regime (:mod:`training.regime`, defined in its module) under
the ``--preset`` budget, then the command line's overrides; ``--print-config`` prints the result as JSON
without training, and run.json records it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models import settings
from models.loaded import check_compile_mode

if TYPE_CHECKING:
    from training.runtime import TrainConfig

TRAIN_OVERRIDES = (("lr", float), ("batch-size", int), ("micro-batch-size", int), ("local-epochs", float),
                   ("max-steps", int), ("cutoff-len", int), ("optimizer", str), ("schedule", str),
                   ("lr-decay", float), ("max-grad-norm", float))


@dataclass(frozen=True)
class MethodSettings:
    """A method's effective settings: its regime under a budget, with overrides.

    Attributes:
        method: the method's name.
        preset: the budget's name.
        train: local training settings.
        rounds: communication rounds.
        options: method options (defaults, round-counting ones scaled to the budget, then the user's).
        regime: the paper regime it started from (JSON).
        budget: the budget's arithmetic for a client of ``examples`` examples (:func:`budget_arithmetic`).
    """

    method: str
    preset: str
    train: TrainConfig
    rounds: int
    options: dict[str, Any]
    regime: dict[str, Any]
    budget: dict[str, Any]

    def asdict(self) -> dict[str, Any]:
        """JSON for ``--print-config``."""
        return {"method": self.method, "preset": self.preset, "rounds": self.rounds, "train": self.train.asdict(),
                "options": self.options, "regime": self.regime, "budget": self.budget}


def budget_arithmetic(method: str, preset_name: str, train: TrainConfig, rounds: int, examples: int) -> dict[str, Any]:
    """What a budget gives ``method`` per client of ``examples`` training examples, beside the paper's.

    ``examples_per_client`` counts one adapter's passes over the run (rounds x steps per run x batch):
    FedDPA-T and FedOA train their local adapter as much again, FedLoRA / FedDPA-F add one fine-tune run.
    """
    from training.algorithms import get_method
    from training.regime import budget, run_steps

    m = get_method(method)
    reg, b = m.regime, budget(preset_name)
    steps = run_steps(examples, train.batch_size, train.local_epochs, train.max_steps)
    paper_steps = run_steps(examples, reg.batch_size, reg.local_epochs, reg.max_steps)
    per_client = rounds * steps * train.batch_size
    paper = reg.rounds * paper_steps * reg.batch_size
    return {"fraction": b.fraction, "client_examples": examples, "epochs_per_run": round(steps * train.batch_size
                                                                                       / examples, 4),
            "steps_per_run": steps, "examples_per_client": per_client, "paper_examples_per_client": paper,
            "share_of_paper": round(per_client / paper, 5), "lr_rule_factor": round(b.lr_factor(reg), 4),
            "lr": train.lr, "schedule": train.schedule, "max_grad_norm": train.max_grad_norm}


def method_settings(method: str, preset_name: str = "paper", rounds: int | None = None,
                    options: Mapping[str, Any] | None = None, data: str | None = None, n_clients: int | None = None,
                    examples: int | None = None, **overrides: Any) -> MethodSettings:
    """``method``'s paper regime under budget ``preset_name``, with ``rounds``, option and field overrides.

    Args:
        method: a registered method name.
        preset_name: ``paper``, ``medium``, ``repro``, ``small`` or ``tiny``.
        rounds: communication rounds (None: the regime's, scaled by the budget).
        options: method options over its defaults.
        data: the data spec (a paper's per-data-set defaults: FedDPA-T's alpha 0.3 on ``feddpa2``); None
            leaves such options out, for :func:`training.simulation.run_federated` to set.
        n_clients: the number of clients (defaults that scale with it: FedAMoLE's expert count); None
            leaves them out likewise.
        examples: training examples per client, for the budget arithmetic (None: 300, FedDPA's; the
            Centralized baseline pools 8 clients' worth).
        **overrides: :class:`training.runtime.TrainConfig` fields (None values are ignored); ``lr_decay``
            is ``round_decay``; ``max_grad_norm`` 0 turns clipping off.
    """
    from training.algorithms import get_method
    from training.regime import NOMINAL_EXAMPLES, budget, scaled_options
    from training.runtime import preset

    m = get_method(method)
    if "lr_decay" in overrides:
        overrides["round_decay"] = overrides.pop("lr_decay")
    clip = overrides.pop("max_grad_norm", None)
    train = preset(preset_name, m.regime, **overrides)
    if clip is not None:
        if clip < 0:
            raise ValueError(f"--max-grad-norm must be >= 0 (0 turns clipping off), got {clip}")
        train = replace(train, max_grad_norm=clip if clip > 0 else None)
    opts = scaled_options(m.regime, preset_name, m.options_for(data, n_clients=n_clients))
    # Defaults that depend on what is not known here are left to run_federated, which knows the data set
    # and its clients: passing the generic value on would override FedDPA-T's alpha 0.3 on feddpa2 or
    # FedAMoLE's expert count for the clients.
    unknown = [k for d in m.data_defaults.values() for k in d] if data is None else []
    unknown += list(m.client_defaults(1)) if n_clients is None and m.client_defaults else []
    opts = {**{k: v for k, v in opts.items() if k not in unknown}, **(options or {})}
    n = rounds if rounds is not None else budget(preset_name).rounds(m.regime)
    per_client = examples or NOMINAL_EXAMPLES * (8 if m.centralized else 1)
    return MethodSettings(m.name, preset_name, train, n, opts, m.regime.asdict(),
                          budget_arithmetic(m.name, preset_name, train, n, per_client))


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


def add_train_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic train``."""
    from training.algorithms import ALGORITHMS
    from training.runtime import PRESETS

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
                        "and schedule following the steps (training.regime); --print-config shows the arithmetic")
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
    p.add_argument("--compile", nargs="?", const="default", default=None, type=_compile_mode, metavar="MODE",
                   help="torch.compile the base model's decoder layers for training (mode: default or "
                        "max-autotune); the same training up to float order, after a one-off compile")
    p.add_argument("--n-train", type=int, default=None, help="generated suite: training examples per client")
    p.add_argument("--n-test", type=int, default=None, help="generated suite: test examples per task")
    p.add_argument("--families", default=None, help="generated suite: comma-separated task families")
    p.add_argument("--leave-out", default=None, metavar="TASKS",
                   help="leave-one-task-out (FedOA): no client trains these comma-separated tasks; eval scores them "
                        "as out-of-distribution (recorded in run.json, so eval reloads the same split)")
    p.add_argument("--hold-out", type=float, default=None, metavar="SHARE",
                   help="hold out this share (0-0.5] of each client's examples, never trained on: FedDPA clients "
                        "check on it whether their local adapter helps (the calibrated weighting's gate; in run.json)")
    p.add_argument("--lr-search", nargs="?", const="0.5,1,2", default=None, metavar="MULTIPLES",
                   help="choose the lr among these multiples of the budget's rule (default 0.5,1,2) by the validation "
                        "loss on a held-out share of a few clients' training data (training.lr_search; in run.json)")
    p.add_argument("--lr-search-clients", type=int, default=2, help="clients the lr search scores")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, e.g. alpha=0.3, mu=0.01, lambda=0.5, weighting=num_examples")
    return p


def run_train(args: argparse.Namespace) -> int:
    """Entry of ``fedmosaic train``."""
    from models import load_base_model
    from training.data import DataError, load_dataset
    from training.simulation import SimConfig, run_federated

    options: dict[str, Any] = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option expects KEY=VALUE, got {item!r}")
        options[key] = _value(value)
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
    overrides = {name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name, _ in TRAIN_OVERRIDES}
    overrides["compile"] = args.compile
    if not args.out and not args.print_config:
        raise SystemExit("fedmosaic train: --out is required (or pass --print-config)")
    if args.lr_search and args.lr is not None:
        raise SystemExit("fedmosaic train: --lr-search chooses the rate; drop --lr")
    try:
        dataset = load_dataset(args.data, **data_options)
    except DataError as exc:  # a bad data set or split: one line naming it, never a traceback
        if not args.print_config:
            raise SystemExit(f"fedmosaic train: {exc}") from exc
        dataset = None  # --print-config without the data: the arithmetic for FedDPA's 300 examples a client
    try:  # the settings' own checks (rounds, rates, sizes, limits) name the bad value: one line, no traceback
        if args.clients_per_task < 1:
            raise ValueError(f"--clients-per-task must be >= 1, got {args.clients_per_task}")
        eff = method_settings(args.method, args.preset, args.rounds, options, data=args.data,
                              **_data_counts(dataset, args.method, args.clients_per_task), **overrides)
        sim = SimConfig(rounds=eff.rounds, fraction=args.fraction, sample_rate=args.sample_rate, seed=args.seed,
                        client_timeout_s=args.timeout, keep_strategy=args.keep_strategy,
                        clients_per_task=args.clients_per_task)
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


def failure_lines(failures: list[tuple[int, str, str]]) -> list[str]:
    """One line per distinct error of a run's failed client fits: how many, which rounds and clients.

    Args:
        failures: ``(round, client, error)`` rows, as :class:`training.rounds.RunSummary` keeps them.
    """
    by_error: dict[str, list[tuple[int, str]]] = {}
    for r, cid, error in failures:
        by_error.setdefault(" ".join(error.split())[:300], []).append((r, cid))  # one line each, bounded
    lines = []
    for error, where in by_error.items():
        rounds = sorted({r for r, _ in where})
        clients = sorted({c for _, c in where})
        shown = ", ".join(clients[:4]) + (f" and {len(clients) - 4} more" if len(clients) > 4 else "")
        lines.append(f"{len(where)} failed (round {', '.join(map(str, rounds))}; {shown}): {error}")
    return lines


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
    """One line per client whose calibration holds a hold-out check (``training.local_gate``): its scores."""
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
