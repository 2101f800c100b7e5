"""The yaml checking under hosts.yaml's parser: a walk over the composed node tree in which every problem
names its line, all of a file's problems are collected (the first becomes the error, the rest its `more`)."""
from __future__ import annotations

import yaml

from ..errors import ConfigError
from ..words import did_you_mean


def did_you_mean_text(word: str, options) -> str:
    """` — did you mean 'x'?` for the closest option (words.did_you_mean), else ''."""
    close = did_you_mean(word, options)
    return f" — did you mean {close!r}?" if close else ""


class Problem(Exception):
    """One problem found while checking (collected by Checker.collect, so that the walk goes on)."""

    def __init__(self, error: ConfigError):
        super().__init__(str(error))
        self.error = error


MAX_DEPTH = 64  # hosts.yaml needs about 5 levels; the composer recurses, so 100,000 would be a RecursionError
MAX_EXPANDED = 2_000_000  # nodes + scalar characters once aliases are expanded (256 KiB of text: < 500,000)


class _Loader(yaml.SafeLoader):
    """SafeLoader with bounds, as one-line errors: nesting deeper than MAX_DEPTH, and values that yaml aliases
    expand past MAX_EXPANDED (a few hundred bytes of nested aliases expand to gigabytes wherever a value is
    walked: str(), the repr in an error) or into themselves. Plain aliases (yaml.safe_dump writes them for a
    shared value) still load."""

    def __init__(self, text: str, path: str):
        super().__init__(text)
        self.path, self.depth = path, 0

    def _refuse(self, mark, msg: str, hint: str):
        raise ConfigError(f"{self.path} line {mark.line + 1}: {msg}", hint=hint)

    def compose_node(self, parent, index):
        if self.depth >= MAX_DEPTH:
            self._refuse(self.peek_event().start_mark, f"nested more than {MAX_DEPTH} levels deep",
                         "a host's settings need about 5 levels")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def get_single_node(self):
        root = super().get_single_node()
        if root is not None:
            self._check_expansion(root)
        return root

    def _check_expansion(self, root) -> None:
        """The size and depth of every node with its aliases expanded: iterative, each node once."""
        size: dict[int, int] = {}
        depth: dict[int, int] = {}
        open_: set[int] = set()  # nodes whose subtree is being walked: meeting one again is a cycle
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            k = id(node)
            kids = ([c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
            if done:
                open_.discard(k)
                size[k] = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0) \
                    + sum(size[id(c)] for c in kids)
                depth[k] = 1 + max((depth[id(c)] for c in kids), default=0)
                if size[k] > MAX_EXPANDED:
                    self._refuse(node.start_mark, f"this value expands through yaml aliases (*name) to more than "
                                 f"{MAX_EXPANDED:,} nodes and characters", "write it out without nested aliases")
                if depth[k] > MAX_DEPTH:
                    self._refuse(node.start_mark, f"nested more than {MAX_DEPTH} levels deep (through yaml aliases)",
                                 "a host's settings need about 5 levels")
            elif k in open_:
                self._refuse(node.start_mark, "a yaml alias (*name) refers to the value that contains it",
                             "write the value out instead")
            elif k not in size:
                open_.add(k)
                stack.append((node, True))
                stack.extend((c, False) for c in kids if id(c) not in size)


class Checker:
    """Walks the composed yaml node tree so that every error can name its line; collects them all."""

    def __init__(self, text: str, path: str):
        self.path = path
        self.loader = _Loader(text, path)
        self.problems: list[ConfigError] = []

    def fail(self, node, msg: str, hint: str | None = None):
        line = node.start_mark.line + 1 if node is not None else 1
        raise Problem(ConfigError(f"{self.path} line {line}: {msg}", hint=hint))

    def collect(self, fn, *args, **kw):
        """fn(*args, **kw), or None after recording the problem it raised."""
        try:
            return fn(*args, **kw)
        except Problem as p:
            self.problems.append(p.error)
            return None

    def raise_problems(self) -> None:
        if self.problems:
            first, *more = self.problems
            raise ConfigError(str(first), hint=first.hint, more=more)

    def value(self, node):
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as e:  # e.g. a tag SafeLoader refuses (!!python/object)
            self.fail(node, f"cannot read this value ({getattr(e, 'problem', None) or e})")

    def mapping(self, node, what: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        """[(key, key_node, value_node)] of a mapping node; duplicate keys are an error (PyYAML keeps the last)."""
        if not isinstance(node, yaml.MappingNode):
            self.fail(node, f"{what} must be a mapping (key: value lines)")
        seen: dict[str, yaml.Node] = {}
        out = []
        for k, v in node.value:
            key = self.collect(self.value, k)
            if not isinstance(key, str):
                self.collect(self.fail, k, f"{what}: key {key!r} must be a name")
            elif key in seen:
                self.collect(self.fail, k, f"duplicate {what} key {key!r} (first at line "
                             f"{seen[key].start_mark.line + 1})",
                             hint="yaml keeps only the last one: remove or rename one of them")
            else:
                seen[key] = k
                out.append((key, k, v))
        return out

    def section(self, node, host: str, what: str, keys: dict):
        """(key, value node, typed value) of a host's nested mapping (venv:, slurm:); unknown keys fail."""
        for key, kn, vn in self.mapping(node, f"host {host!r} {what}"):
            if key not in keys:  # recorded; the other keys are still checked
                self.collect(self.fail, kn,
                             f"unknown key {key!r} in host {host!r} {what}{did_you_mean_text(key, keys)}",
                             hint=f"{what} keys: {', '.join(keys)}")
                continue
            types, expect = keys[key]
            try:
                yield key, vn, self.typed(vn, types, f"host {host!r}: {what}.{key}", expect)
            except Problem as p:
                self.problems.append(p.error)

    def typed(self, node, types: tuple, where: str, expect: str):
        val = self.value(node)
        if isinstance(val, bool) and bool not in types or not isinstance(val, types):
            self.fail(node, f"{where} must be {expect}, got {type(val).__name__} {val!r}")
        return val
