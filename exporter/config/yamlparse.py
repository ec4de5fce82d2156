"""YAML text to plain data with the line of every key, refusing what a config must not hold
(alias bombs, deep nesting, merge keys, non-default tags on collections). Imported only by
``yamlconf.parse_document``, so that commands that read no YAML never import PyYAML."""

from __future__ import annotations

from typing import Any

import yaml

from exporter.config.yamlconf import ConfigError, dotted_key

#: What one document may expand to: an alias bomb ("billion laughs"), an alias inside itself or
#: deep nesting ends in a ConfigError instead of exhausting memory, time or the stack.
MAX_VALUES = 100_000
MAX_DEPTH = 50
_MERGE_TAG = "tag:yaml.org,2002:merge"
#: The only tags a mapping or a list may carry (the default ones): _build makes plain dicts and
#: lists, so any other (!!set, !!omap, !!python/...) would otherwise be silently dropped.
_COLLECTION_TAGS = {
    yaml.MappingNode: "tag:yaml.org,2002:map",
    yaml.SequenceNode: "tag:yaml.org,2002:seq",
}


def _construct(node: yaml.Node, loader: yaml.SafeLoader) -> Any:
    """The scalar at ``node``; a value its tag cannot hold (``!!int x``, ``2024-13-45``) is a
    located error instead of the constructor's own exception."""
    try:
        return loader.construct_object(node, deep=True)
    except yaml.YAMLError:
        raise
    except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError):
        text = node.value if isinstance(node.value, str) else ""
        shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
        tag = str(node.tag).rpartition(":")[2] or str(node.tag)
        raise ConfigError(
            f"?:{node.start_mark.line + 1}", "", f"{shown} is not a valid {tag}"
        ) from None


def _build(
    node: yaml.Node,
    keys: tuple[Any, ...],
    doc_lines: dict,
    loader: yaml.SafeLoader,
    budget: list[int],
) -> Any:
    line = node.start_mark.line + 1
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(f"?:{line}", "", f"more than {MAX_VALUES} values (an alias bomb?)")
    if len(keys) > MAX_DEPTH:
        why = f"nested more than {MAX_DEPTH} levels deep (an alias inside itself?)"
        raise ConfigError(f"?:{line}", "", why)
    doc_lines[keys] = line
    expected = _COLLECTION_TAGS.get(type(node)) if isinstance(node, yaml.CollectionNode) else None
    if expected is not None and node.tag != expected:
        raise ConfigError(f"?:{line}", dotted_key(keys), f"unsupported tag {node.tag!r}")
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                raise ConfigError(
                    f"?:{key_node.start_mark.line + 1}",
                    "",
                    "merge keys (<<) are not supported: write the keys out",
                )
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(f"?:{key_node.start_mark.line + 1}", "", "keys must be scalars")
            key = _construct(key_node, loader)
            if key in out:
                raise ConfigError(
                    f"?:{key_node.start_mark.line + 1}", dotted_key((*keys, key)), "duplicate key"
                )
            out[key] = _build(value_node, (*keys, key), doc_lines, loader, budget)
            doc_lines[(*keys, key)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _build(item, (*keys, i), doc_lines, loader, budget) for i, item in enumerate(node.value)
        ]
    return _construct(node, loader)


def parse_yaml(text: str, path: str) -> tuple[Any, dict[tuple[Any, ...], int]]:
    """The data of YAML ``text`` and the line of each key path; ConfigError on bad YAML."""
    lines: dict[tuple[Any, ...], int] = {}
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # rejects control characters already
        node = loader.get_single_node()
        data = None if node is None else _build(node, (), lines, loader, [MAX_VALUES])
    except ConfigError as exc:
        raise ConfigError(exc.where.replace("?", path, 1), exc.key, exc.why) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        char = f"#x{exc.character:04x}" if isinstance(exc.character, int) else exc.character
        raise ConfigError(
            f"{path}:{line}", "", f"invalid YAML: character {char}: {exc.reason}"
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f":{mark.line + 1}" if mark else ""
        why = " ".join(str(exc.problem or exc).split())
        raise ConfigError(f"{path}{at}", "", f"invalid YAML: {why}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, "", f"invalid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:  # the composer recurses once per level, before _build sees any
        raise ConfigError(path, "", "invalid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines
