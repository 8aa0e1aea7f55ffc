"""Issue 44 item 1: one tenant learns nothing of another tenant's prompts from the prefix cache or /metrics.

The attack of the security review (F1): tenant B's prompt to its FedDPA client runs a routing pass under
the shared ``global`` adapter and stays in the prefix cache; tenant A, bound to another client, probes
guesses of B's prompt and reads how many prompt tokens each probe reused (``/metrics``, or the time a
reused prefix saves). The guess sharing more of B's prompt reused more: B's PIN came out digit by digit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serving.openai.chat_format import template_head
from serving.settings import ServeSettings
from tests.serving.helpers import ready_client

ADMIN, TENANT_A, TENANT_B, UNBOUND = "sk-admin", "sk-tenant-a", "sk-tenant-b", "sk-unbound"
# B's recurring prompt; A guesses the digit after "=" (digits and "=" are tokens of their own)
SECRET = "Remember for later: the vault PIN=8 3 1 7, door 42."
REUSED = "fedmosaic_prefix_cache_reused_tokens_total"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tenants")
    (root / "bindings.json").write_text(json.dumps({"keys": [
        {"key": TENANT_A, "clients": ["sorting"], "name": "a"},
        {"key": TENANT_B, "clients": ["capitals"], "name": "b"}]}))
    return root


def serve(run: Path, root: Path, **settings: object) -> AbstractContextManager[TestClient]:
    """The API over the shared FedDPA run (``feddpa_run``), its keys bound by ``root``'s bindings."""
    return ready_client(ServeSettings(model="tiny", run_dir=run, feddpa_routing="instance", feddpa_weighting="paper",
                                      key_bindings=root / "bindings.json", **settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def client(feddpa_run: Path, root: Path) -> Iterator[TestClient]:
    with serve(feddpa_run, root, admin_keys=[ADMIN]) as client:
        yield client


def complete(client: TestClient, key: str, model: str, prompt: str) -> None:
    reply = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text


def reused(client: TestClient, key: str) -> float | None:
    """The reused-token counter as ``key`` reads it from /metrics (None when refused)."""
    page = client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    if page.status_code != 200:
        return None
    return next(float(line.split()[-1]) for line in page.text.splitlines() if line.startswith(REUSED + " "))


def test_a_tenant_cannot_probe_another_tenants_cached_prompt(client: TestClient) -> None:
    complete(client, TENANT_A, "sorting", "Remember for later: the vault PIN=x ok")  # A's own copy of the public part
    seen: dict[int, float] = {}
    for digit in range(10):
        complete(client, TENANT_B, "capitals", SECRET)  # recurring; its routing pass runs `global` alone
        assert reused(client, TENANT_A) is None, "a tenant reads /metrics: its reuse counts probe others' prompts"
        before = reused(client, ADMIN)
        complete(client, TENANT_A, "sorting", f"Remember for later: the vault PIN={digit} ok")  # global alone too
        after = reused(client, ADMIN)
        assert before is not None and after is not None
        seen[digit] = after - before  # what the time to A's first token shows
    # every guess reuses A's own "...the vault PIN=" and nothing of B's prompt: the right digit stands out nowhere
    assert len(set(seen.values())) == 1, seen
    assert seen[8] > 0  # the prefix cache still works within a tenant


def test_a_tenants_own_prompts_share_the_routing_pass_prefix(client: TestClient) -> None:
    prompt = "Sort these words for me please: kiwi, fig, plum"
    before = reused(client, ADMIN)
    complete(client, TENANT_A, "global", prompt)
    complete(client, TENANT_A, "sorting", prompt)  # its routing pass (global alone) reuses the `global` request's
    after = reused(client, ADMIN)
    assert before is not None and after is not None and after > before


def chat(client: TestClient, key: str, model: str, content: str) -> None:
    reply = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
        "model": model, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 200, reply.text


def test_tenants_share_the_chat_template_and_nothing_after_it(client: TestClient) -> None:
    tokenizer = client.app.state.server.engine.tokenizer  # type: ignore[attr-defined]
    # the template's own text: the run's targets answer chat in the template their adapters trained with
    template = len(tokenizer(template_head("alpaca_short"), add_special_tokens=False)["input_ids"])
    chat(client, TENANT_B, "capitals", SECRET)
    before = reused(client, ADMIN)
    chat(client, TENANT_A, "sorting", "Quite another question")  # A's first chat: only B's prompt could serve it
    after = reused(client, ADMIN)
    assert before is not None and after is not None and after - before == template  # the routing pass's template
    chat(client, TENANT_A, "sorting", "Remember for later: the vault PIN=x ok")  # A's own copy of the public part
    seen: dict[int, float] = {}
    for digit in range(10):
        chat(client, TENANT_B, "capitals", SECRET)
        before = reused(client, ADMIN)
        chat(client, TENANT_A, "sorting", f"Remember for later: the vault PIN={digit} ok")
        after = reused(client, ADMIN)
        assert before is not None and after is not None
        seen[digit] = after - before
    assert len(set(seen.values())) == 1, seen  # B's message after the template is never reused by A


def test_metrics_need_the_admin_key_whenever_keys_are_configured(feddpa_run: Path, root: Path) -> None:
    (root / "users.txt").write_text(f"{UNBOUND}\n")
    # users, no admin key
    with serve(feddpa_run, root, api_key_file=root / "users.txt", allow_runtime_lora=True) as client:
        for key in (UNBOUND, TENANT_A):
            assert client.get("/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 403
        assert client.get("/metrics").status_code == 401
        # unloading `global` (pinned: every tenant's client needs it) takes an admin key, even where an unbound
        # user key may use the other admin operations
        unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "global", "force": True},
                             headers={"Authorization": f"Bearer {UNBOUND}"})
        assert unload.status_code == 403, unload.text
        complete(client, TENANT_A, "sorting", "Sort: b, a")
