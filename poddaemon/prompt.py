"""System prompt: the manifest's instruction as a sandboxed jinja2 template.

Compiled at start-up and rendered as the pod starts (a template error, in either, fails start-up
naming the line), with `now`, `pwd`, `scope`, `tools` and `agents_md`.
"""

import datetime
import os
import stat
from typing import Any

from poddaemon.scope import Access, Scope


class PromptError(Exception):
    pass


# What a template may render to: as much as an instruction file may hold (MAX_FILE_BYTES).
MAX_PROMPT_BYTES = 4 * 1024 * 1024


# Text with none of these is its own rendering: jinja2 (~20 ms to import) is not needed at all.
# A carriage return counts as markup too: jinja2 would normalize the newlines.
_MARKUP = ("{{", "{%", "{#", "\r")


class Instruction:
    def __init__(self, source: str, origin: str) -> None:
        self.origin = origin
        self._plain: str | None = None
        if not any(m in source for m in _MARKUP):
            self._plain = source
            return
        from jinja2 import StrictUndefined, TemplateSyntaxError
        from jinja2.sandbox import SandboxedEnvironment

        env = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as exc:
            raise PromptError(f"{origin}:{exc.lineno}: template error: {exc.message}") from None

    def render(self, *, pwd: str, scope: Scope, tools: list[str]) -> str:
        if self._plain is not None:
            return self._plain
        context: dict[str, Any] = {
            "now": datetime.datetime.now().astimezone(),
            "pwd": pwd,
            "scope": scope_summary(scope),
            "tools": tools,
            "agents_md": read_agents_md(pwd, scope),
        }
        try:
            text = self._template.render(context)
        except Exception as exc:
            # Not only jinja2's own errors: whatever an expression raises (`{{ 1/0 }}`, a range
            # past the sandbox's MAX_RANGE, `{% include %}` with no loader, a macro calling
            # itself) is the template's fault too, and would otherwise end start-up in a
            # traceback (exit 1, which systemd restarts) instead of one line (exit 78).
            line = _template_line(exc)
            where = f"{self.origin}:{line}" if line else self.origin
            raise PromptError(f"{where}: template error: {exc}") from None
        # Bounded as an instruction file is: `{{ "x" * 10**8 }}` made a 100 MB session_start
        # entry that the history could not page and every model call carried.
        size = len(text.encode("utf-8", "replace"))
        if size > MAX_PROMPT_BYTES:
            raise PromptError(
                f"{self.origin}: template error: it renders to {size} bytes, more than "
                f"{MAX_PROMPT_BYTES // (1024 * 1024)} MiB"
            )
        return text


def load_instruction(
    instruction: str | None, instruction_file: str | None, origin: str
) -> Instruction:
    if instruction_file:
        from poddaemon.config.load import read_bounded

        try:
            # Not waiting for a FIFO's writer: the file may lie where the model writes, and
            # `mkfifo` there hung every later start, deaf to SIGTERM (as AGENTS.md did).
            raw = read_bounded(instruction_file, wait=False)
        except OSError as exc:
            raise PromptError(
                f"{origin}: worker.instruction_file: cannot read {instruction_file}: {exc.strerror}"
            ) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(
                f"{origin}: worker.instruction_file: {instruction_file} is not UTF-8 "
                f"({exc.reason} at byte {exc.start})"
            ) from None
        # As a text-mode open() read it: universal newlines.
        return Instruction(text.replace("\r\n", "\n").replace("\r", "\n"), instruction_file)
    return Instruction(instruction or "", f"{origin}: worker.instruction")


def scope_summary(scope: Scope) -> str:
    parts = [
        f"{r.target} ({r.access.label}{'' if r.recursive else ', top level'})" for r in scope.allow
    ]
    parts += [f"not {r.target}" for r in scope.deny]
    return "; ".join(parts)


def read_agents_md(pwd: str, scope: Scope) -> str:
    path = os.path.join(pwd, "AGENTS.md")
    try:
        if scope.access(os.path.realpath(path)) < Access.READ:
            return ""
        # A regular file only, opened without waiting: the pod's pwd is the model's to write,
        # and `mkfifo AGENTS.md` there hung every later start in open(), deaf to SIGTERM.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, encoding="utf-8", errors="replace") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            return f.read(64 * 1024)
    except OSError:
        return ""


def _template_line(exc: Exception) -> int | None:
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
