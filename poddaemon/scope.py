"""Scope rules: which paths a pod may read or write (SPEC §4).

Everything here is pure except `resolve` (and `Scope.check`, which calls it): rules and scopes are
values, paths given to `Scope.access` must already be absolute and resolved.

Paths are compared by components, never by string prefix: `/a/bc` is not under `/a/b`.
"""

import os
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any, Protocol

import msgspec

__all__ = [
    "Access",
    "Rule",
    "Scope",
    "ScopeDenied",
    "resolve",
    "write_overlap",
]


class Access(IntEnum):
    NONE = 0
    READ = 1
    WRITE = 2

    @classmethod
    def parse(cls, text: str) -> "Access":
        """`"read"` or `"write"` (a manifest `permission`)."""
        if text == "read":
            return cls.READ
        if text == "write":
            return cls.WRITE
        raise ValueError(f"permission must be 'read' or 'write', not {text!r}")

    @property
    def label(self) -> str:
        return self.name.lower()


class ScopeDenied(Exception):
    """A path outside the scope; the message is what the model sees as a tool error."""

    def __init__(self, path: str, want: Access, has: Access, why: str = "") -> None:
        super().__init__(f"outside scope: {path} ({why or f'needs {want.label}, has {has.label}'})")
        self.path = path
        self.want = want
        self.has = has


def _below(target: str, path: str) -> int | None:
    """How many components `path` lies below `target` (0: the same path), or None if not below.

    Both must be normalized absolute paths. Comparing at a separator boundary is component
    matching: `/a/bc` is not below `/a/b`.
    """
    if path == target:
        return 0
    prefix = target if target.endswith("/") else target + "/"  # only "/" ends with a slash
    if not path.startswith(prefix):
        return None
    return path[len(prefix) :].count("/") + 1


class Rule(msgspec.Struct, frozen=True, kw_only=True):
    """One allow or deny rule. For a deny rule, `access` is the permission being denied:
    WRITE caps the path at READ, READ removes access entirely."""

    target: str  # absolute, resolved
    access: Access
    recursive: bool = True

    def covers(self, path: str) -> bool:
        """Recursive: the target and everything below; otherwise the target and its children."""
        depth = _below(self.target, path)
        if depth is None:
            return False
        return self.recursive or depth <= 1

    def contains(self, other: "Rule") -> bool:
        """Every path `other` covers is covered by this rule too."""
        if self.recursive:
            return self.covers(other.target)
        # A non-recursive rule covers one level; only a non-recursive rule on the same target fits.
        return not other.recursive and other.target == self.target

    def intersection(self, other: "Rule") -> "Rule | None":
        """A rule covering at least every path both cover (None when they share none).

        Two rules share a path only when one's target is covered by the other. When the
        shallower rule is non-recursive and the deeper target is its child, the true intersection
        is that single path; a non-recursive rule there is a slight superset, which keeps callers
        conservative. The result's `access` is WRITE; only its area means anything.
        """
        if self.covers(other.target):
            deeper = other.target
        elif other.covers(self.target):
            deeper = self.target
        else:
            return None
        return Rule(
            target=deeper, access=Access.WRITE, recursive=self.recursive and other.recursive
        )

    def denied_by(self, denies: Iterable["Rule"], *, max_cap: "Access" = Access.READ) -> bool:
        """Every path this rule covers is covered by one deny rule capping at `max_cap` or less
        (the default: at least write is denied).

        One deny must do it alone: a rule's area reaches arbitrarily deep (recursive) or holds
        arbitrarily many children, so only a single deny containing it can cover all of it.
        """
        return any(d.deny_cap <= max_cap and d.contains(self) for d in denies)

    @property
    def deny_cap(self) -> Access:
        """The most a path covered by this rule, read as a deny rule, may keep."""
        return Access.READ if self.access >= Access.WRITE else Access.NONE


class _ConfigRule(Protocol):
    """What the manifest's rule Structs look like (target, permission, recursive)."""

    @property
    def target(self) -> str: ...
    @property
    def permission(self) -> str: ...
    @property
    def recursive(self) -> bool: ...


ConfigRule = tuple[str, str, bool] | _ConfigRule


def _config_rule(spec: ConfigRule, cwd: str) -> Rule:
    if isinstance(spec, tuple):
        target, permission, recursive = spec
    else:
        target, permission, recursive = spec.target, spec.permission, spec.recursive
    return Rule(target=resolve(target, cwd), access=Access.parse(permission), recursive=recursive)


def resolve(path: str, cwd: str) -> str:
    """Absolute and resolved: symlinks and `..` followed as the kernel would.

    `realpath` resolves the existing part of the path and keeps a not-yet-existing tail as
    written (normalized), so a new file is judged by its nearest existing ancestor. A symlink
    inside the scope pointing outside resolves outside, which is why we never match unresolved
    paths.
    """
    return os.path.realpath(os.path.join(cwd, os.fspath(path)))


PRIVATE = "poddaemon's own files (session logs, registry, sockets, keys): no tool may touch them"


class Scope(msgspec.Struct, frozen=True):
    allow: tuple[Rule, ...]
    deny: tuple[Rule, ...] = ()
    # This user's poddaemon directories (data, runtime, logs, config), resolved: no access
    # whatever the rules say (a scope of ~ covers them; write_file on pods.json would stop
    # every pod). Not a rule users write or see: not in `summary`, not in the registry.
    private: tuple[str, ...] = ()

    @classmethod
    def from_config(
        cls,
        allow: Iterable[ConfigRule],
        deny: Iterable[ConfigRule] = (),
        *,
        cwd: str | None = None,
    ) -> "Scope":
        """From manifest rules: `(target, "read"|"write", recursive)` tuples or objects with
        those attributes. Relative targets are relative to `cwd` (default: the process cwd)."""
        base = cwd if cwd is not None else os.getcwd()
        return cls(
            allow=tuple(_config_rule(r, base) for r in allow),
            deny=tuple(_config_rule(r, base) for r in deny),
        )

    def access(self, path: str) -> Access:
        """Highest covering allow, capped by every covering deny. `path` must be resolved."""
        if self.private and self._private(path):
            return Access.NONE
        best = Access.NONE
        for rule in self.allow:
            if rule.access > best and rule.covers(path):
                best = rule.access
        for rule in self.deny:
            if best > Access.NONE and rule.covers(path):
                best = min(best, rule.deny_cap)
        return best

    def check(self, path: str, want: Access, cwd: str) -> str:
        """Resolve `path` against `cwd` and return it if it has `want` access; else ScopeDenied."""
        resolved = resolve(path, cwd)
        has = self.access(resolved)
        if has < want:
            why = PRIVATE if self.private and self._private(resolved) else ""
            raise ScopeDenied(resolved, want, has, why)
        return resolved

    def _private(self, path: str) -> bool:
        return any(_below(top, path) is not None for top in self.private)

    def with_delegated(self, areas: Iterable["str | Rule"]) -> "Scope":
        """This scope minus write access in `areas` (handed to live children): a child's write
        rule, or a target (the whole tree below it). A non-recursive rule takes the target and
        its direct entries only: deeper paths stay this scope's."""
        extra: list[Rule] = []
        for area in areas:
            target = area if isinstance(area, str) else area.target
            if not os.path.isabs(target):
                raise ValueError(f"delegated target must be absolute: {target!r}")
            recursive = isinstance(area, str) or area.recursive
            rule = Rule(target=os.path.normpath(target), access=Access.WRITE, recursive=recursive)
            if rule not in self.deny and rule not in extra:
                extra.append(rule)
        if not extra:
            return self
        return msgspec.structs.replace(self, deny=self.deny + tuple(extra))

    def writable_rules(self) -> tuple[Rule, ...]:
        """Write allow rules that this scope's own denies do not take away entirely."""
        return tuple(
            r for r in self.allow if r.access is Access.WRITE and not r.denied_by(self.deny)
        )

    def summary(self) -> list[dict[str, Any]]:
        """For status output and pods.json: `{target, permission, recursive}`, denies marked."""
        out: list[dict[str, Any]] = [
            {"target": r.target, "permission": r.access.label, "recursive": r.recursive}
            for r in self.allow
        ]
        out.extend(
            {
                "target": r.target,
                "permission": r.access.label,
                "recursive": r.recursive,
                "deny": True,
            }
            for r in self.deny
        )
        return out

    def to_dicts(self) -> list[dict[str, Any]]:
        return self.summary()

    @classmethod
    def from_dicts(cls, items: Iterable[Mapping[str, Any]]) -> "Scope":
        """Inverse of `to_dicts`. Targets are taken as stored (they were resolved when made)."""
        allow: list[Rule] = []
        deny: list[Rule] = []
        for item in items:
            target = item["target"]
            if not isinstance(target, str) or not os.path.isabs(target):
                raise ValueError(f"scope target must be an absolute path: {target!r}")
            rule = Rule(
                target=target,
                access=Access.parse(item["permission"]),
                recursive=bool(item.get("recursive", True)),
            )
            (deny if item.get("deny") else allow).append(rule)
        return cls(allow=tuple(allow), deny=tuple(deny))


Mount = tuple[str, str, str]  # (mount point, device "major:minor", root within that device)


def on_devices(scope: Scope, mounts: Sequence[Mount]) -> Scope:
    """`scope` with each target named by what it is rather than by the path that reaches it:
    `/@<device><path within the device's file system>`, through the mount that holds it (the
    longest mount point above it; the last mounted of equal ones), plus the files of every
    mount under a target. A bind mount's paths and the originals then name the same targets,
    and write_overlap sees that they overlap.

    `mounts` as /proc/self/mountinfo lists them, in its order."""

    def where(path: str) -> str:
        found = _on_device(path, mounts)
        return path if found is None else f"/@{found[0]}{found[1]}"

    def moved(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
        return tuple(msgspec.structs.replace(r, target=where(r.target)) for r in rules)

    def below(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
        """What a rule reaches through mounts under its target: their files, by device."""
        return tuple(
            msgspec.structs.replace(r, target=f"/@{device}{root}")
            for r in rules
            for point, device, root in mounts
            if r.recursive and point != r.target and r.covers(point)
        )

    return Scope(allow=moved(scope.allow) + below(scope.allow), deny=moved(scope.deny))


def _on_device(path: str, mounts: Sequence[Mount]) -> tuple[str, str] | None:
    """(device, path within its file system) of `path`, through the mount that holds it (the
    longest mount point above it; the last mounted of equal ones); None outside every mount."""
    best: Mount | None = None
    for mount in mounts:
        if _below(mount[0], path) is not None and (best is None or len(mount[0]) >= len(best[0])):
            best = mount
    if best is None:
        return None
    point, device, root = best
    rest = path[len(point) :].lstrip("/")
    return device, f"{root.rstrip('/')}/{rest}" if rest else root


def aliases(path: str, mounts: Sequence[Mount]) -> list[str]:
    """The other paths that reach the files under `path` through mounts (a bind mount of it
    or of a directory above it, or of one below it): poddaemon's own directories mounted into
    a scope are still its own there. `mounts` as for `on_devices`."""
    found = _on_device(path, mounts)
    if found is None:
        return []
    device, inner = found
    out: list[str] = []
    for point, dev, root in mounts:
        if dev != device:
            continue
        if _below(root, inner) is not None:  # the mount shows `path`, somewhere under its point
            rest = inner[len(root) :].lstrip("/")
            alias = f"{point.rstrip('/')}/{rest}" if rest else point
        elif _below(inner, root) is not None:  # it shows a part of `path`: all of it is ours
            alias = point
        else:
            continue
        if alias != path and alias not in out:
            out.append(alias)
    return out


def device_path(target: str) -> str:
    """The path within its device of an `on_devices` target (for messages)."""
    return "/" + target.split("/", 2)[2] if target.startswith("/@") else target


def write_overlap(a: Scope, b: Scope) -> str | None:
    """A path both scopes can write, or None. Read never conflicts.

    Compares write allow rules pairwise; an overlap whose whole area is denied by either scope
    (e.g. an area a parent delegated to a child) does not count. Other denies are ignored, which
    errs towards reporting a conflict. Deterministic and symmetric: the smallest such path.
    """
    found: list[str] = []
    for ra in a.allow:
        if ra.access is not Access.WRITE:
            continue
        for rb in b.allow:
            if rb.access is not Access.WRITE:
                continue
            inter = ra.intersection(rb)
            if inter is None or inter.denied_by(a.deny) or inter.denied_by(b.deny):
                continue
            found.append(inter.target)
    return min(found) if found else None

