"""Deny rules by identity: a denied entry moved or hard-linked to an allowed name stays denied.

The scope judges paths. A command may rename an entry in a directory it can write (Landlock
cannot refuse renaming one child of a directory and allow the others), so `mv secrets public`
would hand the file tools, which judge `public/key` by its new name, what the deny rule was
for. Each deny target's `(st_dev, st_ino)` is recorded when the rule is first seen, and an
opened object that is, or lies below, a recorded one keeps at most that rule's cap, wherever it
is now. A target made or replaced after start is recorded at the next check (its earlier
object stays recorded while it is anywhere). Rules that go (a child's delegated area handed
back) take their identities with them.
Each recorded target is held open (`O_PATH`), as a Landlock rule holds its inode: deleted, its
inode number cannot be reused by an unrelated file while it is recorded.
"""

import contextlib
import os
import threading
from collections.abc import Iterable

from poddaemon.scope import Access, Rule, ScopeDenied

Identity = tuple[int, int]


class DeniedObjects:
    def __init__(self) -> None:
        # target -> what was found there, oldest first: (fd, identity, cap) per object
        self._by_target: dict[str, list[tuple[int, Identity, Access]]] = {}
        self._caps: dict[Identity, Access] = {}
        # note() runs from the event loop (scope changes) and from tools' worker threads
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._caps)

    def note(self, denies: Iterable[Rule]) -> None:
        """The live deny rules: record what each target is now (one made or replaced since
        the last call too: an earlier object moved away stays recorded), forget the targets no
        rule names any more and objects removed from every directory (nothing can open them
        again, so their inode numbers may go to new files). Called before every check."""
        with self._lock:
            self._note(denies)

    def _note(self, denies: Iterable[Rule]) -> None:
        old = self._by_target
        kept: dict[str, list[tuple[int, Identity, Access]]] = {}
        for rule in denies:
            records = kept.get(rule.target)
            if records is None:
                records = []
                for fd, identity, cap in old.pop(rule.target, []):
                    if os.fstat(fd).st_nlink == 0:
                        os.close(fd)
                    else:
                        records.append((fd, identity, cap))
                with contextlib.suppress(OSError):
                    st = os.stat(rule.target)
                    if all(i != (st.st_dev, st.st_ino) for _, i, _ in records):
                        fd = os.open(rule.target, os.O_PATH | os.O_CLOEXEC)
                        st = os.fstat(fd)
                        records.append((fd, (st.st_dev, st.st_ino), rule.deny_cap))
            kept[rule.target] = [(fd, i, min(cap, rule.deny_cap)) for fd, i, cap in records]
        self._close()  # the rules that went
        self._by_target = kept
        self._caps = {}
        for records in kept.values():
            for _, identity, cap in records:
                self._caps[identity] = min(cap, self._caps.get(identity, Access.WRITE))

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for records in self._by_target.values():
            for fd, _, _ in records:
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
