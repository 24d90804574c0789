"""5. The first model request's size for the demo manifest, split by what it carries."""

import shutil

import msgspec

from bench.harness import ROOT, Home, Row, Section, value_le

DEMO = ROOT / "examples" / "demo"


def run(sec: Section) -> None:
    with Home() as home:
        fake = home.fake
        assert fake is not None
        demo = home.path / "demo"
        # The checkout's workspace/ is made by `make demo` or the quick start: start clean.
        shutil.copytree(DEMO, demo, ignore=shutil.ignore_patterns("workspace"))
        (demo / "workspace").mkdir()
        (demo / "workspace" / "TODO.md").write_text("# TODO\n- [ ] review the README\n")
        pod = home.start_pod(
            "demo", "--set", f"provider.base_url={fake.openai_base_url}", manifest=demo / "pod.toml"
        )
        with pod.rpc() as c:
            c.call("run", {"input": "Tick off the README review in TODO.md.", "wait": True})
        first = fake.requests()[0]
    body = first["body"]
    total = int(first["headers"]["content-length"])
    enc = msgspec.json.encode
    system = sum(len(enc(m)) for m in body["messages"] if m.get("role") in ("system", "developer"))
    tools = len(enc(body.get("tools", [])))
    names = [t["function"]["name"] for t in body.get("tools", [])]
    sec.add(Row("first request body, total", total, "B", target=value_le(6144, "B")))
    sec.add(Row("  system prompt message", system, "B"))
    sec.add(Row(f"  tool schemas ({len(names)})", tools, "B"))
    sec.add(Row("  rest (user input, model, options)", total - system - tools, "B"))
    per_tool = {t["function"]["name"]: len(enc(t)) for t in body.get("tools", [])}
    sec.note("per tool: " + ", ".join(f"{k} {v} B" for k, v in per_tool.items()))
    sec.note(
        "total = the Content-Length the fake received; parts re-encoded compactly "
        "(msgspec), so the JSON framing around them counts as rest; target 6 KB = 6144 B"
    )
