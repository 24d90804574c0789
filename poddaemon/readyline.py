"""The lines a starting pod prints on stderr for whoever waits for it (SPEC §7):
`PODDAEMON-READY\t<name>\t<socket>` once its socket listens and, before that, from a pod whose
MCP servers or SessionStart hooks may take long, `PODDAEMON-STARTING\t<seconds>`: the waiter
gives it that much longer. The pod prints them; podctl and a spawning pod read them."""

READY = "PODDAEMON-READY"
STARTING = "PODDAEMON-STARTING"
# The exit status of a pod that refused to start (its manifest, its name or scope taken, a
# session it cannot restore): sysexits' EX_CONFIG. Starting it again changes nothing, so a
# unit does not restart it (RestartPreventExitStatus=). Any other failure exits 1.
EXIT_REFUSED = 78
_READY = READY.encode() + b"\t"
_STARTING = STARTING.encode() + b"\t"


def parse_ready(line: bytes) -> tuple[str, str] | None:
    """`(name, socket)` from a READY line, or None when the line is something else."""
    if not line.startswith(_READY):
        return None
    parts = line.rstrip(b"\r\n").decode("utf-8", "replace").split("\t")
    if len(parts) < 3 or not parts[1]:
        return None
    return parts[1], parts[2]


def parse_starting(line: bytes) -> float | None:
    """The seconds a STARTING line announces, or None for any other line."""
    if not line.startswith(_STARTING):
        return None
    try:
        return max(0.0, float(line[len(_STARTING) :]))
    except ValueError:
        return None
