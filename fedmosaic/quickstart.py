"""``fedmosaic quickstart``: the README's first command, from a fresh clone to a running API and demo.

Stages (each its own process, with its own progress bars; :mod:`fedmosaic.quickstart_procs`):

1. prepare the embedded SmolLM2 once (``fedmosaic models prepare``);
2. train FedDPA-T (paper 000 section 4) on the generated 8-family task suite into ``runs/quickstart``
   with a budget sized for a 2-core CPU: 8 clients x ``--rounds`` x ``--max-steps`` optimizer steps
   of the global and of the local adapter. A finished run is reused, an interrupted one resumed;
3. evaluate it on a few test examples per task (the tables and plots the demo shows);
4. serve it (``fedmosaic serve RUN_DIR``: FedDPA instance-wise weights per prompt) and start the
   Gradio demo (``python -m demos``), print both URLs and one personalised answer fetched over HTTP,
   then run until Ctrl-C (``--exit-after-ready`` stops there instead, for tests and CI).

``--data feddpa1`` (or ``feddpa2``, ``dolly``, a folder with ``train/<client>.jsonl``) trains on other
data; every budget knob is an option.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.error
import webbrowser
from pathlib import Path
from typing import Any

from fedmosaic.quickstart_procs import (
    Child,
    QuickstartError,
    fedmosaic_argv,
    http_json,
    pick_port,
    run_step,
    say,
    supervise,
    wait_ready,
)
from models import settings

# The paper's short Alpaca template, which training uses (training.data.prompts.ALPACA_SHORT).
INSTRUCTION = "### Instruction:\n{instruction}\n\n### Response:\n"


def add_quickstart_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``fedmosaic quickstart``."""
    p = sub.add_parser("quickstart", help="train FedDPA-T on the generated suite, serve it and start the demo")
    p.add_argument("--data", default="generated",
                   help="generated (default) | feddpa1 | feddpa2 | dolly | a folder with train/<client>.jsonl")
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random, for smoke runs) or an HF folder")
    p.add_argument("--method", default="feddpa-t", help="training method (FedDPA-T: global + local per client)")
    p.add_argument("--out", default=None, help="run directory (default: runs/quickstart, runs/quickstart-<data>)")
    p.add_argument("--rounds", type=int, default=3, help="federated rounds (FedDPA-T: local adapters from round 2)")
    p.add_argument("--max-steps", type=int, default=6, help="optimizer steps per client, round and adapter")
    p.add_argument("--preset", default="small", help="training preset the budget overrides (see fedmosaic train)")
    # measured on the generated suite: 20 steps at 2e-3 take a local adapter from 0% to 60-100% exact match on most
    # families, the small preset's 5e-4 barely moves it in a quick-start budget
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (overrides the preset)")
    p.add_argument("--n-train", type=int, default=64, help="generated suite: training examples per client")
    p.add_argument("--n-test", type=int, default=None, help="generated suite: test examples per task")
    p.add_argument("--eval-limit", type=int, default=4, help="test examples per task to evaluate (0: skip)")
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--host", default="127.0.0.1", help="interface of the API and the demo")
    p.add_argument("--port", type=int, default=8000, help="API port (taken or 0: a free one)")
    p.add_argument("--demo-port", type=int, default=7860, help="demo port (taken or 0: a free one)")
    p.add_argument("--api-key", default=None, help="require this bearer key on the API (the demo gets it)")
    p.add_argument("--no-serve", action="store_true", help="stop after training and evaluation")
    p.add_argument("--no-demo", action="store_true", help="serve the API only")
    p.add_argument("--exit-after-ready", action="store_true",
                   help="stop the API and demo once they answered (tests, CI) instead of running until Ctrl-C")
    p.add_argument("--open", action="store_true", help="open the demo in a web browser")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the API and demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=settings.device_option, default=None,
                   help=f"for training, evaluation and serving: {settings.DEVICE_HELP}")
    return p


def default_out(data: str) -> Path:
    """``runs/quickstart`` for the generated suite, ``runs/quickstart-<name>`` for other data."""
    if data == "generated":
        return Path("runs/quickstart")
    return Path("runs") / f"quickstart-{Path(data.rstrip('/')).name or 'data'}"


def _train(args: argparse.Namespace, out: Path) -> None:
    """Train, resume an interrupted run, or reuse a finished one with the same method, data and model."""
    if args.method == "feddpa-t" and args.rounds < 2:
        raise QuickstartError("FedDPA-T trains only the global adapter in round 1 and the local ones from "
                              "round 2 on: pass --rounds 2 or more")
    run_json, summary = out / "run.json", out / "summary.json"
    resume = False
    if run_json.is_file():
        old = json.loads(run_json.read_text())
        wanted = {"method": args.method, "data": args.data, "model": args.model}
        differs = {k: old.get(k) for k, v in wanted.items() if old.get(k) != v}
        if differs:
            raise QuickstartError(f"{out} holds another run ({differs}, wanted {wanted}); pass --out for a new one")
        if summary.is_file():
            say(f"2/4 training: reusing the finished run in {out} (delete it or pass --out to train again)")
            return
        resume = True
        say(f"2/4 training: resuming the interrupted run in {out}")
    else:
        say(f"2/4 training {args.method} on {args.data!r}: {args.rounds} rounds x {args.max_steps} steps per client "
            f"and adapter -> {out}")
    argv = ["train", "--method", args.method, "--data", args.data, "--model", args.model, "--out", str(out),
            "--rounds", str(args.rounds), "--preset", args.preset, "--max-steps", str(args.max_steps),
            "--lr", str(args.lr), "--seed", str(args.seed), *_device(args)]
    if args.data == "generated":
        argv += ["--n-train", str(args.n_train)] + (["--n-test", str(args.n_test)] if args.n_test else [])
    run_step("training", fedmosaic_argv(*argv, *(["--resume"] if resume else [])))


def _device(args: argparse.Namespace) -> list[str]:
    """``--device`` for the child commands when given (otherwise they read FEDMOSAIC_DEVICE, as this one)."""
    return ["--device", args.device] if args.device else []


def _evaluate(args: argparse.Namespace, out: Path) -> None:
    if args.eval_limit <= 0:
        say("3/4 evaluation: skipped (--eval-limit 0)")
    elif (out / "eval" / "results.json").is_file():
        say(f"3/4 evaluation: reusing {out / 'eval'}")
    else:
        say(f"3/4 evaluation: {args.eval_limit} test examples per task, every client, global and base")
        run_step("evaluation", fedmosaic_argv("eval", str(out), "--limit", str(args.eval_limit),
                                              "--max-new-tokens", str(args.eval_max_new_tokens), *_device(args)))


def sample_prompt(out: Path) -> tuple[str, str, str] | None:
    """(client, instruction, reference) of the run's first client, from its data set's test (or train) split."""
    from training.data import load_run_dataset

    cfg = json.loads((out / "run.json").read_text())
    dataset = load_run_dataset(cfg, run_dir=out)
    for client in dataset.client_ids:
        records = dataset.tests.get(dataset.task_of(client)) or dataset.client(client).train
        if records:
            return client, records[0].instruction, records[0].output
    return None


def describe_route(ext: dict[str, Any]) -> str:
    """One line on how the server weighted the adapters (FedDPA: a and how it was obtained)."""
    info = ext.get("info") or {}
    weights = ", ".join(f"{k} {v:.3f}" for k, v in (ext.get("weights") or {}).items())
    if ext.get("mode") == "feddpa" and info.get("weighting") == "calibrated" and "score" in info:
        return (f"FedDPA weight a = {info.get('a', 0):.3f} (instance-wise, calibrated: score "
                f"{info['score']:.3f} between background {info.get('background', 0):.3f} and own "
                f"{info.get('own', 0):.3f}, lambda {info.get('lambda')}) -> {weights}")
    if ext.get("mode") == "feddpa" and "mean_similarity" in info:
        return (f"FedDPA weight a = {info.get('a', 0):.3f} (instance-wise: mean similarity "
                f"{info['mean_similarity']:.3f} over S = {info.get('S')} local instances, lambda "
                f"{info.get('lambda')}) -> {weights}")
    return f"mode {ext.get('mode')}: {weights} {json.dumps(info) if info else ''}".rstrip()


def _sample(api: str, out: Path, key: str | None) -> None:
    sample = sample_prompt(out)
    models = http_json("GET", f"{api}/v1/models", api_key=key)["data"]
    clients = {m["id"] for m in models if (m.get("fedmosaic") or {}).get("kind") == "feddpa"}
    if sample is None or sample[0] not in clients:
        say(f"served models: {', '.join(m['id'] for m in models)}")
        return
    client, instruction, reference = sample
    body = {"model": client, "prompt": INSTRUCTION.format(instruction=instruction), "max_tokens": 48,
            "temperature": 0, "stop": ["### Instruction"]}
    reply = http_json("POST", f"{api}/v1/completions", body, api_key=key)
    say(f"sample: client {client!r} asked {instruction!r}")
    say(f"  answer:    {reply['choices'][0]['text'].strip()!r}  (reference {reference!r})")
    say(f"  weighting: {describe_route(reply.get('fedmosaic') or {})}")


def _serve(args: argparse.Namespace, out: Path, began: float) -> int:
    port = pick_port(args.host, args.port)
    api = f"http://{args.host}:{port}"
    # the key travels in the environment (not in `ps`); it is the operator's, so an admin key: adapter
    # loading and the run's files in the demo. The demo explains FedDPA weights, so the server shows the
    # routing details to every caller (the operator's own run, on this machine).
    server_env = {"FEDMOSAIC_SERVE_ADMIN_KEYS": json.dumps([args.api_key])} if args.api_key else {}
    say(f"4/4 serving {out} at {api}" + ("" if args.no_demo else " and starting the demo"))
    children = [Child.start("API server", fedmosaic_argv("serve", str(out), "--model", args.model, "--host",
                                                         args.host, "--port", str(port), "--routing-details", "all",
                                                         *_device(args)), api, server_env)]
    try:
        wait_ready(children[0], f"{api}/health", args.ready_timeout)
        if not args.no_demo:
            demo = f"http://{args.host}:{pick_port(args.host, args.demo_port)}"
            children.append(Child.start("demo", [sys.executable, "-m", "demos", "--api-url", api, "--host", args.host,
                                                 "--port", demo.rsplit(":", 1)[1]], demo,
                                        {"FEDMOSAIC_API_KEY": args.api_key} if args.api_key else None))
            wait_ready(children[1], demo, args.ready_timeout)
        _sample(api, out, args.api_key)
    except BaseException as exc:
        for child in children:
            child.stop()
        if isinstance(exc, urllib.error.URLError | KeyError):
            raise QuickstartError(f"serving failed: {exc}") from exc
        raise
    say(f"ready in {time.perf_counter() - began:.0f} s")
    say(f"API   {api}/v1  (OpenAI-compatible; models: GET {api}/v1/models)")
    if not args.no_demo:
        say(f"demo  {children[1].url}")
        if args.open:
            webbrowser.open(children[1].url)
    if args.exit_after_ready:
        for child in children:
            child.stop()
        say("stopped (--exit-after-ready)")
        return 0
    say("press Ctrl-C to stop")
    return supervise(children)


def _raise_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM handler (the signal handler signature): stop the quick start as Ctrl-C does."""
    raise KeyboardInterrupt


def run_quickstart(args: argparse.Namespace) -> int:
    """Run every stage; returns 0 on success or Ctrl-C, 1 when a stage failed (its output says why)."""
    began = time.perf_counter()
    out = Path(args.out) if args.out else default_out(args.data)
    main = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None  # SIGTERM = Ctrl-C: children stop
    try:
        if args.model == "smollm2":
            say("1/4 base model: SmolLM2-135M-Instruct from the embedded GGUF (prepared once, then cached)")
            run_step("model preparation", fedmosaic_argv("models", "prepare", "smollm2"))
        else:
            say(f"1/4 base model: {args.model}")
        _train(args, out)
        _evaluate(args, out)
        if args.no_serve:
            say(f"done in {time.perf_counter() - began:.0f} s; serve it with `fedmosaic serve {out}`")
            return 0
        return _serve(args, out, began)
    except QuickstartError as exc:
        say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; run the same command again to resume")
        return 130
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
