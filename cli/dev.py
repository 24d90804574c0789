"""`podctl dev`: developer tools (the bundled fake model server)."""

import sys
from typing import Annotated

import typer

from cli.app import app, sub_app
from cli.common import fail

dev_app = sub_app("Developer tools.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")


@dev_app.callback()
def dev() -> None:
    """Developer tools."""


def base_url_lines(root: str) -> str:
    """What to put in a manifest's `provider.base_url` for each kind: the openai SDK wants the
    `/v1` prefix in it, the anthropic SDK adds `/v1` itself."""
    return (
        f'  kind = "openai" or "openai_responses":  base_url = "{root}/v1"\n'
        f'  kind = "anthropic":                     base_url = "{root}"\n'
    )


@dev_app.command("fake-model")
def dev_fake_model(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port; 0 picks a free one.")
    ] = 0,
    script: Annotated[
        str | None, typer.Option("--script", metavar="FILE", help="Scripted replies (JSON).")
    ] = None,
    chunk_size: Annotated[
        int | None,
        typer.Option(
            "--chunk-size", min=1, metavar="N", help="Characters per streamed text delta [20]."
        ),
    ] = None,
) -> None:
    """Run the fake model server (OpenAI and Anthropic wire formats) for offline testing.

    It answers with the scripted replies in order, then `ok: <last user text>`. Prints the
    base_url each provider kind needs; runs until SIGTERM or Ctrl-C.
    """
    import errno
    import signal
    import threading

    import msgspec

    from poddaemon.testing.fake_model import DEFAULT_CHUNK_SIZE, FakeModel

    replies: list[object] = []
    if script:
        try:
            with open(script, "rb") as fh:
                payload = msgspec.json.decode(fh.read())
        except (OSError, msgspec.DecodeError) as exc:
            fail(f"cannot read script {script}: {exc}")
        found = payload.get("replies") if isinstance(payload, dict) else payload
        if not isinstance(found, list):
            fail(f'{script}: expected a list of replies or {{"replies": [...]}}')
        replies = found
    model = FakeModel(host, port, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE)
    try:
        model.script(*replies)  # type: ignore[arg-type]  # validated here, one by one
    except (TypeError, ValueError, msgspec.ValidationError) as exc:
        fail(f"{script}: bad reply: {exc}")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        model.start()
    except OSError as exc:
        taken = "; --port 0 picks a free one" if port and exc.errno == errno.EADDRINUSE else ""
        fail(f"cannot listen on {host}:{port}: {exc}{taken}")
    try:
        then = "then it answers" if replies else "it answers"
        sys.stdout.write(
            f"fake model listening on {model.url}"
            f" ({len(replies)} scripted replies; {then} `ok: <last user text>`)\n"
            + base_url_lines(model.url)
        )
        sys.stdout.flush()
        while not done.wait(1.0):
            pass
    finally:
        model.stop()
