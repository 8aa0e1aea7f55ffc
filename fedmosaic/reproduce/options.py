"""What one ``fedmosaic reproduce`` invocation asks for: :class:`Table1Options`, and the parsing of its options."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.local.regime import BUDGETS

DEFAULT_METHODS = "fedit,fedlora,feddpa-f,feddpa-t,local"


@dataclass(frozen=True)
class Table1Options:
    """The cells to make and how (``fedmosaic reproduce --help`` says each option's meaning).

    Attributes:
        methods: comma-separated methods (training's names).
        seeds: the seeds, one run per method and seed.
        preset: the training preset (None: :func:`default_preset`).
        data: the data set spec training accepts.
        data_option: the data loader's options, ``KEY=VALUE`` each.
        leave_out: FedOA's held-out tasks, comma-separated (paper 001's protocol), or None.
        rounds: the rounds of every method (None: each method's under ``preset``).
        limit: test examples per task (None: all).
        ttp_limit: the first N examples of each task for the TTP column (None: as ``limit``).
        num_beams: beams of the decoding (1: greedy).
        max_new_tokens: answer length.
        batch_size: rows decoded together.
        metric: the score (``rouge1`` ...).
        model: the base model.
        dtype: the compute dtype (None: the device's default).
        device: the device (None: the ``FEDMOSAIC_DEVICE`` setting).
        out: the folder of the runs, cells and tables.
        option: per-method options, ``METHOD:KEY=VALUE`` each.
    """

    methods: str = DEFAULT_METHODS
    seeds: tuple[int, ...] = (0,)
    preset: str | None = None
    data: str = "feddpa1"
    data_option: tuple[str, ...] = ()
    leave_out: str | None = None
    rounds: int | None = None
    limit: int | None = None
    ttp_limit: int | None = None
    num_beams: int = 1
    max_new_tokens: int = 64
    batch_size: int = 8
    metric: str = "rouge1"
    model: str = "smollm2"
    dtype: str | None = None
    device: str | None = None
    out: str = "runs/table1"
    option: tuple[str, ...] = ()

    def resolved_preset(self) -> str:
        """``preset``, which ``fedmosaic reproduce`` resolves (:func:`default_preset`) before any run is made."""
        assert self.preset is not None, "the preset is resolved (default_preset) before runs are made"
        return self.preset

    def held_out(self) -> list[str]:
        """The ``leave_out`` tasks as a list (empty without ``--leave-out``)."""
        return [t for t in (self.leave_out or "").split(",") if t]


def default_preset() -> tuple[str, str | None]:
    """``repro`` when training defines it, else ``small`` with a note saying so."""
    if "repro" in BUDGETS:
        return "repro", None
    return "small", "training has no 'repro' preset yet: fell back to 'small'"


def method_options(items: tuple[str, ...] | list[str]) -> dict[str, dict[str, Any]]:
    """``["pfedseq:warmup=1", ...]`` -> ``{"pfedseq": {"warmup": 1}}`` (values parsed as JSON when they are).

    Raises:
        SystemExit: an item is not ``METHOD:KEY=VALUE``.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        method, colon, rest = item.partition(":")
        key, eq, value = rest.partition("=")
        if not colon or not eq or not method or not key:
            raise SystemExit(f"--option expects METHOD:KEY=VALUE, got {item!r}")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(method, {})[key] = parsed
    return out


def data_options(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``["n_train=4", "families=a,b"]`` -> ``{"n_train": 4, "families": ["a", "b"]}`` (JSON, else text or a list).

    Raises:
        SystemExit: an item is not ``KEY=VALUE``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--data-option expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value.split(",") if "," in value else value
    return out


def evaluation_text(opts: Table1Options) -> str:
    """The evaluation setting as the table's first line says it (examples, decoding, the TTP limit)."""
    return (f"{'all' if opts.limit is None else f'the first {opts.limit}'} test examples per task, "
            + ("greedy" if opts.num_beams == 1 else f"{opts.num_beams} beams")
            + f", {opts.max_new_tokens} new tokens"
            + ("" if opts.ttp_limit is None else f"; TTP: every model on the first {opts.ttp_limit} "
               "examples of each task"))


class HarnessFileError(ValueError):
    """One of the harness's JSON files cannot be read; its message names the file and what to do."""


def read_json(path: Path) -> dict[str, Any]:
    """One of the harness's JSON files (a cell, a run's record, the folder's settings), as a dict.

    Raises:
        HarnessFileError: the file is missing, not UTF-8, not JSON or not an object, naming it. Nothing is
            overwritten: inside a run only the cell that needs the file fails, and a damaged committed cell is
            restored from git or deleted to be made again.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HarnessFileError(f"{path} cannot be read as JSON ({exc}); restore it (git), or delete a cell's "
                               "file to make that cell again") from exc
    if not isinstance(data, dict):
        raise HarnessFileError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data
