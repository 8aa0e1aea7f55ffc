"""The OpenAPI document tells the truth: every status a route answers is documented with the error model.

``schemathesis run --checks all`` against a live server (a run with clients, admin and user keys,
protected metrics, runtime loading on) finds no undocumented status code, content type or header, no
5xx, no ignored authentication (the same command by hand: README, Serving). One deliberate setting:
``positive_data_acceptance`` accepts 400 for schema-valid requests, because this server refuses some
requests no JSON schema can describe (a prompt the chat template rejects, ``min_tokens`` above
``max_tokens``, a token id beyond the vocabulary, an adapter folder that does not exist).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from adapters.io import CONFIG_FILE
from serving.api import create_app
from serving.settings import ServeSettings
from tests.serving.helpers import write_feddpa_run

ADMIN, USER = "sk-admin", "sk-user"
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429"]

[parameters]
path = "eval/table.md"
"""


def settings(root: Path) -> ServeSettings:
    return ServeSettings(model="tiny", run_dir=root / "run", adapter_root=root, admin_keys=[ADMIN], api_keys=[USER],
                         max_tokens_limit=8, default_max_tokens=4, max_model_len=256, protect_metrics=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("schema")
    run = write_feddpa_run(root / "run", ("sorting", "capitals"))
    (run / "eval").mkdir()
    (run / "eval" / "table.md").write_text("| method | score |\n| --- | --- |\n| global | 1 |\n")
    return root


@pytest.fixture(scope="module")
def url(root: Path, live_server: Callable[..., str]) -> str:
    return live_server(settings(root))


def test_every_answered_status_is_documented_with_the_error_model(root: Path) -> None:
    document = create_app(settings(root)).openapi()
    expected = {
        ("/v1/chat/completions", "post"): {"200", "400", "401", "404", "413", "429", "500", "503", "504"},
        ("/v1/completions", "post"): {"200", "400", "401", "404", "413", "429", "500", "503", "504"},
        ("/v1/models", "get"): {"200", "401", "503"},
        ("/v1/models/{model}", "get"): {"200", "401", "404", "503"},
        ("/tokenize", "post"): {"200", "400", "401", "404", "413", "503"},
        ("/detokenize", "post"): {"200", "400", "401", "404", "413", "503"},
        ("/version", "get"): {"200"},
        ("/ping", "get"): {"200", "503"},
        ("/v1/load_lora_adapter", "post"): {"200", "400", "401", "403", "404", "413", "503"},
        ("/v1/unload_lora_adapter", "post"): {"200", "400", "401", "403", "404", "409", "413", "503"},
        ("/v1/run/files", "get"): {"200", "401", "403", "404"},
        ("/v1/run/files/{path}", "get"): {"200", "400", "401", "403", "404"},
        ("/health", "get"): {"200", "503"},
        ("/metrics", "get"): {"200", "401", "403"},
    }
    for (path, method), statuses in expected.items():
        responses = document["paths"][path][method]["responses"]
        assert set(responses) == statuses, path
        for status in statuses - {"200"}:
            assert responses[status]["content"] == {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}, (path, status)
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]) == {
        "application/json", "text/event-stream"}
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "securitySchemes" not in create_app(ServeSettings(model="tiny")).openapi()["components"]


def fuzz_env(root: Path) -> dict[str, str]:
    """The environment that points most fuzzed bodies at served models and real folders (the hooks module)."""
    folders = sorted(config.parent.relative_to(root) for config in root.rglob(CONFIG_FILE))
    return {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
            "FEDMOSAIC_FUZZ_MODELS": "tiny,global,sorting,capitals:local",
            "FEDMOSAIC_FUZZ_FOLDERS": ",".join(map(str, folders))}


@pytest.mark.parametrize("key", [ADMIN, USER])
def test_schemathesis_with_all_checks(url: str, root: Path, tmp_path: Path, key: str) -> None:
    pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe is not None
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    run = subprocess.run(
        [exe, "--config-file", str(config), "run", f"{url}/openapi.json", "--checks", "all",
         "-H", f"Authorization: Bearer {key}", "--max-examples", "30", "--workers", "1", "--seed", "15",
         "--continue-on-failure"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=fuzz_env(root))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Test cases:" in run.stdout and "failures" not in run.stdout.splitlines()[-1]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_answers_and_event_streams_match_their_documented_schemas(url: str, path: str, stream: bool) -> None:
    """Each JSON body, and each server-sent event of a stream ([DONE] last), passes schemathesis' checks."""
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    body: dict[str, object] = {"model": "sorting", "max_tokens": 4, "stream": stream, "temperature": 0}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Sort: b a"}]
    else:
        body["prompt"] = ["Sort: b a", "Sort: d c"]  # two choices interleave in one stream
    case = schema[path]["POST"].Case(body=body, headers={"Authorization": f"Bearer {USER}"})
    response = case.call()
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]")
    case.validate_response(response)  # raises on any violation (ST108 for an event)
