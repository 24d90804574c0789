"""Start-up warnings about a provider's base_url (issue 9 item 20): clearly wrong paths, and a
local server that does not answer. Warnings only: nothing here may fail a start."""

import socket
from collections.abc import Iterator

import pytest

from poddaemon.llm.preflight import (
    base_url_problems,
    is_local,
    local_unreachable,
    preflight,
    too_many_tools,
)
from poddaemon.testing.fake_model import FakeModel


@pytest.fixture
def fake() -> Iterator[FakeModel]:
    with FakeModel() as model:
        yield model


@pytest.mark.parametrize(
    ("kind", "url"),
    [
        ("openai", None),
        ("openai", "https://api.openai.com/v1"),
        ("openai", "https://api.deepseek.com"),  # remote roots are fine for some servers
        ("openai", "https://openrouter.ai/api/v1"),
        ("openai", "https://api.groq.com/openai/v1"),
        ("openai", "http://127.0.0.1:11434/v1"),
        ("openai", "http://localhost:8000/v1/"),
        ("openai_responses", "http://127.0.0.1:9/v1"),
        ("anthropic", "https://api.anthropic.com"),
        ("anthropic", "http://127.0.0.1:9"),
        ("anthropic", "http://127.0.0.1:9/v1"),  # tolerated (SPEC §3)
    ],
)
def test_plausible_urls_pass(kind: str, url: str | None) -> None:
    assert base_url_problems(kind, url) == []


@pytest.mark.parametrize(
    ("kind", "url", "says"),
    [
        ("openai", "http://127.0.0.1:8400", "'http://127.0.0.1:8400/v1'"),
        ("openai", "http://localhost:8400/", "'http://localhost:8400/v1'"),
        ("openai_responses", "http://[::1]:8400", "/v1"),
        ("openai", "http://127.0.0.1:8400/v1/chat/completions", "'http://127.0.0.1:8400/v1'"),
        ("openai_responses", "https://api.openai.com/v1/responses", "'https://api.openai.com/v1'"),
        ("openai", "https://api.openai.com/v1/v1", "/v1 twice"),
        ("anthropic", "https://api.anthropic.com/v1/messages", "endpoint /messages"),
        ("anthropic", "http://127.0.0.1:8400/v1/v1", "'http://127.0.0.1:8400'"),
        ("openai", "127.0.0.1:8400/v1", "not an http(s) URL"),
    ],
)
def test_clearly_wrong_urls_warn_with_the_fix(kind: str, url: str, says: str) -> None:
    problems = base_url_problems(kind, url)
    assert len(problems) == 1 and says in problems[0], problems
    assert problems[0].startswith("provider.base_url ")


def test_is_local() -> None:
    assert all(map(is_local, ["localhost", "127.0.0.1", "127.3.4.5", "::1", "app.localhost"]))
    assert not any(map(is_local, ["api.openai.com", "10.0.0.1", "192.168.1.2", "0:0::2"]))


def test_a_local_server_that_answers_passes(fake: FakeModel) -> None:
    assert preflight("openai", fake.openai_base_url) == []
    assert preflight("anthropic", fake.url) == []


def test_the_fake_models_root_warns_for_openai_kinds(fake: FakeModel) -> None:
    # The mistake the old `podctl dev fake-model` output invited (it printed the root).
    [warning] = preflight("openai", fake.url)
    assert f"{fake.url}/v1" in warning


def test_a_local_server_that_does_not_answer_warns() -> None:
    with socket.socket() as probe:  # a port nothing listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        [warning] = preflight("openai", f"http://127.0.0.1:{port}/v1")
    assert f"nothing answers at 127.0.0.1:{port}" in warning
    assert "refused" in warning.lower()


def test_remote_servers_are_never_contacted() -> None:
    # 192.0.2.0/24 is TEST-NET-1: a connect would hang to the timeout; local_unreachable skips it.
    assert local_unreachable("http://192.0.2.1:9/v1", timeout=5.0) is None
    assert local_unreachable(None) is None


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1/v1", "https://[zz]:80/v1"])
def test_a_url_urlsplit_refuses_is_a_warning_not_an_exception(url: str) -> None:
    # urlsplit raised "Invalid IPv6 URL": a traceback that ended the pod's start-up.
    assert preflight("anthropic", url, timeout=0.1) == [
        f"provider.base_url {url!r} is not an http(s) URL"
    ]
    assert local_unreachable(url) is None


def test_the_field_is_named_as_given() -> None:
    [warning] = base_url_problems(
        "openai", "http://127.0.0.1:1", field="compaction.provider.base_url"
    )
    assert warning.startswith("compaction.provider.base_url ")


@pytest.mark.parametrize(
    ("kind", "count", "warns"),
    [
        ("openai", 128, False),
        ("openai", 129, True),
        ("openai_responses", 129, True),
        ("anthropic", 500, False),
    ],
)
def test_too_many_tools_warns_only_past_openais_limit(kind: str, count: int, warns: bool) -> None:
    warning = too_many_tools(kind, count)
    assert (warning is not None) == warns
    if warning is not None:
        assert warning.startswith(f"{count} tools are offered")
