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
inode number cannot be reused by an unrelated file while it is recorded. A non-recursive rule
caps its target and the target's direct entries only, as the scope does: what lies deeper in a
recorded directory keeps its own access.
"""

import contextlib
import os
import threading
from collections.abc import Callable, Iterable

from poddaemon.scope import Access, Rule, ScopeDenied

Identity = tuple[int, int]
Target = tuple[str, bool]  # a deny rule's target, and whether it is recursive


class DeniedObjects:
    def __init__(self) -> None:
        # target -> what was found there, oldest first: (fd, identity, cap) per object
        self._by_target: dict[Target, list[tuple[int, Identity, Access]]] = {}
        self._caps: dict[Identity, Access] = {}  # of recursive rules: the object and all below
        self._near: dict[Identity, Access] = {}  # of the others: the object and its entries
        # note() runs from the event loop (scope changes) and from tools' worker threads
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._caps or self._near)

    def note(self, denies: Iterable[Rule]) -> None:
        """The live deny rules: record what each target is now (one made or replaced since
        the last call too: an earlier object moved away stays recorded), forget the targets no
        rule names any more and objects removed from every directory (nothing can open them
        again, so their inode numbers may go to new files). Called before every check."""
        with self._lock:
            self._note(denies)

    def _note(self, denies: Iterable[Rule]) -> None:
        old = self._by_target
        kept: dict[Target, list[tuple[int, Identity, Access]]] = {}
        for rule in denies:
            key = (rule.target, rule.recursive)
            records = kept.get(key)
            if records is None:
                records = []
                for fd, identity, cap in old.pop(key, []):
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
            kept[key] = [(fd, i, min(cap, rule.deny_cap)) for fd, i, cap in records]
        self._close()  # the rules that went
        self._by_target = kept
        for (_, recursive), records in kept.items():
            caps = self._caps if recursive else self._near
            for _, identity, cap in records:
                caps[identity] = min(cap, caps.get(identity, Access.WRITE))

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for records in self._by_target.values():
            for fd, _, _ in records:
                os.close(fd)
        self._by_target = {}
        self._caps = {}
        self._near = {}

    def check(self, fd: int, name: str, path: str, want: Access) -> None:
        """ScopeDenied if the object behind `fd` (or its entry `name`), or a directory above
        it, is a denied entry that may not give `want`. `path`: where `fd` is now."""
        found = []  # (what is there, how many levels above the object judged)
        if name:
            with contextlib.suppress(OSError):  # not made yet: its directory decides
                found.append((os.stat(name, dir_fd=fd, follow_symlinks=False), 0))
        depth = 1 if name else 0
        found.append((os.fstat(fd), depth))
        parent = path
        while parent != "/":
            parent = os.path.dirname(parent)
            depth += 1
            found.append((os.lstat(parent), depth))
        for st, above in found:
            identity = (st.st_dev, st.st_ino)
            self._refuse_if_capped(self._caps.get(identity), path, name, want)
            if above <= 1:
                self._refuse_if_capped(self._near.get(identity), path, name, want)

    def walker(self) -> Callable[[str], Access | None]:
        """For a walk over many paths (glob): the cap the rules give the object at a resolved
        path by identity (None: none), as `check` judges an opened one, each directory above
        it looked at once per walk, not once per path. A denied directory moved into the tree
        gave glob every name in it, where list_dir and read_file refused it (found by QA)."""
        with self._lock:
            caps, near = dict(self._caps), dict(self._near)
        if not caps and not near:
            return lambda path: None
        seen: dict[str, tuple[Access | None, Access | None]] = {}  # dir -> (below it, entries)

        def identity(path: str) -> Identity | None:
            try:
                st = os.lstat(path)
            except OSError:
                return None  # gone: whatever is opened there later is judged then
            return st.st_dev, st.st_ino

        def directory(path: str) -> tuple[Access | None, Access | None]:
            """The cap of everything below `path` (recursive rules on it and above), and the
            cap of its direct entries (a rule that is not recursive on it, too)."""
            if path not in seen:
                parent = os.path.dirname(path)
                below = directory(parent)[0] if parent != path else None
                i = identity(path)
                below = _least(below, caps.get(i)) if i is not None else below
                seen[path] = below, _least(below, near.get(i)) if i is not None else below
            return seen[path]

        def cap(path: str) -> Access | None:
            i = identity(path)
            own = None if i is None else _least(caps.get(i), near.get(i))
            return _least(own, directory(os.path.dirname(path))[1])

        return cap

    @staticmethod
    def _refuse_if_capped(cap: Access | None, path: str, name: str, want: Access) -> None:
        if cap is not None and cap < want:
            shown = os.path.join(path, name) if name else path
            raise ScopeDenied(f"{shown} (a denied entry moved or linked there)", want, cap)


def _least(a: Access | None, b: Access | None) -> Access | None:
    """The tighter of two caps (None: no cap)."""
    if a is None:
        return b
    return a if b is None else min(a, b)
