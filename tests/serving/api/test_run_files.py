"""GET /v1/run/files: the served run's eval tables and plots, confined to <run>/eval (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serving.api import create_app
from serving.settings import ServeSettings

KEY = "sk-files"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "eval" / "predictions" / "final").mkdir(parents=True)
    (run / "eval" / "table.md").write_text("| Method | Avg |\n|---|---:|\n| feddpa-t | 41.00 |\n")
    (run / "eval" / "scores.png").write_bytes(PNG)
    (run / "eval" / "results.json").write_text('{"metric": "rouge1"}')
    (run / "eval" / "notes.txt").write_text("not a report")
    (run / "eval" / "predictions" / "final" / "cache.json").write_text("{}")
    (run / "run.json").write_text('{"method": "feddpa-t"}')
    (tmp_path / "secret.md").write_text("outside the run")
    (run / "eval" / "leak.md").symlink_to(tmp_path / "secret.md")
    return run


def client(run_dir: Path | None) -> TestClient:
    # no lifespan entered: these routes read only the settings, so no model is loaded
    app = create_app(ServeSettings(model="tiny", run_dir=run_dir, api_keys=[KEY]))
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"})


def error(response, status: int) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_lists_reports_only(run: Path) -> None:
    body = client(run).get("/v1/run/files").json()
    assert body["object"] == "list" and body["run"] == "run"
    assert [(f["path"], f["media_type"]) for f in body["data"]] == [
        ("eval/results.json", "application/json"), ("eval/scores.png", "image/png"),
        ("eval/table.md", "text/markdown; charset=utf-8")]  # no cache, no .txt, no symlink out
    assert body["data"][1]["bytes"] == len(PNG)


def test_serves_files_with_their_type(run: Path) -> None:
    http = client(run)
    table = http.get("/v1/run/files/eval/table.md")
    assert table.status_code == 200 and table.headers["content-type"].startswith("text/markdown")
    assert "feddpa-t | 41.00" in table.text
    plot = http.get("/v1/run/files/eval/scores.png")
    assert plot.content == PNG and plot.headers["content-type"] == "image/png"


def test_confinement_and_errors(run: Path) -> None:
    http = client(run)
    assert error(http.get("/v1/run/files/eval/%2E%2E/run.json"), 403)["code"] == "path_not_allowed"
    assert error(http.get("/v1/run/files/eval/leak.md"), 403)["code"] == "path_not_allowed"  # symlink out
    assert error(http.get("/v1/run/files/run.json"), 403)["code"] == "path_not_allowed"
    assert "only" in error(http.get("/v1/run/files/eval/notes.txt"), 400)["message"]
    assert "GET /v1/run/files" in error(http.get("/v1/run/files/eval/missing.md"), 404)["message"]
    assert "not a usable path" in error(http.get("/v1/run/files/eval/" + "x" * 5000 + ".md"), 400)["message"]
    assert error(http.get("/v1/run/files/eval/%00.md"), 400)["type"] == "BadRequestError"
    assert error(http.get("/v1/run/files/eval/predictions/final/cache.json"), 404)["type"] == "NotFoundError"
    assert error(http.get("/v1/run/files", headers={"Authorization": "Bearer wrong"}), 401)["code"] == "unauthorized"


def test_no_run_or_no_evaluation_is_404(run: Path, tmp_path: Path) -> None:
    assert "serves no run directory" in error(client(None).get("/v1/run/files"), 404)["message"]
    bare = tmp_path / "bare"
    bare.mkdir()
    assert "fedmosaic eval" in error(client(bare).get("/v1/run/files/eval/table.md"), 404)["message"]
