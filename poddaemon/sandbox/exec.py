"""`python -I -m poddaemon.sandbox.exec POLICY_FILE -- CMD [ARG ...]`: confine, then exec CMD.

The policy file holds a JSON `Policy` (`Policy.encode()`). The command gets the policy's
private temp dir as `$TMPDIR` and the effective sandbox as `$PODDAEMON_SANDBOX`. Exit 126 when
the sandbox cannot be applied (one line on stderr), 127 when CMD is not found, as a shell does.
"""

import os
import sys

import msgspec


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -I -m poddaemon.sandbox.exec POLICY_FILE -- CMD [ARG ...]",
            file=sys.stderr,
        )
        return 2
    from poddaemon.sandbox import Policy, SandboxError, apply_policy

    try:
        with open(argv[0], "rb") as f:
            raw = f.read()
        tmpdir = msgspec.json.decode(raw, type=Policy).tmpdir
        effective = apply_policy(raw)
    except (OSError, msgspec.DecodeError, SandboxError) as e:
        print(f"poddaemon.sandbox.exec: {e}", file=sys.stderr)
        return 126
    env = dict(os.environ)
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    env["PODDAEMON_SANDBOX"] = effective
    cmd = argv[2:]
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        print(f"poddaemon.sandbox.exec: {cmd[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as e:
        print(f"poddaemon.sandbox.exec: {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
