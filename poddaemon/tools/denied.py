"""Deny rules by identity: a denied entry moved or hard-linked to an allowed name stays denied.

The scope judges paths. A command may rename an entry in a directory it can write (Landlock
cannot refuse renaming one child of a directory and allow the others), so `mv secrets public`
would hand the file tools, which judge `public/key` by its new name, what the deny rule was
for. Each deny target's `(st_dev, st_ino)` is recorded when the rule is first seen, and an
opened object that is, or lies below, a recorded one keeps at most that rule's cap, wherever it
is now. Rules that go (a child's delegated area handed back) take their identities with them.
Each recorded target is held open (`O_PATH`), as a Landlock rule holds its inode: deleted, its
inode number cannot be reused by an unrelated file while it is recorded.
"""

import contextlib
import os
from collections.abc import Iterable

from poddaemon.scope import Access, Rule, ScopeDenied

Identity = tuple[int, int]


class DeniedObjects:
    def __init__(self) -> None:
        self._by_target: dict[str, tuple[int, Identity, Access]] = {}  # target -> (fd, id, cap)
        self._caps: dict[Identity, Access] = {}

    def __bool__(self) -> bool:
        return bool(self._caps)

    def note(self, denies: Iterable[Rule]) -> None:
        """The live deny rules: record the targets not seen before (as they are now), forget
        those no rule names any more. A target that does not exist yet is looked at again at
        the next call."""
        kept: dict[str, tuple[int, Identity, Access]] = {}
        for rule in denies:
            known = kept.get(rule.target) or self._by_target.pop(rule.target, None)
            if known is None:
                try:
                    fd = os.open(rule.target, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue
                st = os.fstat(fd)
                known = (fd, (st.st_dev, st.st_ino), rule.deny_cap)
            kept[rule.target] = (known[0], known[1], min(known[2], rule.deny_cap))
        self.close()  # the rules that went
        self._by_target = kept
        self._caps = {}
        for _, identity, cap in kept.values():
            self._caps[identity] = min(cap, self._caps.get(identity, Access.WRITE))

    def close(self) -> None:
        for fd, _, _ in self._by_target.values():
            os.close(fd)
        self._by_target = {}
        self._caps = {}

    def check(self, fd: int, name: str, path: str, want: Access) -> None:
        """ScopeDenied if the object behind `fd` (or its entry `name`), or a directory above
        it, is a denied entry that may not give `want`. `path`: where `fd` is now."""
        caps = self._caps
        stats = []
        if name:
            with contextlib.suppress(OSError):  # not made yet: its directory decides
                stats.append(os.stat(name, dir_fd=fd, follow_symlinks=False))
        stats.append(os.fstat(fd))
        for st in stats:
            self._refuse_if_capped(caps.get((st.st_dev, st.st_ino)), path, name, want)
        parent = path
        while parent != "/":
            parent = os.path.dirname(parent)
            st = os.lstat(parent)
            self._refuse_if_capped(caps.get((st.st_dev, st.st_ino)), path, name, want)

    @staticmethod
    def _refuse_if_capped(cap: Access | None, path: str, name: str, want: Access) -> None:
        if cap is not None and cap < want:
            shown = os.path.join(path, name) if name else path
            raise ScopeDenied(f"{shown} (a denied entry moved or linked there)", want, cap)
