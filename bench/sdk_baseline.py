"""The plain-SDK baseline, as a long-lived helper: `python -m bench.sdk_baseline BASE_URL`.

Builds `openai.OpenAI(base_url=..., api_key="x", max_retries=0)` once, prints `READY`, then
serves commands, one JSON line each on stdin: `{"replies": [...], "bodies": [...]}` scripts the
fake model with `replies` (the same answers the pod got; may be empty) and sends every body in
order with `stream=True` through the SDK's `post()` (the call the pod's adapter makes, so both
sides pay the same SDK cost), reading each stream to its end. It answers one JSON line: the seconds
each request took. The bodies are the very ones the pod sent (recorded by the fake model), so
both sides move the same bytes; the bench alternates pod and SDK so noise hits both alike.
"""

import json
import sys
import time
import urllib.request


def main() -> None:
    base_url = sys.argv[1]
    import openai
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    root = base_url.removesuffix("/v1")
    print("READY", flush=True)
    clock = time.perf_counter
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("replies"):
            req = urllib.request.Request(
                root + "/_fake/script",
                method="POST",
                data=json.dumps({"replies": cmd["replies"]}).encode(),
                headers={"Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=30).read()
        times = []
        for body in cmd["bodies"]:
            t = clock()
            stream = client.post(
                "/chat/completions",
                cast_to=ChatCompletion,
                body=body,
                stream=True,
                stream_cls=openai.Stream[ChatCompletionChunk],
            )
            for _ in stream:
                pass
            times.append(clock() - t)
        print(json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
