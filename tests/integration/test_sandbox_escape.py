"""The escape suite: real bash under the Landlock policy built from a real manifest's scope.

Every attack is run twice: confined (it must fail and change nothing) and, as a control, with
the same launcher in mode "off" (it must succeed, so the test proves the sandbox stopped it, not
a typo). Then the ordinary work a command does inside its scope must still work.
"""

import hashlib
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from poddaemon.config import load_manifest
from poddaemon.sandbox import Policy, available, build_policy
from poddaemon.scope import Scope
from protocol import paths

ABI = available()
pytestmark = pytest.mark.skipif(ABI == 0, reason="this kernel has no Landlock")

MANIFEST = """\
[pod]
name = "escapee"
pwd = "."

[provider]
kind = "openai"
model = "m"

[[scope.allow]]
target = "."
permission = "write"
[[scope.allow]]
target = "../shared"
permission = "read"
[[scope.deny]]
target = "./secrets"
permission = "read"
[[scope.deny]]
target = "./vendor"
permission = "write"

[sandbox]
network = false
"""


@dataclass
class World:
    base: Path
    work: Path
    env: dict[str, str]
    policy: Path
    control: Path  # the same rules, mode "off"
    notes: tuple[str, ...]

    def run(self, script: str, *, confined: bool = True) -> subprocess.CompletedProcess[str]:
        pol = self.policy if confined else self.control
        cmd = [sys.executable, "-I", "-m", "poddaemon.sandbox.exec", str(pol), "--"]
        return subprocess.run(
            [*cmd, "bash", "-c", script],
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def snapshot(self) -> dict[str, str]:
        """Every file outside the writable scope and the private tmp dir, with a content hash."""
        out: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(self.base):
            rel = os.path.relpath(dirpath, self.base)
            if rel == "tmp" or rel.startswith("tmp/"):
                continue
            if rel.startswith("work") and not rel.startswith(("work/secrets", "work/vendor")):
                continue
            for name in filenames + [d for d in dirnames if os.path.islink(f"{dirpath}/{d}")]:
                p = os.path.join(dirpath, name)
                data = os.readlink(p).encode() if os.path.islink(p) else Path(p).read_bytes()
                out[os.path.relpath(p, self.base)] = hashlib.sha256(data).hexdigest()
        return out


def policy_for(base: Path) -> Policy:
    """The policy for the manifest in `base/work`, built as the pod would: scope from the real
    manifest, this user's poddaemon directories protected, HOME = the fake home."""
    home = base / "shared" / "home"
    old = {k: os.environ.get(k) for k in ("PODDAEMON_HOME", "HOME")}
    os.environ.update(PODDAEMON_HOME=str(home), HOME=str(base / "fakehome"))
    try:
        m = load_manifest(base / "work" / "pod.toml", defaults_path=base / "no-defaults.toml")
        scope = Scope.from_config(m.scope.allow, m.scope.deny, cwd=m.pod.pwd)
        protect = [str(paths.data_dir()), str(paths.runtime_dir()), str(paths.log_dir())]
        return build_policy(
            scope,
            pwd=m.pod.pwd,
            tmpdir=str(base / "tmp"),
            network=m.sandbox.network,
            mode=m.sandbox.mode,
            protect=protect,
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_world(base: Path) -> World:
    files = {
        "work/pod.toml": MANIFEST,
        "work/README": "readme\n",
        "work/src/hello.c": '#include <stdio.h>\nint main(void){puts("hello");return 0;}\n',
        "work/secrets/key": "TOPSECRET\n",
        "work/vendor/lib.c": "int lib;\n",
        "shared/doc.txt": "shared doc\n",
        "shared/home/data/sessions/s.jsonl": '{"kind":"session"}\n',
        "shared/home/run/pods.json": "{}\n",
        "other/scope.txt": "another pod's file\n",
        "outside/secret.txt": "outside secret\n",
        "fakehome/.gitconfig": "[user]\n\tname = Sandboxed User\n\temail = s@example.com\n",
        "fakehome/.ssh/id_ed25519": "PRIVATE KEY\n",
        "fakehome/.bashrc": "# rc\n",
    }
    for rel, text in files.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(text)
    (base / "tmp").mkdir()
    home = base / "shared" / "home"
    policy = policy_for(base)
    (base / "policy.json").write_bytes(policy.encode())
    control = msgspec.structs.replace(policy, mode="off")
    (base / "control.json").write_bytes(control.encode())
    env = {
        "PATH": f"{os.path.join(sys.base_prefix, 'bin')}:/usr/bin:/bin",
        "HOME": str(base / "fakehome"),
        "LANG": "C.UTF-8",
        "BASE": str(base),
        "OUT": str(base / "outside"),
        "OTHER": str(base / "other"),
        "DATA": str(home / "data"),
        "RUN": str(home / "run"),
    }
    return World(
        base, base / "work", env, base / "policy.json", base / "control.json", policy.notes
    )


@pytest.fixture
def world() -> Iterator[World]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        yield make_world(Path(os.path.realpath(d)))


# Each script exits 0 exactly when the attack worked.
ESCAPES = {
    "read outside": 'cat "$OUT/secret.txt"',
    "write outside": 'echo pwn > "$OUT/secret.txt"',
    "create outside": 'echo pwn > "$OUT/new.txt"',
    "read a deny-read file": "cat secrets/key",
    "write a deny-read file": "echo pwn > secrets/key",
    "append to a deny-write file": "echo pwn >> vendor/lib.c",
    "truncate a deny-write file": "truncate -s 0 vendor/lib.c",
    "read via /proc/self/root": 'cat "/proc/self/root$OUT/secret.txt"',
    "write via /proc/self/root": 'echo pwn > "/proc/self/root$OUT/secret.txt"',
    "read a denied file via /proc/self/cwd": "cat /proc/self/cwd/secrets/key",
    "symlink to a file outside": 'ln -sf "$OUT/secret.txt" src/l1 && cat src/l1',
    "symlink to a dir outside": 'ln -sfn "$OUT" src/l2 && echo pwn > src/l2/new.txt',
    "hard link to a file outside": 'ln "$OUT/secret.txt" src/hard',
    "hard link to a denied file": "ln secrets/key src/hard2 && cat src/hard2",
    "move a denied file out": "mv secrets/key src/key && cat src/key",
    # The rename itself succeeds (an entry in the writable pwd) but the rules follow the inode.
    "rename the denied dir, then read": "{ mv secrets public || true; } && cat public/key",
    "dot-dot": "cat src/../../outside/secret.txt",
    "absolute path through the scope": 'cat "$BASE/work/../outside/secret.txt"',
    "read ~/.ssh": "cat ~/.ssh/id_ed25519",
    "read another dotfile": "cat ~/.bashrc",
    "write ~/.gitconfig": "echo pwn >> ~/.gitconfig",
    "read another pod's scope": 'cat "$OTHER/scope.txt"',
    "write another pod's scope": 'echo pwn > "$OTHER/scope.txt"',
    "read this user's session log": 'cat "$DATA/sessions/s.jsonl"',
    "write this user's session log": 'echo pwn >> "$DATA/sessions/s.jsonl"',
    "read the registry": 'cat "$RUN/pods.json"',
    "write the registry": 'echo "{\\"x\\": 1}" > "$RUN/pods.json"',
    "write a readable scope": 'echo pwn >> "$BASE/shared/doc.txt"',
    "write the shared /tmp": 'f="/tmp/poddaemon-escape-$$" && echo pwn > "$f" && rm "$f"',
    "write /dev/shm": 'f="/dev/shm/poddaemon-escape-$$" && echo pwn > "$f" && rm "$f"',
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escape_fails(world: World, name: str) -> None:
    before = world.snapshot()
    r = world.run(ESCAPES[name])
    assert r.returncode != 0, f"escaped: {name}: {r.stdout!r}"
    assert "SECRET" not in r.stdout and "pwn" not in r.stdout
    if name != "rename the denied dir, then read":  # renaming entries is the documented leak
        assert world.snapshot() == before
    control = world.run(ESCAPES[name], confined=False)
    assert control.returncode == 0, f"the attack itself is broken: {control.stderr}"


@pytest.fixture
def outsider() -> Iterator[int]:
    """An unconfined process holding a secret in its environment, like the pod's API key."""
    env = {**os.environ, "PODDAEMON_FAKE_KEY": "sk-secret"}
    proc = subprocess.Popen(["sleep", "120"], env=env)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_cannot_read_or_signal_processes_outside(world: World, outsider: int) -> None:
    read = f"tr '\\0' '\\n' < /proc/{outsider}/environ | grep sk-secret"
    assert world.run(read).returncode != 0
    assert world.run(read, confined=False).returncode == 0
    if ABI >= 6:  # signals are scoped to the domain from ABI 6
        kill = f"kill -TERM {outsider}"
        assert world.run(kill).returncode != 0
        os.kill(outsider, 0)  # still alive


# Capabilities that act on the machine, not on a path (reboot, kexec, the clock, real-time
# scheduling, immutable files, the kernel log): no Landlock rule can confine them.
HOST_CAPS = {"cap_sys_boot": 22, "cap_sys_time": 25, "cap_sys_nice": 23, "cap_linux_immutable": 9,
             "cap_syslog": 34, "cap_sys_pacct": 20, "cap_ipc_owner": 15}  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="only root holds capabilities to drop")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="reboot(2) is syscall 169 on x86_64")
def test_root_commands_keep_no_capability_that_acts_on_the_machine(world: World) -> None:
    # A root pod's command could reboot the host or kexec another kernel (CAP_SYS_BOOT; checked
    # harmlessly: reboot(2) with a wrong magic says EINVAL when permitted, EPERM when not).
    show = "grep CapBnd /proc/self/status | cut -f2"
    reboot = (
        "python3 -c 'import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        "libc.syscall(169, 0, 0, 0, 0); print(os.strerror(ctypes.get_errno()))'"
    )
    confined = int(world.run(show).stdout, 16)
    held = [name for name, bit in HOST_CAPS.items() if confined >> bit & 1]
    assert not held, held
    assert world.run(reboot).stdout.strip() == "Operation not permitted"
    assert world.run(reboot, confined=False).stdout.strip() == "Invalid argument"


CONNECT = (
    "python3 -c 'import socket, sys; socket.create_connection((\"127.0.0.1\", {}), timeout=5)'"
)


def test_network_false_blocks_tcp(world: World) -> None:
    with socket.create_server(("127.0.0.1", 0), backlog=8) as server:
        port = server.getsockname()[1]
        r = world.run(CONNECT.format(port))
        assert r.returncode != 0 and "PermissionError" in r.stderr
        assert world.run(CONNECT.format(port), confined=False).returncode == 0
        # The same sandbox with network = true lets it through.
        policy = msgspec.json.decode(world.policy.read_bytes(), type=Policy)
        world.policy.write_bytes(msgspec.structs.replace(policy, network=True).encode())
        assert world.run(CONNECT.format(port)).returncode == 0


UDP = (
    "python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    's.sendto(b"leak", ("127.0.0.1", {}))\''
)


def test_network_false_blocks_udp_too(world: World) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        server.settimeout(10)
        port = server.getsockname()[1]
        r = world.run(UDP.format(port))
        assert r.returncode != 0 and "PermissionError" in r.stderr
        assert world.run(UDP.format(port), confined=False).returncode == 0
        assert server.recv(16) == b"leak"  # only the control's datagram ever arrived
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.recv(16)
    assert world.run("python3 -c 'import socket; a, b = socket.socketpair()'").returncode == 0


@pytest.mark.skipif(ABI < 6, reason="abstract unix sockets are scoped from Landlock ABI 6")
def test_abstract_unix_sockets_outside_are_unreachable(world: World) -> None:
    name = f"\0poddaemon-escape-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen(1)
        script = (
            "python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); "
            f's.connect("\\0{name[1:]}")\''
        )
        assert world.run(script).returncode != 0
        assert world.run(script, confined=False).returncode == 0


# --- everything inside the scope still works ----------------------------------------------


def test_build_a_c_program(world: World) -> None:
    r = world.run("cd src && gcc -O0 -o hello hello.c && ./hello")
    assert (r.returncode, r.stdout) == (0, "hello\n"), r.stderr


def test_git(world: World) -> None:
    r = world.run(
        "cd src && git init -q && git add hello.c && git commit -qm first && "
        "echo '// more' >> hello.c && git status --short && git config user.name"
    )
    assert (r.returncode, r.stdout) == (0, " M hello.c\nSandboxed User\n"), r.stderr


def test_python_a_package_and_pipes(world: World) -> None:
    r = world.run(
        "mkdir -p src/pkg && echo 'def f(): return 42' > src/pkg/__init__.py && "
        "cd src && python3 -c 'import pkg, sys; print(pkg.f())' && "
        "seq 1 1000 | sort -rn | head -1 | tr 0 o"
    )
    assert (r.returncode, r.stdout) == (0, "42\n1ooo\n"), r.stderr


def test_private_tmpdir_and_reads(world: World) -> None:
    r = world.run(
        'f=$(mktemp) && echo tmp-ok > "$f" && cat "$f" && '
        'python3 -c "import tempfile; print(tempfile.gettempdir())" && '
        "cat ../shared/doc.txt vendor/lib.c && echo more >> README && tail -1 README && "
        "ls secrets"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"tmp-ok\n{world.base}/tmp\nshared doc\nint lib;\nmore\nkey\n"
    )  # `ls secrets`: names stay listable, as the notes say


def test_new_files_next_to_a_deny_need_a_rebuild(world: World) -> None:
    """The kernel limit, shown: the pwd holds a denied dir, so it cannot carry a recursive
    rule; files created directly in it are not writable until the policy is rebuilt."""
    assert any(n.startswith(f"{world.work}: files created directly in it") for n in world.notes)
    r = world.run("echo one > notes.txt")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert (world.work / "notes.txt").exists()  # created, but its contents were refused
    world.policy.write_bytes(policy_for(world.base).encode())  # a fresh sandbox
    r = world.run("echo two > notes.txt && cat notes.txt")
    assert (r.returncode, r.stdout) == (0, "two\n"), r.stderr


def test_the_sandbox_survives_setsid_and_nohup(world: World) -> None:
    r = world.run(f'setsid nohup cat "$OUT/secret.txt" > {world.work}/src/out.log 2>&1; true')
    assert r.returncode == 0
    assert "Permission denied" in (world.work / "src" / "out.log").read_text()


def test_a_directory_swapped_for_a_link_after_the_policy_was_built_grants_nothing() -> None:
    """The policy holds resolved paths; the runner opens them when it starts, later. Another
    user who may write in a tree above a write grant (`shared/proj/src`, `shared` 0777)
    renamed `proj` away and put a link to elsewhere in its place: Landlock followed it and
    granted the link's target, and root's `bash` wrote there."""
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        base = Path(os.path.realpath(d))
        (base / "shared" / "proj" / "src").mkdir(parents=True)
        (base / "elsewhere" / "src").mkdir(parents=True)
        (base / "tmp").mkdir()
        scope = Scope.from_config([(str(base / "shared" / "proj" / "src"), "write", True)])
        policy = build_policy(scope, pwd=str(base / "tmp"), tmpdir=str(base / "tmp"))
        (base / "policy.json").write_bytes(policy.encode())
        (base / "control.json").write_bytes(msgspec.structs.replace(policy, mode="off").encode())
        (base / "shared" / "proj").rename(base / "shared" / "old")
        (base / "shared" / "proj").symlink_to(base / "elsewhere")
        script = ["bash", "-c", f'echo pwn > "{base}/shared/proj/src/x"']
        launcher = [sys.executable, "-I", "-m", "poddaemon.sandbox.exec"]
        for pol in ("policy.json", "control.json"):
            r = subprocess.run(
                [*launcher, str(base / pol), "--", *script],
                cwd=base / "tmp",
                capture_output=True,
                text=True,
                timeout=60,
            )
            if pol == "policy.json":
                assert r.returncode != 0 and "Permission denied" in r.stderr, r
                assert not (base / "elsewhere" / "src" / "x").exists()
            else:
                assert r.returncode == 0, f"the attack itself is broken: {r.stderr}"
