"""The yaml checking under hosts.yaml's parser: a walk over the composed node tree in which every problem
names its line, all of a file's problems are collected (the first becomes the error, the rest its `more`)."""
from __future__ import annotations

import yaml

from . import argparsing
from .errors import ConfigError


def did_you_mean(word: str, options) -> str:
    """` — did you mean 'x'?` for the closest option (argparsing.did_you_mean), else ''."""
    close = argparsing.did_you_mean(word, options)
    return f" — did you mean {close!r}?" if close else ""


class Problem(Exception):
    """One problem found while checking (collected by Checker.collect, so that the walk goes on)."""

    def __init__(self, error: ConfigError):
        super().__init__(str(error))
        self.error = error


class Checker:
    """Walks the composed yaml node tree so that every error can name its line; collects them all."""

    def __init__(self, text: str, path: str):
        self.path = path
        self.loader = yaml.SafeLoader(text)
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
                self.collect(self.fail, kn, f"unknown key {key!r} in host {host!r} {what}{did_you_mean(key, keys)}",
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
